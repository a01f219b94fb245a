"""The frontend process entry: `run_frontend(config, endpoints)`.

Start-up order: bind the engine->frontend pipe, wait for the engine's `EngineReady`, load
the tokenizer from the directory the engine resolved, and only then bind the client
socket, so a client that connects early simply waits in ZeroMQ's reconnect loop and the
socket file's existence means "ready".

Pipes: each side binds the PULL socket it reads from and connects the PUSH socket it
writes to (the engine binds ``endpoints.to_engine``, the frontend ``endpoints.to_frontend``).
"""

from __future__ import annotations

import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import zmq
from radixlm.runtime import channel
from radixlm.runtime.channel import ipc_path, open_socket
from radixlm.runtime.config import Endpoints, EngineConfig
from radixlm.runtime.engine.messages import EngineReady, to_frontend_decoder
from radixlm.runtime.frontend.prepare import TextModel
from radixlm.runtime.frontend.server import Frontend, welcome_from
from radixlm.tokenizer import Tokenizer

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
    return TextModel(
        tokenizer=tokenizer,
        context_length=ready.context_length,
        vocab_size=ready.vocab_size or tokenizer.vocab_size,
    )


def run_frontend(config: EngineConfig, endpoints: Endpoints) -> None:
    """Serve clients until interrupted (SIGTERM is turned into SystemExit by the launcher)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sockets: list[zmq.Socket[Any]] = []
    executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="radixlm-tokenize")
    frontend: Frontend | None = None
    clients: zmq.Socket[Any] | None = None
    try:
        from_engine = open_socket(ctx, zmq.PULL, endpoints.to_frontend, bind=True)
        to_engine = open_socket(ctx, zmq.PUSH, endpoints.to_engine, bind=False)
        sockets += [from_engine, to_engine]
        ready = wait_for_engine(from_engine)
        model = load_text_model(config, ready)
        clients = open_socket(ctx, zmq.ROUTER, endpoints.client, bind=True,
                              options={zmq.ROUTER_MANDATORY: 1})
        sockets.append(clients)
        monitor = clients.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sockets.append(monitor)
        frontend = Frontend(model=model, welcome=welcome_from(ready, server_version()),
                            clients=clients, monitor=monitor, from_engine=from_engine,
                            to_engine=to_engine, executor=executor)
        log.info("frontend ready: %s (context %d, vocab %d) at %s", ready.model,
                 model.context_length, model.vocab_size, endpoints.client)
        # A signal may land on ZeroMQ's I/O thread; Python runs its handler on the main
        # thread, which the wake-up fd pulls out of its poll.
        signal.set_wakeup_fd(frontend.wakeup_fd, warn_on_full_buffer=False)
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
        ctx.term()
        client_socket_file = ipc_path(endpoints.client)
        if clients is not None and client_socket_file is not None:
            client_socket_file.unlink(missing_ok=True)  # libzmq leaves ipc files behind
