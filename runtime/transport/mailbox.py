"""Cheap primitives for one event loop: `Mailbox` (a queue) and `Latch` (a one-shot flag).

The clients' hot paths (every reply to a request; in the SDK, every program operation
and every join) go through these. They do what an anyio memory object stream or
`anyio.Event` does for them at a fraction of the cost: a ``put`` is a deque append, a
``get`` with items queued never yields, and a waiter (an asyncio future; an
`anyio.Event` on other loops) exists only while someone waits.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

import anyio

__all__ = ["EMPTY", "EventWaiter", "Latch", "Mailbox", "Waiter", "waiter_factory"]

T = TypeVar("T")


class _Empty:
    """What `Mailbox.poll` returns when nothing is queued."""


EMPTY: Any = _Empty()


class Waiter(Protocol):
    """What a consumer awaits: an asyncio future, or `EventWaiter` elsewhere."""

    def done(self) -> bool: ...

    def set_result(self, result: None, /) -> None: ...

    def __await__(self) -> Generator[Any, None, Any]: ...


class EventWaiter:
    """A one-shot waiter shaped like an asyncio future, for loops other than asyncio."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = anyio.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def set_result(self, result: None, /) -> None:
        self._event.set()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._event.wait().__await__()


def waiter_factory() -> Callable[[], Waiter]:
    """How to make waiters in the running event loop (call it from that loop)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio
        return EventWaiter
    return loop.create_future


class Mailbox(Generic[T]):
    """Items in, in order, to one consumer; ``close`` ends it once the items are taken."""

    __slots__ = ("_items", "_new_waiter", "_waiter", "closed")

    def __init__(self, new_waiter: Callable[[], Waiter]) -> None:
        self._items: deque[T] = deque()
        self._new_waiter = new_waiter
        self._waiter: Waiter | None = None
        self.closed = False

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        """The queued items, oldest first (left in place)."""
        return iter(self._items)

    def put(self, item: T) -> bool:
        """Queue `item` (False, dropping it, once the mailbox is closed)."""
        return self.put_many((item,))

    def put_many(self, items: Sequence[T]) -> bool:
        """Queue `items` in order, with one wake-up (False, dropping them, once closed)."""
        if self.closed:
            return False
        self._items.extend(items)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    def poll(self) -> T:
        """The next item if one is queued, else `EMPTY` (never waits)."""
        items = self._items
        return items.popleft() if items else EMPTY

    async def get(self) -> T:
        """The next item, waiting for one; raises `anyio.EndOfStream` once closed and empty."""
        items = self._items
        while not items:
            if self.closed:
                raise anyio.EndOfStream
            self._waiter = waiter = self._new_waiter()
            try:
                await waiter
            finally:
                self._waiter = None
        return items.popleft()

    def take_all(self) -> list[T]:
        """Every queued item, now (the mailbox is left empty)."""
        items = list(self._items)
        self._items.clear()
        return items

    def close(self) -> None:
        """No more items; a waiting consumer wakes up (to take the rest, then EndOfStream)."""
        self.closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Latch:
    """A flag that is set once; `wait` returns once it is."""

    __slots__ = ("_new_waiter", "_waiters", "is_set")

    def __init__(self, new_waiter: Callable[[], Waiter]) -> None:
        self._new_waiter = new_waiter
        self._waiters: list[Waiter] = []
        self.is_set = False

    def set(self) -> None:
        self.is_set = True
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        while not self.is_set:
            waiter = self._new_waiter()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:  # cancelled before the latch was set
                    self._waiters.remove(waiter)
