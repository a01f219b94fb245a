"""The frontend process entry: `run_frontend(config, endpoints)`.

Start-up order: adopt the client socket the launcher bound before anything started
(listeners.py; ``endpoints.client_fd``, else bind ``endpoints.client`` here), bind the
engine->frontend pipe, wait for the engine's `EngineReady`, load the tokenizer from the
directory the engine resolved, then serve. A client that connects while the model loads
waits for its Welcome; once serving, the frontend writes the bound endpoint and the
Welcome into the runtime directory (rundir.py), which is what the launcher waits for.

The client socket is the trust boundary: its frames are size-limited by libzmq
(``--max-message-bytes``), and with ``--auth-dir`` it is a CURVE server whose clients
zmq.auth's authenticator checks against the authorized keys (curve_keys.py).

Pipes: each side binds the PULL socket it reads from and connects the PUSH socket it
writes to (the engine binds ``endpoints.to_engine``, the frontend ``endpoints.to_frontend``).
"""

from __future__ import annotations

import logging
import secrets
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import zmq
from radixlm.runtime.config import Endpoints, EngineConfig
from radixlm.runtime.engine.wire import (
    EngineBoot,
    EngineReady,
    FrontendHello,
    to_frontend_decoder,
)
from radixlm.runtime.frontend.identities import unpredictable_routing_ids
from radixlm.runtime.frontend.prepare import TextModel
from radixlm.runtime.frontend.server import Frontend, welcome_from
from radixlm.runtime.frontend.tenants import write_gateway_token
from radixlm.runtime.memory import release_free_memory
from radixlm.runtime.server.rundir import write_ready
from radixlm.runtime.transport import channel
from radixlm.runtime.transport.channel import ipc_path, open_socket
from radixlm.runtime.transport.curve_keys import (
    make_gateway_keys,
    server_socket_options,
    start_authenticator,
)
from radixlm.tokenizer import Tokenizer
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("radixlm.frontend")

TOKENIZER_THREADS = 2


def server_version() -> str:
    try:
        return version("radixlm")
    except PackageNotFoundError:
        return "0+unknown"


def wait_for_engine(sock: zmq.Socket[Any]) -> EngineReady:
    while True:
        msg = channel.recv(sock, to_frontend_decoder)
        if isinstance(msg, EngineReady):
            return msg
        if not isinstance(msg, EngineBoot):  # (the engine announcing itself: expected)
            log.warning("ignoring %s before EngineReady", type(msg).__name__)


def load_text_model(config: EngineConfig, ready: EngineReady) -> TextModel:
    if ready.model_dir:
        model_dir = ready.model_dir
    else:  # an engine that does not say: resolve the same spec here
        from radixlm.runtime.model import resolve_model  # type: ignore[attr-defined]

        model_dir = str(resolve_model(config.model))
    tokenizer = Tokenizer.load(model_dir)
    if tokenizer.chat_template is None:
        log.info("the model has no chat template: requests with messages get no_template")
    return TextModel.load(tokenizer, ready.context_length, ready.vocab_size or tokenizer.vocab_size)


def client_socket_options(config: EngineConfig, client_fd: int = -1) -> dict[int, int | bytes]:
    """The client ROUTER's options: mandatory routing (a send to a gone client fails), the
    frame size limit (libzmq drops a connection whose frame is larger, before buffering
    it), CURVE server keys when clients must authenticate, and the listening socket the
    launcher bound (`client_fd`; libzmq then owns and closes it)."""
    # No handover: a peer naming a live connection's id is ignored, never given its place.
    options: dict[int, int | bytes] = {zmq.ROUTER_MANDATORY: 1, zmq.ROUTER_HANDOVER: 0}
    if client_fd >= 0:
        options[zmq.USE_FD] = client_fd
    if config.max_message_bytes > 0:
        options[zmq.MAXMSGSIZE] = config.max_message_bytes
    if config.auth_dir:
        options.update(server_socket_options(Path(config.auth_dir)))
    return options


