"""One connection to an engine: a DEALER socket, a reader task, replies routed by rid.

Everything here runs on one event loop (the one that opened the connection). The reader
task decodes every frame and hands it to the request it names through that request's
unbounded memory stream, so a slow consumer never stalls the others. A monitor task
declares the engine dead -- failing every waiting request with `EngineDeadError` -- when
its process exits (the `liveness` hook) or when it stays silent while requests wait
(a cheap ``Tokenize`` ping, answered by the frontend alone, tells slow from dead).

ZeroMQ's file descriptor is edge-triggered: any operation on the socket (a send
included) may consume the readiness edge, leaving replies queued while the fd stays
quiet. So whoever touches the socket drains it: the reader task after the fd wakes it,
and a sender right after its send, inline, when ``ZMQ_EVENTS`` says a reply is waiting
(dispatching is synchronous: a reply only lands in a memory stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import zmq
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Chunk,
    Done,
    Error,
    Hello,
    Input,
    ServerMessage,
    Struct,
    Tokenize,
    Welcome,
    decode_server,
    encode,
)
from radixlm.sdk.errors import EngineDeadError, EngineError, error_from_reply

__all__ = ["Connection", "Request"]

log = logging.getLogger("radixlm.sdk")

_CLOSE_LINGER_MS = 200
Liveness = Callable[[], "str | None"]  # None while alive, else why it is dead


@dataclass(frozen=True)
class _Failed:
    """Put on a request's stream when the connection fails."""

    exc: EngineError


