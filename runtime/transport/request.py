"""`Request`: one in-flight request of a `Connection`, its replies routed to it by rid.

It ends as every request does (`exchange.Replies`): after its ``Error``, its single
answer, or -- for a ``Generate`` -- the ``Done`` of each of its ``n`` branches. Closing one
that is not finished aborts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
from radixlm.runtime.protocol import Abort, ServerMessage, Struct
from radixlm.runtime.transport.errors import EngineError
from radixlm.runtime.transport.exchange import Replies
from radixlm.runtime.transport.mailbox import EMPTY, Mailbox, Waiter

__all__ = ["Failed", "Request"]


class _Owner(Protocol):
    """What a request needs of its connection."""

    new_waiter: Callable[[], Waiter]
    abort_timeout: float

    @property
    def alive(self) -> bool: ...

    def send(self, msg: Struct) -> None: ...

    def forget(self, rid: str) -> None: ...


@dataclass(frozen=True)
class Failed:
    """Put in a request's mailbox when the connection fails."""

    exc: EngineError


class Request(Replies):
    """One in-flight request: its replies, in order, until the last one."""

    __slots__ = ("_box", "_conn", "_generate", "on_close", "started_at")

    def __init__(self, conn: _Owner, rid: str, *, branches: int, generate: bool) -> None:
        Replies.__init__(self, rid, branches)
        self._conn = conn
        self._box: Mailbox[Any] = Mailbox(conn.new_waiter)
        self._generate = generate
        self.started_at = time.perf_counter()
        self.on_close: Callable[[], None] | None = None

    def deliver(self, reply: Any) -> bool:
        """Hand a reply (or `Failed`) to the request; False, dropping it, once closed."""
        return self._box.put(reply)

    async def receive(self) -> ServerMessage:
        """The next reply; raises the typed `EngineError` for an ``Error`` reply."""
        item = self._box.poll()  # a queued reply (a streamed burst) is taken at once
        if item is EMPTY:
            item = await self._box.get()
        if type(item) is Failed:
            self._dones_left = 0
            raise item.exc
        return self.take(item)

    async def aclose(self) -> None:
        """Stop routing replies here. A generation still running is aborted first, and its
        final reply awaited (briefly) so its session is no longer busy afterwards."""
        if self._box.closed:  # closed already (an interrupted stream is closed twice)
            return
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
            self.close()

    def close(self) -> None:
        """Stop routing replies here, now (nothing is aborted)."""
        self._conn.forget(self.rid)
        self._box.close()
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()

    async def __aenter__(self) -> Request:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._dones_left <= 0:  # the usual case: nothing to abort, nothing to await
            self.close()
        else:
            await self.aclose()
