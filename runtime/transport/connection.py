"""One connection to an engine: a DEALER link, replies routed by rid.

Everything here runs on one event loop (the one that opened the connection). Every frame
that arrives is decoded and handed to the request it names through that request's
unbounded mailbox, so a slow consumer never stalls the others. A monitor task declares
the engine dead -- failing every waiting request with `EngineDeadError` -- when its
process exits (the `liveness` hook), when the connection drops, or when it stays silent
while requests wait (a cheap ``Tokenize`` ping, answered by the frontend alone, tells
slow from dead).

The link is a native ZMTP DEALER on asyncio for ipc:// and tcp:// endpoints (`zmtp`: no
libzmq I/O thread to wake per message), else a libzmq DEALER (`zmq_dealer`). Both speak
the same ZeroMQ wire protocol to the engine. The protocol's calls over it are
`client.ProtocolClient`'s (the SDK's and the HTTP server's client).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import msgspec
from anyio.abc import TaskGroup
from radixlm.runtime.protocol import (
    MAX_CLOSE,
    Abort,
    Chunk,
    CloseSession,
    Error,
    Gateway,
    Input,
    Struct,
    Tokenize,
    Welcome,
    decode_server,
    encode,
)
from radixlm.runtime.transport.curve import CurveKeys
from radixlm.runtime.transport.endpoints import checked_endpoint
from radixlm.runtime.transport.errors import EngineDeadError, TooLongError, error_from_reply
from radixlm.runtime.transport.exchange import hello
from radixlm.runtime.transport.mailbox import EventWaiter, Mailbox, Waiter, waiter_factory
from radixlm.runtime.transport.request import Failed, Request
from radixlm.runtime.transport.zmq_dealer import ZmqDealer
from radixlm.runtime.transport.zmtp import ZmtpDealer

__all__ = ["Connection", "Request"]

log = logging.getLogger("radixlm.transport")

Liveness = Callable[[], "str | None"]  # None while alive, else why it is dead
# How long an unawaited message (a session close) may wait for a request to leave with:
# sent alone, its reply would wake the loop again just to be dropped.
_DEFER_S = 0.02
# After the link drops, how often and how many times to ask `liveness` why: a server
# whose frontend died needs a moment to notice, stop the engine and exit with the reason.
_LOST_CHECK_S, _LOST_CHECKS = 0.1, 50


def _running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _Link(Protocol):
    """What the connection needs of a DEALER (`ZmtpDealer`, `ZmqDealer`)."""

    def send(self, data: bytes, /) -> None: ...

    def send_many(self, messages: list[bytes], /) -> None: ...

    def cork(self) -> None: ...


class Connection:
    """A DEALER link to one engine, with its monitor task.

    `native`: use the native ZMTP transport where it applies (asyncio; ipc:// or tcp://).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        client_name: str,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 5.0,
        abort_timeout: float = 2.0,
        liveness: Liveness | None = None,
        native: bool = True,
        curve: CurveKeys | None = None,
        gateway: Gateway | None = None,
    ) -> None:
        self._target = checked_endpoint(endpoint)
        self.gateway = gateway  # sent with Hello: a trusted gateway's tenant
        self.endpoint, self.client_name = endpoint, client_name
        self.native = native and curve is None  # CURVE needs libzmq
        self.curve = curve
        self.heartbeat_interval, self.heartbeat_timeout = heartbeat_interval, heartbeat_timeout
        self.abort_timeout = abort_timeout
        self._liveness = liveness
        self._link: _Link | None = None
        self._native: ZmtpDealer | None = None
        self._zmq: ZmqDealer | None = None
        self._routes: dict[str, Request] = {}
        self._unawaited: set[str] = set()
        self._aloop: asyncio.AbstractEventLoop | None = None  # set by `open` on asyncio
        # Unawaited messages waiting to leave with the next request (encoded then, so that
        # closes deferred together merge into one CloseSession: one request, one reply).
        self._deferred: list[Struct] = []
        self._flush_timer: asyncio.TimerHandle | None = None
        self._handshake: Mailbox[Any] | None = None
        self.new_waiter: Callable[[], Waiter] = EventWaiter  # `open` picks its loop's own
        self._dead: EngineDeadError | None = None
        self._last_heard = time.monotonic()
        self._ping_rid: str | None = None
        self._pings = 0
        self._generating = 0
        self.peak_generating = 0  # most generations in flight at once (for tests, benchmarks)
        self.sent = 0  # messages sent
        self.welcome: Welcome | None = None
        self._max_bytes = 0  # the server's frame limit (Welcome.max_message_bytes)
        self._opening: anyio.CancelScope | None = None  # the handshake wait, while it runs

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self, tg: TaskGroup, connect_timeout: float) -> Welcome:
        """Connect, start the monitor (and a reader, if the link needs one) in `tg`, and do
        the Hello -> Welcome handshake (waiting up to `connect_timeout` s in all: a new
        engine may be loading)."""
        self.new_waiter = waiter_factory()
        self._aloop = _running_asyncio_loop()
        tg.start_soon(self._monitor, name="radixlm monitor")
        self._handshake = replies = Mailbox[Any](self.new_waiter)
        # `_fail` cancels this scope: a server that exits while we connect is reported
        # at once (with its reason), not after `connect_timeout`.
        self._opening = opening = anyio.CancelScope()
        item: Any = None
        try:
            with opening, anyio.fail_after(connect_timeout):
                await self._connect(tg, connect_timeout)
                self.send(hello(self.client_name, self.gateway))
                item = await replies.get()
        except TimeoutError:
            hint = ("is the server key right, and is this client's key authorized?"
                    if self.curve is not None else "is a radixlm server running there?")
            raise EngineDeadError(
                f"no answer from {self.endpoint} within {connect_timeout:g} s ({hint})"
            ) from None
        except OSError as e:
            raise EngineDeadError(f"cannot connect to {self.endpoint}: {e}") from None
        finally:
            self._opening = None
            self._handshake = None
            replies.close()
        if item is None:  # cancelled by `_fail`
            raise EngineDeadError(self._dead.message if self._dead else "the client is closed")
        if isinstance(item, Failed):
            raise item.exc
        if isinstance(item, Error):
            raise error_from_reply(item)
        assert isinstance(item, Welcome)
        self.welcome = item
        self._max_bytes = item.max_message_bytes
        return item

    async def _connect(self, tg: TaskGroup, timeout: float) -> None:
        if self.native and self._target.native and _running_asyncio_loop():
            link = ZmtpDealer(self._dispatch, self._lost)
            self._native = link
            await link.connect(self.endpoint, timeout)
            self._link = link
        else:
            zlink = ZmqDealer(self._dispatch,
                              self.curve.socket_options() if self.curve is not None else None)
            self._zmq = zlink
            await zlink.connect(self.endpoint, tg)
            self._link = zlink

    def close(self) -> None:
        """Close the link (after the task group running the monitor was cancelled).
        Requests already sent (unawaited session closes) still leave."""
        linger = self._dead is None
        if linger:
            self._flush_deferred()
        self._fail(EngineDeadError("the client is closed"), quiet=True)
        self._link = None
        if self._native is not None:
            self._native.close()
        if self._zmq is not None:
            self._zmq.close(linger=linger)

    def _lost(self, reason: str) -> None:
        """The link dropped. With a `liveness` hook, its reason (the process exited, and
        why) is worth the wait of a moment: the socket closes before the exit is seen."""
        # (This client never sends a frame past the server's --max-message-bytes: `send`
        # refuses it first, so a dropped link is the server's end, not ours.)
        why = f"{reason} ({self.endpoint}): the server stopped (or was killed)"
        if self._liveness is None or self._aloop is None:
            self._fail(EngineDeadError(why))
            return

        def check(tries_left: int) -> None:
            assert self._liveness is not None and self._aloop is not None
            dead = self._liveness()
            if dead is not None or tries_left == 0:
                self._fail(EngineDeadError(dead or why))
            else:
                self._aloop.call_later(_LOST_CHECK_S, check, tries_left - 1)

        check(_LOST_CHECKS)

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
        self._routes[rid] = req
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
        a client's requests in order, so later requests see its effect. On asyncio it
        leaves with the next message sent, or within `_DEFER_S` s."""
        self.check_alive()
        self._unawaited.add(msg.rid)  # type: ignore[attr-defined]
        if self._aloop is None or self._link is None:
            self.send(msg)
            return
        last = self._deferred[-1] if self._deferred else None
        if (isinstance(msg, CloseSession) and isinstance(last, CloseSession)
                and len(last.ids()) < MAX_CLOSE):
            last.sessions, last.session = last.ids() + msg.ids(), None
            self._unawaited.discard(msg.rid)  # answered under `last`'s rid
        else:
            self.sent += 1
            self._deferred.append(msg)
        if self._flush_timer is None:
            self._flush_timer = self._aloop.call_later(_DEFER_S, self._flush_deferred)

    def _flush_deferred(self, then: bytes | None = None) -> None:
        """Send the deferred messages (and `then` after them) in one write."""
        timer, self._flush_timer = self._flush_timer, None
        if timer is not None:
            timer.cancel()
        frames, self._deferred = [encode(m) for m in self._deferred], []
        if then is not None:
            frames.append(then)
        link = self._link
        if link is None:
            return
        try:
            link.send_many(frames)
        except ConnectionError as e:
            if then is not None:
                raise
            log.debug("could not send %d deferred messages: %s", len(frames), e)

    def cork(self) -> None:
        """Send what is sent from now until the callbacks already scheduled have run in
        one write (see `ZmtpDealer.cork`): e.g. the first requests of tasks just started."""
        if self._link is not None:
            self._link.cork()

    def forget(self, rid: str) -> None:
        self._routes.pop(rid, None)

    def _generation_ended(self) -> None:
        self._generating -= 1

    @property
    def in_flight(self) -> int:
        return len(self._routes)

    def send(self, msg: Struct) -> None:
        self.sent += 1
        link = self._link
        if link is None:
            raise EngineDeadError(f"cannot send to {self.endpoint}: not connected")
        data = encode(msg)
        if self._max_bytes and len(data) > self._max_bytes:
            # The server would drop the connection (libzmq's frame limit): refuse it here.
            raise TooLongError(
                f"the request is {len(data)} bytes; the server accepts messages of up to "
                f"{self._max_bytes} bytes (its --max-message-bytes)",
                rid=getattr(msg, "rid", None))
        try:
            if self._deferred:  # in order: what was deferred leaves first, in the same write
                self._flush_deferred(then=data)
            else:
                link.send(data)
        except ConnectionError as e:
            raise EngineDeadError(f"cannot send to {self.endpoint}: {e}") from None

    # -- replies and the monitor ---------------------------------------------------------

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
                self._handshake.put(msg)
            elif isinstance(msg, Error):
                log.error("engine error: [%s] %s", msg.code, msg.message)
            return
        req = self._routes.get(rid)
        if req is not None:
            if not req.deliver(msg):
                # Its consumer went away without forgetting it (a stream dropped mid-way).
                self.forget(rid)
                if type(msg) is Chunk:
                    with contextlib.suppress(EngineDeadError):
                        self.send(Abort(rid=rid))
        elif rid == self._ping_rid:
            self._ping_rid = None
        elif rid in self._unawaited:
            self._unawaited.discard(rid)
            if isinstance(msg, Error):
                log.debug("ignored error for %s: [%s] %s", rid, msg.code, msg.message)
        # else: a late reply to a request we stopped waiting for

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
                # The frontend answers pings itself (a busy engine does not delay them, and
                # a stuck engine is reported by the frontend as engine_unavailable): this
                # silence means the frontend process is stopped, gone, or starved of CPU.
                self._fail(EngineDeadError(
                    f"the server's frontend at {self.endpoint} has not answered for "
                    f"{silent:.1f} s (stopped, unreachable or starved of CPU)"
                ))
                return
            if silent > self.heartbeat_interval and self._ping_rid is None:
                self._pings += 1
                self._ping_rid = f"~ping{self._pings}"
                with contextlib.suppress(EngineDeadError):  # the link dropped: `_lost` says why
                    self.send(Tokenize(rid=self._ping_rid, input=Input(text="")))

    def _fail(self, exc: EngineDeadError, *, quiet: bool = False) -> None:
        if self._dead is not None:
            return
        self._dead = exc
        if self._opening is not None:
            self._opening.cancel()
        if not quiet:  # (debug: the caller gets the error itself, raised once)
            log.debug("%s", exc.message)
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self._deferred = []  # never sent: the engine drops a dead client's sessions
        for req in list(self._routes.values()):
            req.deliver(Failed(exc))
        if self._handshake is not None:
            self._handshake.put(Failed(exc))
