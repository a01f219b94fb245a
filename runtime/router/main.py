"""The router process: `run_router(config, runtime_dir)` serves until interrupted.

Start-up: the client socket is bound first (a taken address fails at once), with CURVE
and zmq.auth's authenticator when ``auth_dir`` is given, exactly as a server's frontend
(frontend/main.py); the router's gateway credential goes into its private runtime
directory (so the HTTP frontend can speak for its API keys' tenants through it); then
the replicas are dialled, and the router serves once the first one has welcomed it.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from radixlm.runtime.frontend.tenants import write_gateway_token
from radixlm.runtime.router.config import RouterConfig
from radixlm.runtime.router.server import Router
from radixlm.runtime.transport import channel
from radixlm.runtime.transport.curve_keys import (
    make_gateway_keys,
    server_socket_options,
    start_authenticator,
)
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["run_router", "tune_gc"]

log = logging.getLogger("radixlm.router")


def tune_gc() -> None:
    """Fewer, larger garbage collections: the router holds many small long-lived objects
    (tree nodes, session records, requests in flight), and the default threshold (700
    allocations) ran a young collection every few requests and a full one over all of
    them often: about a fifth of a routing decision's time (bench_router.py). Cycles
    (a dropped subtree: nodes point at their parents) are still collected."""
    gc.set_threshold(50_000, 20, 20)


def run_router(config: RouterConfig, runtime_dir: Path,
               on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until interrupted; `on_ready` gets the bound endpoint once serving."""
    tune_gc()
    ctx: zmq.Context[Any] = zmq.Context()  # the clients' side, with the authenticator
    # The replicas' side: a context of its own, so the authenticator (a ZAP handler,
    # which libzmq asks about every connection of its context) never judges the
    # router's own connections to its replicas.
    replica_ctx: zmq.Context[Any] = zmq.Context()
    authenticator: ThreadAuthenticator | None = None
    clients: zmq.Socket[Any] | None = None
    router: Router | None = None
    endpoint = config.endpoint or channel.ipc_endpoint(runtime_dir, "client")
    try:
        options: dict[int, int | bytes] = {zmq.ROUTER_MANDATORY: 1}
        if config.max_message_bytes > 0:
            options[zmq.MAXMSGSIZE] = config.max_message_bytes
        if config.auth_dir:
            accepted = make_gateway_keys(runtime_dir, Path(config.auth_dir))
            authenticator = start_authenticator(ctx, Path(config.auth_dir), accepted)
            options.update(server_socket_options(Path(config.auth_dir)))
        clients = channel.open_socket(ctx, zmq.ROUTER, endpoint, bind=True, options=options)
        monitor = clients.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        token = write_gateway_token(runtime_dir)
        router = Router(config, replica_ctx, clients, monitor, token)
        router.start_replicas()
        # the others get a moment to come up too (one that is down is dialled again
        # later and rejoins: readiness does not wait for it)
        welcome = router.wait_first(config.start_timeout_s, settle_s=config.replica_timeout_s)
        bound = channel.bound_endpoint(clients)
        log.info("router ready at %s: %d replicas (%s)", bound, len(config.replicas),
                 welcome.model)
        if on_ready is not None:
            on_ready(bound)
        router.serve()
    finally:
        try:
            if router is not None:
                router.close()
                router.client_monitor.close(linger=0)
            if clients is not None:
                clients.disable_monitor()
                clients.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
        finally:
            # destroy, not term: it closes a socket still open (one SIGTERM left untracked
            # half-way through opening it, or a close above that failed), where term()
            # would wait for it forever and the router would never exit
            replica_ctx.destroy(linger=0)
            ctx.destroy(linger=0)
            path = channel.ipc_path(endpoint)
            if path is not None:
                path.unlink(missing_ok=True)