def _drain_on(frontend: Frontend, timeout_s: float) -> Callable[[int, object], None]:
    """The SIGTERM handler: the first drains (`Frontend.begin_drain`), a second exits."""
    def handler(signum: int, frame: object) -> None:
        if frontend.draining:
            raise SystemExit(128 + signum)
        frontend.begin_drain(timeout_s, signal.Signals(signum).name)
    return handler


def run_frontend(config: EngineConfig, endpoints: Endpoints) -> None:
    """Serve clients until drained after SIGTERM (a second one exits at once)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sockets: list[zmq.Socket[Any]] = []
    executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="radixlm-tokenize")
    frontend: Frontend | None = None
    clients: zmq.Socket[Any] | None = None
    authenticator: ThreadAuthenticator | None = None
    try:
        if config.auth_dir:  # before the socket listens: CURVE without ZAP admits anyone
            accepted = (make_gateway_keys(Path(endpoints.runtime_dir), Path(config.auth_dir))
                        if endpoints.runtime_dir else None)
            authenticator = start_authenticator(ctx, Path(config.auth_dir), accepted)
        unpredictable_routing_ids()  # before the ROUTER picks its first id (identities.py)
        clients = open_socket(ctx, zmq.ROUTER, endpoints.client, bind=True,
                              options=client_socket_options(config, endpoints.client_fd))
        sockets.append(clients)
        monitor = clients.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sockets.append(monitor)
        from_engine = open_socket(ctx, zmq.PULL, endpoints.to_frontend, bind=True)
        to_engine = open_socket(ctx, zmq.PUSH, endpoints.to_engine, bind=False)
        sockets += [from_engine, to_engine]
        # A restarted frontend: the engine forgets the old one's clients and says it is
        # ready again (a first start gets that EngineReady twice: the same boot).
        channel.send(to_engine, FrontendHello(boot=secrets.token_hex(8)))
        ready = wait_for_engine(from_engine)
        model = load_text_model(config, ready)
        welcome = welcome_from(ready, server_version(), config.max_message_bytes,
                               model.tool_format)
        token = (write_gateway_token(Path(endpoints.runtime_dir)) if endpoints.runtime_dir
                 else None)
        frontend = Frontend(model=model, welcome=welcome, gateway_token=token,
                            clients=clients, monitor=monitor, from_engine=from_engine,
                            to_engine=to_engine, executor=executor,
                            engine_timeout_s=config.engine_timeout_s,
                            multi_tenant=bool(config.auth_dir),
                            max_inflight=config.max_inflight_per_client,
                            max_priority=config.max_priority, engine_boot=ready.boot)
        bound = channel.bound_endpoint(clients)
        if endpoints.runtime_dir:
            write_ready(Path(endpoints.runtime_dir), bound, welcome)
        release_free_memory()  # what loading the tokenizer freed
        log.info("frontend ready: %s (context %d, vocab %d) at %s", ready.model,
                 model.context_length, model.vocab_size, bound)
        # A signal may land on ZeroMQ's I/O thread; Python runs its handler on the main
        # thread, which the wake-up fd pulls out of its poll.
        signal.set_wakeup_fd(frontend.wakeup_fd, warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, _drain_on(frontend, config.drain_timeout_s))
        try:
            frontend.serve()
        finally:
            signal.set_wakeup_fd(-1)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        if frontend is not None:
            frontend.close()
        if clients is not None:
            clients.disable_monitor()
        for sock in reversed(sockets):
            sock.close(linger=0)
        if authenticator is not None:
            authenticator.stop()
        ctx.term()
        client_socket_file = ipc_path(endpoints.client)
        # libzmq leaves ipc files behind; one the launcher bound is the launcher's to
        # remove (it may be the default server's path, which a new server may own by now).
        if clients is not None and client_socket_file is not None and endpoints.client_fd < 0:
            client_socket_file.unlink(missing_ok=True)
