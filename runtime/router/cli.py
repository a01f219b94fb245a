"""``radixlm router`` (a router in front of running engines) and ``radixlm serve
--replicas N`` (N local engines behind one).

``serve --replicas N`` starts N ordinary servers, each on a private ipc socket in its own
0700 runtime directory (the same engine flags for all; the client-facing flags —
``--endpoint``, ``--auth-dir``, HTTP — belong to the router), and serves the router at
the client endpoint in this process. The HTTP API, when asked, is the router's client,
speaking for its API keys' tenants with the router's gateway credential.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from radixlm.runtime.cli.common import StopRequested, say, setup_logging, stop_on_sigterm
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.frontend.tenants import GATEWAY_TOKEN
from radixlm.runtime.router.config import ROUTING, ReplicaSpec, RouterConfig, parse_replica
from radixlm.runtime.router.main import run_router
from radixlm.runtime.settings import (
    LOG_LEVELS,
    add_settings,
    config_from_args,
    number,
    settings_of,
)
from radixlm.runtime.transport.channel import EndpointError, make_runtime_dir, parse_client_endpoint
from radixlm.runtime.transport.curve_keys import AuthDirError, check_auth_dir

__all__ = ["add_router_arguments", "add_replicas_argument", "cmd_router", "serve_replicas"]

_ROUTING = tuple(s.name for s in settings_of(RouterConfig) if s.declared.group == ROUTING)


def add_replicas_argument(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--replicas", type=number(int, ge=1), default=1, metavar="N",
                       help="start N engines (each with these engine flags) behind a "
                            "session-affine, cache-aware router serving the endpoint "
                            "(docs/deployment.md)")
    add_settings(serve, RouterConfig, only=_ROUTING)  # (--endpoint, --auth-dir: serve's)


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", required=True, metavar="SPEC",
                   help="a replica: ENDPOINT[,server_key=PATH,client_key=PATH]"
                        "[,gateway_token=PATH] (repeat for each; docs/deployment.md)")
    add_settings(p, RouterConfig, only=("endpoint",))
    p.add_argument("--endpoint-file", default=None, metavar="PATH",
                   help="once ready, write the endpoint to this file")
    add_settings(p, RouterConfig, skip=("endpoint", *_ROUTING))
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="how much the router logs (default: info)")
    add_settings(p, RouterConfig, only=_ROUTING)


def _serve_router(config: RouterConfig, endpoint_file: str | None,
                  then: Callable[[str, Path], None] | None = None) -> int:
    runtime_dir = make_runtime_dir("radixlm-router-")
    try:
        def ready(endpoint: str) -> None:
            if then is not None:
                then(endpoint, runtime_dir)
            if endpoint_file:
                _write_atomic(endpoint_file, endpoint)
            say("router", f"ready at {endpoint} ({len(config.replicas)} replicas)")

        run_router(config, runtime_dir, on_ready=ready)
        return 0
    except (KeyboardInterrupt, StopRequested):
        return 0
    except (TimeoutError, EndpointError, AuthDirError, ValueError) as e:
        say("router", str(e))
        return 1
    finally:
        for f in runtime_dir.iterdir():
            if f.is_dir():
                for g in f.iterdir():
                    g.unlink(missing_ok=True)
                f.rmdir()
            else:
                f.unlink(missing_ok=True)
        runtime_dir.rmdir()
        if endpoint_file:
            with contextlib.suppress(OSError):
                os.unlink(endpoint_file)


def _write_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".endpoint-", dir=directory)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def _check_endpoint(endpoint: str, auth_dir: str, insecure: bool) -> None:
    if auth_dir:
        check_auth_dir(Path(auth_dir))
    if endpoint:
        parse_client_endpoint(endpoint, authenticated=bool(auth_dir), insecure=insecure)


def cmd_router(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        config = config_from_args(args, RouterConfig, replicas=tuple(
            parse_replica(text) for text in args.replica))
        _check_endpoint(config.endpoint, config.auth_dir, config.insecure)
    except (ValueError, EndpointError, AuthDirError) as e:
        say("router", str(e))
        return 2
    return _serve_router(config, args.endpoint_file)


def serve_replicas(args: argparse.Namespace, config: EngineConfig) -> int:
    """``radixlm serve --replicas N``: N local engines and the router in front of them."""
    from radixlm.runtime.http.launch import HttpStartError, start_http
    from radixlm.runtime.http.main import http_config, http_listen
    from radixlm.runtime.server.children import stop_child
    from radixlm.runtime.server.launcher import RunningServer, ServerStartError, start_server
    from radixlm.runtime.server.supervise import watch_replicas

    setup_logging(config.log_level)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        _check_endpoint(config.endpoint, config.auth_dir, config.insecure)
    except (EndpointError, AuthDirError) as e:
        say("serve", str(e))
        return 1
    engine = msgspec.structs.replace(config, endpoint="", auth_dir="", insecure=False)
    servers: list[RunningServer] = []
    http_proc: list[Any] = []
    try:
        # One after another, from this thread: each engine dies with the thread that
        # started it (PR_SET_PDEATHSIG, child.die_with_parent), so no worker threads.
        for i in range(args.replicas):
            try:
                servers.append(start_server(replica_config(engine, i),
                                            start_timeout_s=args.start_timeout))
            except (ServerStartError, EndpointError) as e:
                say("serve", f"replica {i} did not start: {e}")
                return 1
        replicas = tuple(ReplicaSpec(s.endpoint, gateway_token=(
            s.runtime_dir / GATEWAY_TOKEN).read_text().strip()) for s in servers)
        watch_replicas(servers)  # a replica's process that dies is reaped and started again
        # The client-facing settings (endpoint, keys, frame size) are serve's own flags.
        router = config_from_args(args, RouterConfig, replicas=replicas,
                                  max_message_bytes=config.max_message_bytes)
        listen = None if config.auth_dir and not _http_asked(args) else http_listen(args)

        def start_http_api(endpoint: str, runtime_dir: Path) -> None:
            if listen is None:
                return
            keys = {}
            if config.auth_dir:
                keys = {"server_key": os.path.join(config.auth_dir, "server.key"),
                        "client_key": str(runtime_dir / "gateway.key_secret")}
            http = http_config(args, engine_endpoint=endpoint, listen=listen,
                               gateway_token_file=str(runtime_dir / GATEWAY_TOKEN), **keys)
            try:
                http_proc.append(start_http(http, log_level=config.log_level))
            except HttpStartError as e:
                say("serve", str(e))
                raise StopRequested from e
            say("serve", f"HTTP API at http://{http.host}:{http.port}/v1")

        return _serve_router(router, args.endpoint_file, start_http_api)
    except (KeyboardInterrupt, StopRequested):
        return 0
    finally:
        for proc in http_proc:
            stop_child(proc, "http", 10.0)  # bounded, signal-safe (transport/children.py)
        for server in servers:
            server.stop()


def replica_config(engine: EngineConfig, index: int) -> EngineConfig:
    """Replica `index`'s engine: ``--device cuda`` means GPUs of its own, from
    ``cuda:(index * tensor_parallel_size)`` on (its ranks take the next ones); a state
    directory means a folder of its own in it (one server per state directory)."""
    if engine.device == "cuda":
        base = index * max(1, engine.tensor_parallel_size)
        engine = msgspec.structs.replace(engine, device=f"cuda:{base}")
    if engine.state_dir:
        engine = msgspec.structs.replace(
            engine, state_dir=str(Path(engine.state_dir) / "replicas" / str(index)))
    return engine


def _http_asked(args: argparse.Namespace) -> bool:
    from radixlm.runtime.http.main import http_asked

    return bool(http_asked(args))