class Request:
    """One in-flight request: its replies, in order, until the last one.

    A request is finished after its ``Error``, its single answer, or -- for a
    ``Generate`` -- the ``Done`` of each of its ``n`` branches.
    """

    __slots__ = ("rid", "_conn", "_replies", "_send", "_dones_left", "_generate", "started_at",
                 "on_close", "dones")

    def __init__(self, conn: Connection, rid: str, *, branches: int, generate: bool) -> None:
        self.rid = rid
        self._conn = conn
        self._send, self._replies = anyio.create_memory_object_stream[Any](math.inf)
        self._dones_left = branches
        self._generate = generate
        self.started_at = time.perf_counter()
        self.on_close: Callable[[], None] | None = None
        self.dones: list[Done] = []  # every Done received, those drained after an abort too

    @property
    def finished(self) -> bool:
        return self._dones_left <= 0

    async def receive(self) -> ServerMessage:
        """The next reply; raises the typed `EngineError` for an ``Error`` reply."""
        try:  # replies already queued (a streamed burst) are taken without a loop trip
            item = self._replies.receive_nowait()
        except anyio.WouldBlock:
            item = await self._replies.receive()
        if isinstance(item, _Failed):
            self._dones_left = 0
            raise item.exc
        if isinstance(item, Error):
            self._dones_left = 0
            raise error_from_reply(item)
        if isinstance(item, Done):
            self._dones_left -= 1
            self.dones.append(item)
        elif not isinstance(item, Chunk):
            self._dones_left = 0
        return item

    async def aclose(self) -> None:
        """Stop routing replies here. A generation still running is aborted first, and its
        final reply awaited (briefly) so its session is no longer busy afterwards."""
        try:
            if not self.finished and self._generate and self._conn.alive:
                with anyio.CancelScope(shield=True), anyio.move_on_after(self._conn.abort_timeout):
                    self._conn.send(Abort(rid=self.rid))
                    while not self.finished:
                        try:
                            await self.receive()
                        except EngineError:
                            break
        finally:
            self._conn.forget(self.rid)
            self._send.close()
            self._replies.close()
            on_close, self.on_close = self.on_close, None
            if on_close is not None:
                on_close()

    async def __aenter__(self) -> Request:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Connection:
    """A DEALER socket to one engine, with its reader and monitor tasks."""

    def __init__(
        self,
        endpoint: str,
        *,
        client_name: str,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 5.0,
        abort_timeout: float = 2.0,
        liveness: Liveness | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.client_name = client_name
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.abort_timeout = abort_timeout
        self._liveness = liveness
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # local pipe: never block or drop a send
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._fd = self._sock.getsockopt(zmq.FD)
        self._routes: dict[str, MemoryObjectSendStream[Any]] = {}
        self._unawaited: set[str] = set()
        self._handshake: MemoryObjectSendStream[Any] | None = None
        self._dead: EngineDeadError | None = None
        self._last_heard = time.monotonic()
        self._ping_rid: str | None = None
        self._pings = 0
        self._generating = 0
        self.peak_generating = 0  # most generations in flight at once (for tests, benchmarks)
        self.sent = 0  # messages sent
        self.welcome: Welcome | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self, tg: TaskGroup, connect_timeout: float) -> Welcome:
        """Connect, start the reader and monitor in `tg`, and do the Hello -> Welcome
        handshake (waiting up to `connect_timeout` s: a new engine may be loading)."""
        self._sock.connect(self.endpoint)
        tg.start_soon(self._read_loop, name="radixlm reader")
        tg.start_soon(self._monitor, name="radixlm monitor")
        send, replies = anyio.create_memory_object_stream[Any](math.inf)
        self._handshake = send
        try:
            self.send(Hello(protocol_version=PROTOCOL_VERSION, client_name=self.client_name))
            with anyio.fail_after(connect_timeout):
                item = await replies.receive()
        except TimeoutError:
            raise EngineDeadError(
                f"no answer from {self.endpoint} within {connect_timeout:g} s "
                "(is a radixlm server running there?)"
            ) from None
        finally:
            self._handshake = None
            send.close()
            replies.close()
        if isinstance(item, _Failed):
            raise item.exc
        if isinstance(item, Error):
            raise error_from_reply(item)
        assert isinstance(item, Welcome)
        self.welcome = item
        return item

    def close(self) -> None:
        """Close the socket (after the task group running the reader was cancelled).
        Requests still queued (unawaited session closes) get a moment to leave."""
        linger_ms = _CLOSE_LINGER_MS if self._dead is None else 0
        self._fail(EngineDeadError("the client is closed"), quiet=True)
        self._sock.close(linger=linger_ms)
        self._ctx.term()

    @property
    def alive(self) -> bool:
        return self._dead is None

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead.message)

    # -- requests -------------------------------------------------------------------------

    def request(self, msg: Struct, *, branches: int = 1, generate: bool = False) -> Request:
        """Register a request for ``msg.rid`` and send `msg`. Use the returned `Request` as
        an async context manager (or call its ``aclose``) so it is cleaned up."""
        self.check_alive()
        rid: str = msg.rid  # type: ignore[attr-defined]
        if rid in self._routes:
            raise ValueError(f"rid {rid!r} is already in flight")
        req = Request(self, rid, branches=branches, generate=generate)
        if not self._routes:
            self._last_heard = time.monotonic()  # silence only counts while someone waits
        self._routes[rid] = req._send
        if generate:
            self._generating += 1
            self.peak_generating = max(self.peak_generating, self._generating)
            req.on_close = self._generation_ended
        try:
            self.send(msg)
        except BaseException:
            self.forget(rid)
            if req.on_close is not None:
                req.on_close()
            raise
        return req

    def send_unawaited(self, msg: Struct) -> None:
        """Send a request whose answer nobody waits for (closing a session the program no
        longer needs): its reply is dropped, an error reply only logged. The engine handles
        a client's requests in order, so later requests see its effect."""
        self.check_alive()
        self._unawaited.add(msg.rid)  # type: ignore[attr-defined]
        self.send(msg)

    def forget(self, rid: str) -> None:
        self._routes.pop(rid, None)

    def _generation_ended(self) -> None:
        self._generating -= 1

    @property
    def in_flight(self) -> int:
        return len(self._routes)

    def send(self, msg: Struct) -> None:
        self.sent += 1
        try:
            self._sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # cannot happen with SNDHWM=0 on a connected socket
            raise EngineDeadError(f"cannot send to {self.endpoint}: socket would block") from None
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot send to {self.endpoint}: {e}") from None
        # The send may have consumed the fd's edge for a reply that is already queued.
        if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._drain()

    # -- tasks ----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        """Dispatch replies as they arrive, for as long as the client is open."""
        loop = _running_asyncio_loop()
        if loop is None:  # trio: wait on the fd in this task
            while True:
                self._drain()
                await anyio.wait_readable(self._fd)
        # asyncio: drain from a reader callback, saving a task switch (and a new fd waiter)
        # per reply; this task owns the registration and removes it when the client closes.
        loop.add_reader(self._fd, self._drain)
        try:
            self._drain()
            await anyio.sleep_forever()
        finally:
            loop.remove_reader(self._fd)

    def _drain(self) -> None:
        """Dispatch every reply queued on the socket (the fd stays quiet until new ones)."""
        recv = self._sock.recv
        while True:
            try:
                frame = recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(frame)

    def _dispatch(self, frame: bytes) -> None:
        self._last_heard = time.monotonic()
        try:
            msg = decode_server(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("dropping an undecodable reply from the engine: %s", e)
            return
        rid = getattr(msg, "rid", None)
        if rid is None:  # Welcome, or an error about the connection itself
            if self._handshake is not None:
                self._handshake.send_nowait(msg)
            elif isinstance(msg, Error):
                log.error("engine error: [%s] %s", msg.code, msg.message)
            return
        if rid == self._ping_rid:
            self._ping_rid = None
            return
        if rid in self._unawaited:
            self._unawaited.discard(rid)
            if isinstance(msg, Error):
                log.debug("ignored error for %s: [%s] %s", rid, msg.code, msg.message)
            return
        route = self._routes.get(rid)
        if route is None:
            return  # a late reply to a request we stopped waiting for
        try:
            route.send_nowait(msg)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            # Its consumer went away without closing it (a stream dropped mid-way).
            self.forget(rid)
            if isinstance(msg, Chunk):
                with contextlib.suppress(EngineDeadError):
                    self.send(Abort(rid=rid))

    async def _monitor(self) -> None:
        while True:
            await anyio.sleep(self.heartbeat_interval)
            reason = self._liveness() if self._liveness is not None else None
            if reason is not None:
                self._fail(EngineDeadError(reason))
                return
            if not self._routes or self._handshake is not None:
                continue
            silent = time.monotonic() - self._last_heard
            if silent > self.heartbeat_timeout:
                self._fail(EngineDeadError(
                    f"the engine at {self.endpoint} has not answered for {silent:.1f} s"
                ))
                return
            if silent > self.heartbeat_interval and self._ping_rid is None:
                self._pings += 1
                self._ping_rid = f"~ping{self._pings}"
                self.send(Tokenize(rid=self._ping_rid, input=Input(text="")))

    def _fail(self, exc: EngineDeadError, *, quiet: bool = False) -> None:
        if self._dead is not None:
            return
        self._dead = exc
        if not quiet:
            log.error("%s", exc.message)
        for route in list(self._routes.values()):
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                route.send_nowait(_Failed(exc))
        if self._handshake is not None:
            self._handshake.send_nowait(_Failed(exc))
