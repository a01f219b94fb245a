"""The frontend's message loop: clients on a ROUTER, the engine on two PUSH/PULL pipes.

One thread owns every socket and all state; tokenization of large inputs runs in a small
thread pool and comes back through a wake-up pipe, so forwarding the engine's outputs to
clients never waits for it. The engine never waits on the frontend (its PUSH pipe is
unbounded) and the frontend never waits on a client (sends are non-blocking; a client's
ROUTER queue is unbounded, so a client that stops reading costs frontend memory, not
other clients' latency).

Message handling, in order of arrival per client (see clients.py for the queue):
- decode (frames.py): not msgpack / not a valid message -> bad_message, an unknown
  ``"type"`` -> unknown_type; anything but Hello before the handshake ->
  handshake_required; Hello with another version -> unsupported_version, else Welcome;
- requests (requests.py) are checked (the rules of runtime/rules.py that need no engine
  state), tokenized (prepare.py), then forwarded to the engine; `Tokenize` is answered
  there;
- the engine's messages (replies.py) become Chunks and Dones, or are forwarded. The
  frontend keeps no record of sessions: the engine owns histories and ends every turn;
  an append is rendered for each way its history may end and the engine picks.

Identities are the server's: a connection whose ROUTER id its peer chose
(``ZMQ_ROUTING_ID``) is refused (identities.py).

Draining (SIGTERM, `begin_drain`): new work (hello, generate, sessions, pins) is refused
with engine_unavailable while the requests already running finish; once none is left, or
at the drain timeout (those still running then fail with a message that says so), every
client's sessions are closed in the engine and `serve` returns.

Client disconnects are seen two ways: a send to a vanished client fails
(``ROUTER_MANDATORY`` -> EHOSTUNREACH), and the socket monitor reports a closed
connection even for an idle client (clients.py). Either way the frontend forgets the
client and sends `ClientGone` so the engine aborts its requests, frees their private KV
and closes its sessions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import zmq
from radixlm.runtime import protocol as wire
from radixlm.runtime.engine.wire import (
    ClientGone,
    EngineAbort,
    EngineBoot,
    EngineCommand,
    EngineReady,
    to_frontend_decoder,
)
from radixlm.runtime.frontend.clients import ClientState, QueuedWork, Routes
from radixlm.runtime.frontend.frames import FrameError, decode_frame
from radixlm.runtime.frontend.identities import REFUSED_IDENTITY, assigned_by_server
from radixlm.runtime.frontend.liveness import PROBE_CLIENT, Change, EngineWatch
from radixlm.runtime.frontend.prepare import TextModel
from radixlm.runtime.frontend.replies import EngineReplies
from radixlm.runtime.frontend.requests import ClientRequests
from radixlm.runtime.frontend.tenants import GatewayRefused, gateway_names, names_for
from radixlm.runtime.protocol import PROTOCOL_VERSION
from radixlm.runtime.rules import RequestError
from radixlm.runtime.transport import channel
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("radixlm.frontend")

# Messages taken from one socket per loop turn, so no source starves the others.
BATCH = 256
# What a draining frontend refuses: anything that would start new work in the engine.
NEW_WORK = (wire.Hello, wire.Generate, wire.OpenSession, wire.ForkSession, wire.Pin)


def welcome_from(ready: EngineReady, server_version: str, max_message_bytes: int = 0,
                 tool_format: str = "generic") -> wire.Welcome:
    return wire.Welcome(
        protocol_version=PROTOCOL_VERSION, server_version=server_version, model=ready.model,
        context_length=ready.context_length, page_size=ready.page_size,
        kv_capacity=ready.kv_capacity, max_message_bytes=max_message_bytes,
        tool_format=tool_format, state=ready.state,
    )


def _done_future(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _run_job(job: Callable[[], Any]) -> Any:
    """A preparation job's result, or the RequestError it raised (never raises)."""
    try:
        return job()
    except RequestError as e:
        return e
    except Exception as e:  # a bug or a tokenizer failure: an error reply, not a dead loop
        log.exception("preparing a request failed")
        return RequestError(wire.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")


class Frontend:
    """The loop, the clients' order and the engine's liveness; `serve` runs it. Main
    thread only, except the jobs handed to `executor`."""

    def __init__(self, *, model: TextModel, welcome: wire.Welcome, clients: zmq.Socket[Any],
                 monitor: zmq.Socket[Any], from_engine: zmq.Socket[Any],
                 to_engine: zmq.Socket[Any], executor: Executor,
                 engine_timeout_s: float = 60.0, multi_tenant: bool = False,
                 max_inflight: int = 0, max_priority: int | None = None,
                 gateway_token: str | None = None, engine_boot: str = "") -> None:
        self.model = model
        self._engine_boot = engine_boot  # the engine process serving now (EngineReady.boot)
        self._gateway_token = gateway_token  # trusted gateways declare tenants with it
        self._multi_tenant = multi_tenant  # clients authenticate: each key is a tenant
        self._watch = EngineWatch(engine_timeout_s, time.monotonic())
        self._welcome = wire.encode(welcome)
        self._sock = clients
        self._monitor = monitor
        self._from_engine = from_engine
        self._engine_sock = to_engine
        self._executor = executor
        self.routes = Routes(clients, to_engine, self._client_gone)
        self._clients = self.routes.clients
        self.requests = ClientRequests(self.routes, model, self._enqueue,
                                       max_inflight=max_inflight, max_priority=max_priority)
        self.replies = EngineReplies(self.routes)
        self._woken: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._drain_until: float | None = None  # set by `begin_drain`
        self._drain_why = ""

    # -- loop ------------------------------------------------------------------------------

    def serve(self) -> None:
        """Run until drained (`begin_drain`) or interrupted (KeyboardInterrupt and the
        SystemExit of a second SIGTERM propagate)."""
        poller = zmq.Poller()
        poller.register(self._from_engine, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._sock, zmq.POLLIN)
        poll_ms = int(self._watch.interval_s * 1000)
        while not self._drained():
            ready = dict(poller.poll(poll_ms if self._drain_until is None else 50))
            self._watch_engine()
            if self._from_engine in ready:
                self._drain_engine()
            if self._monitor in ready:
                self._drain_monitor()
            if self._wake_r in ready:
                self._drain_wakes()
            if self._sock in ready:
                self._drain_clients()

    # -- draining --------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    def begin_drain(self, timeout_s: float, why: str = "SIGTERM") -> None:
        """Take no new work; let what runs finish for up to `timeout_s` (signal-safe: the
        loop notices on its next turn)."""
        if self._drain_until is None:
            self._drain_until = time.monotonic() + timeout_s
            self._drain_why = why
            self._wake(b"")

    def _busy(self) -> bool:
        return any(c.inflight or c.awaiting or c.pending for c in self._clients)

    def _drained(self) -> bool:
        """Whether the drain is over: nothing runs, or its time is up (what still runs
        then fails). Either way every client's sessions are closed in the engine."""
        if self._drain_until is None:
            return False
        busy = self._busy()
        if busy and time.monotonic() < self._drain_until:
            return False
        message = (f"the server stopped ({self._drain_why}) before this request finished "
                   "(its --drain-timeout ran out)")
        failed = self._fail_all(message) if busy else 0
        for client in self._clients:
            if client.touched_engine:
                self.routes.to_engine(None, ClientGone(client=client.identity))
        log.info("drained after %s: %d request(s) stopped unfinished", self._drain_why, failed)
        return True

    def _stopping(self) -> str:
        return (f"the server is stopping ({self._drain_why}): it takes no new requests, "
                "only finishes the running ones")

    @property
    def wakeup_fd(self) -> int:
        """Writing a byte here wakes the loop (worker threads do; signal.set_wakeup_fd may)."""
        return self._wake_w

    def close(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _drain_engine(self) -> None:
        if self._watch.on_message(time.monotonic()) is Change.UP:
            log.warning("the engine answers again")
        for msg in channel.drain(self._from_engine, to_frontend_decoder, BATCH, log):
            if isinstance(msg, (EngineReady, EngineBoot)):
                self._engine_boot_seen(msg.boot)
            else:
                self.replies.on_message(msg)

    def _engine_boot_seen(self, boot: str) -> None:
        """An engine process's boot id: ours (its EngineReady again, answering our hello),
        or a new engine's (it announces itself as it starts, before loading): the old one
        died, and what it was running is lost. What is sent from now on waits for the
        new one."""
        if boot == self._engine_boot:
            return
        self._engine_boot = boot
        failed = self._fail_all("the engine restarted: the requests it was running are lost "
                                "(durable sessions are kept: resume them)")
        log.warning("the engine restarted (%s): %d request(s) failed", boot, failed)

    def _drain_clients(self) -> None:
        for _ in range(BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.on_client_frames(frames)

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                identity = self._clients.on_fd(event["value"])
                if identity is not None:
                    self._client_gone(identity, "disconnected")

    def _drain_wakes(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 65536)
        while True:
            try:
                identity = self._woken.get_nowait()
            except queue.Empty:
                return
            client = self._clients.get(identity)
            if client is not None:
                self._run_pending(client)

    # -- engine liveness -------------------------------------------------------------------

    def _watch_engine(self) -> None:
        now = time.monotonic()
        rid = self._watch.probe_due(now)
        if rid is not None:
            channel.send(self._engine_sock, EngineCommand(client=PROBE_CLIENT,
                                                          msg=wire.GetStats(rid=rid)))
        if self._watch.check(now) is Change.DOWN:
            self._engine_down()

    def _unavailable(self) -> str:
        return (f"the engine process has not answered for "
                f"{self._watch.silent_for(time.monotonic()):.0f} s (stopped, frozen or stuck; "
                f"--engine-timeout {self._watch.timeout_s:g} s)")

    def _engine_down(self) -> None:
        """Fail every request waiting on the engine. It is told to abort the generations,
        in case it comes back; late replies to the failed commands (each gets exactly one)
        are dropped."""
        message = self._unavailable()
        failed = self._fail_all(message)
        log.error("%s: %d request(s) failed with engine_unavailable", message, failed)

    def _fail_all(self, message: str) -> int:
        """Fail every request in flight with engine_unavailable and `message`; the engine is
        told to abort them. Returns how many."""
        routes = self.routes
        failed = 0
        for client in self._clients:
            for rid, key in list(client.inflight.items()):
                stream = routes.streams.get(key)
                if stream is not None:
                    routes.end_request(stream)
                routes.to_engine(None, EngineAbort(key=key))
                routes.error(client, rid, wire.ErrorCode.ENGINE_UNAVAILABLE, message)
                failed += 1
            for rid in client.awaiting:
                client.abandoned.add(rid)
                routes.error(client, rid, wire.ErrorCode.ENGINE_UNAVAILABLE, message)
                failed += 1
            client.awaiting.clear()
        return failed

    # -- ordered preparation -------------------------------------------------------------

    def _enqueue(self, client: ClientState, job: Callable[[], Any] | None,
                 then: Callable[[Any], None], *, heavy: bool = False) -> None:
        """Run `job` (inline, or in the pool if `heavy`), then `then(result)` on this
        thread once every earlier item of this client has gone."""
        if heavy and job is not None:
            future = self._executor.submit(_run_job, job)
            identity = client.identity
            future.add_done_callback(lambda _f: self._wake(identity))
        else:
            future = _done_future(_run_job(job) if job is not None else None)
        client.pending.append(QueuedWork(future, then))
        self._run_pending(client)

    def _wake(self, identity: bytes) -> None:  # worker thread
        self._woken.put(identity)
        with contextlib.suppress(BlockingIOError):  # full: wake-ups are pending already
            os.write(self._wake_w, b"\0")

    def _run_pending(self, client: ClientState) -> None:
        pending = client.pending
        while pending and pending[0].future.done():
            item = pending.popleft()
            item.then(item.future.result())
            if self._clients.get(client.identity) is not client:
                return  # it vanished while replying

    # -- client messages -------------------------------------------------------------------

    def on_client_frames(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        if not assigned_by_server(identity):
            self._refuse_identity(identity, frames)
            return
        client = self._clients.get(identity) or self._register(identity, frames)
        error = self.routes.error
        if len(frames) != 2:
            error(client, None, wire.ErrorCode.BAD_MESSAGE,
                  f"a message is one frame, got {len(frames) - 1}")
            return
        msg = decode_frame(frames[1].bytes)
        if isinstance(msg, FrameError):
            error(client, msg.rid, msg.code, msg.message)
            return
        if isinstance(msg, wire.Hello):
            self._hello(client, msg)
            return
        if not client.welcomed:
            error(client, msg.rid, wire.ErrorCode.HANDSHAKE_REQUIRED,
                  f"send hello (protocol_version={PROTOCOL_VERSION}) first")
            return
        if self._drain_until is not None and isinstance(msg, NEW_WORK):
            error(client, msg.rid if not isinstance(msg, wire.Hello) else None,
                  wire.ErrorCode.ENGINE_UNAVAILABLE, self._stopping())
            return
        if self._watch.down and type(msg) not in (wire.Tokenize, wire.Detokenize):  # no engine
            error(client, msg.rid, wire.ErrorCode.ENGINE_UNAVAILABLE, self._unavailable())
            return
        try:
            self.requests.handlers[type(msg)](client, msg)
        except RequestError as e:
            error(client, msg.rid, e.code, e.message)
        except Exception as e:  # a bug: answer it and keep serving everyone else
            log.exception("handling %s failed", type(msg).__name__)
            error(client, msg.rid, wire.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

    def _refuse_identity(self, identity: bytes, frames: list[zmq.Frame]) -> None:
        """Answer a peer-chosen identity's message with `forbidden`; nothing is kept."""
        msg = decode_frame(frames[-1].bytes) if len(frames) == 2 else None
        rid = None if msg is None or isinstance(msg, wire.Hello) else msg.rid
        log.info("refused a client that chose its routing id (%d bytes)", len(identity))
        error = wire.Error(rid=rid, code=wire.ErrorCode.FORBIDDEN, message=REFUSED_IDENTITY)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([identity, wire.encode(error)], zmq.NOBLOCK)

    def _register(self, identity: bytes, frames: list[zmq.Frame]) -> ClientState:
        frame = frames[0]
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            fd = -1
        if fd >= 0 and self._clients.on_fd(fd) is not None:
            self._drain_monitor()  # the previous owner's disconnect is queued there
            stale = self._clients.on_fd(fd)
            if stale is not None:
                self._client_gone(stale, "its connection was replaced")
        return self._clients.add(identity, fd,
                                 names_for(frames[-1], multi_tenant=self._multi_tenant))

    def _hello(self, client: ClientState, msg: wire.Hello) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            self.routes.error(client, None, wire.ErrorCode.UNSUPPORTED_VERSION,
                              f"this server speaks protocol version {PROTOCOL_VERSION}, "
                              f"the client {msg.protocol_version}")
            return
        if msg.gateway is not None:
            try:
                names = gateway_names(msg.gateway, self._gateway_token)
            except GatewayRefused as e:
                self.routes.error(client, None, e.code, str(e))
                return
            if client.welcomed and names.tenant != client.names.tenant:
                self.routes.error(client, None, wire.ErrorCode.FORBIDDEN,
                                  "a connection's tenant is declared once, in its first hello")
                return
            client.names = names
        client.welcomed = True
        log.debug("client %s (%r) connected", client.identity.hex(), msg.client_name)
        self.routes.send(client.identity, self._welcome)

    # -- disconnects -----------------------------------------------------------------------

    def _client_gone(self, identity: bytes, why: str) -> None:
        client = self._clients.remove(identity)
        if client is None:
            return
        for key in client.inflight.values():
            self.routes.streams.pop(key, None)
        client.pending.clear()  # queued work of a gone client never runs
        log.log(logging.INFO if client.inflight else logging.DEBUG,
                "client %s %s: %d request(s) aborted", identity.hex(), why, len(client.inflight))
        if client.touched_engine:
            self.routes.to_engine(None, ClientGone(client=identity))
