"""Connecting a client again after the server dropped its connection, and resuming the
durable sessions it holds.

A connection the server dropped (a frontend restarted by `radixlm serve`) fails the
requests in flight with `EngineDeadError`; the client's next call connects again (within
its connect timeout) and resumes every durable session the client holds (``durable=True``:
they outlive disconnects and restarts). After an engine restart the engine no longer knows
them: a request naming one of them gets `NotFoundError`, and is sent once more after they
are all resumed.

Apart from client.py because the client's other calls never need it: this is the one
place that replaces the client's protocol core, and the one reader of the set of durable
sessions the client holds.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup
from radixlm.runtime.protocol import Struct
from radixlm.runtime.transport.client import ProtocolClient
from radixlm.runtime.transport.connection import Liveness
from radixlm.runtime.transport.probe import NoServerError, probe_endpoint
from radixlm.sdk.errors import EngineDeadError, NotFoundError, ProgramError

R = TypeVar("R")

NOT_CONNECTED = "the client is not connected (use `async with AsyncClient(...)`)"


class Reconnect:
    """An `AsyncClient`'s reconnection. `new_core` makes a protocol core for its endpoint,
    `current` returns the client's core of the moment and `use` makes a new one current;
    `liveness` (the server process the client watches) says why a dropped server is gone
    for good."""

    def __init__(self, endpoint: str, new_core: Callable[[], ProtocolClient],
                 current: Callable[[], ProtocolClient], use: Callable[[ProtocolClient], None],
                 connect_timeout: float, liveness: Liveness | None) -> None:
        self.endpoint = endpoint
        self.durable: set[str] = set()  # the durable sessions the client holds: resumed
        self._new_core = new_core
        self._current = current
        self._use = use
        self._connect_timeout = connect_timeout
        self._liveness = liveness
        self._tg: TaskGroup | None = None  # where the client's connections run their tasks
        self._lock: anyio.Lock | None = None

    def start(self, tg: TaskGroup) -> None:
        """The client opened, its connections' tasks running in `tg`."""
        self._tg, self._lock = tg, anyio.Lock()

    @property
    def dropped(self) -> bool:
        """Whether the server dropped the open client's connection (the next call
        connects again)."""
        return self._tg is not None and not self._current().conn.alive

    async def recover(self) -> None:
        """A new connection if the server dropped this one, then every durable session
        the client holds resumed as its own (one `not_found` drops that id)."""
        lock, tg = self._lock, self._tg
        if lock is None or tg is None:
            raise ProgramError(NOT_CONNECTED)
        async with lock:
            if not self._current().conn.alive:
                reason = self._liveness() if self._liveness is not None else None
                if reason:  # the server process this client watches has exited
                    raise EngineDeadError(reason)
                try:  # nothing listening there any more: at once, not after a timeout
                    await anyio.to_thread.run_sync(probe_endpoint, self.endpoint)
                except NoServerError as e:
                    raise EngineDeadError(f"the server at {self.endpoint} is gone: {e}") from None
                core = self._new_core()
                await core.open(tg, self._connect_timeout)
                self._current().close()
                self._use(core)
            for session in list(self.durable):
                try:
                    await self._current().resume_session(session)
                except NotFoundError:
                    self.durable.discard(session)

    def send(self, msg: Struct,
             send: Callable[[], Coroutine[Any, Any, R]]) -> Coroutine[Any, Any, R]:
        """`send()` (the request `msg` sent on the core of the moment): after connecting
        again if the server dropped the connection; for a request naming a durable session
        of the client that the engine does not know (it restarted), once more after the
        sessions are resumed."""
        if self.dropped:
            return self._recovered(send)
        if getattr(msg, "session", None) not in self.durable:
            return send()
        return self._retried(send(), send)

    async def _recovered(self, again: Callable[[], Coroutine[Any, Any, R]]) -> R:
        await self.recover()
        return await again()

    async def _retried(self, first: Coroutine[Any, Any, R],
                       again: Callable[[], Coroutine[Any, Any, R]]) -> R:
        try:
            return await first
        except NotFoundError:
            await self.recover()
            return await again()
