"""`TaskSet`: child tasks of one supervising task, started cheaply, ended together.

A program starts one task per forked state. An anyio task costs several times an
asyncio one (its handle, name and cancel scope bookkeeping: ~50 us against ~15 us on a
small host), so on asyncio the children are bare tasks, each inside its own anyio cancel
scope (so shields within still hold and anyio primitives work), and the set cancels and
awaits them itself the way a task group would. On other loops it is an anyio task group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import anyio
from anyio.abc import TaskGroup

__all__ = ["TaskSet"]


class TaskSet:
    """``async with TaskSet() as tasks: tasks.start(fn, *args)`` -- leaving waits for every
    task; an error or cancellation of the body cancels them first."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tg: TaskGroup | None = None
        self._scopes: set[anyio.CancelScope] = set()  # of the tasks not finished
        self._running = 0
        self._idle: asyncio.Future[None] | None = None
        self._open = False
        self._error: BaseException | None = None  # a child's non-Exception failure

    async def __aenter__(self) -> TaskSet:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # trio
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        self._open = True
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        if self._tg is not None:
            try:
                return await self._tg.__aexit__(exc_type, exc, tb)
            finally:
                self._open = False
        if exc_type is not None:
            self.cancel()
        try:
            await self._all_done()
        except BaseException:  # cancelled while waiting: the children go too
            self.cancel()
            with anyio.CancelScope(shield=True):
                await self._all_done()
            raise
        finally:
            self._open = False
        if self._error is not None and exc_type is None:
            raise self._error
        return None

    def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> anyio.CancelScope:
        """Start ``fn(*args)`` (from the loop's thread); returns the cancel scope it runs in.
        Raises ``RuntimeError`` once the set is closing."""
        if not self._open:
            raise RuntimeError("this TaskSet is not open")
        scope = anyio.CancelScope()
        self._scopes.add(scope)
        if self._tg is not None:
            self._tg.start_soon(self._run, scope, fn, args)
        else:
            assert self._loop is not None
            self._running += 1
            self._loop.create_task(self._run(scope, fn, args))
        return scope

    def cancel(self) -> None:
        """Cancel every task (those not started yet too)."""
        for scope in self._scopes:
            scope.cancel()

    async def _run(self, scope: anyio.CancelScope, fn: Callable[..., Awaitable[Any]],
                   args: tuple[Any, ...]) -> None:
        try:
            with scope:
                await fn(*args)
        except asyncio.CancelledError:
            if self._tg is not None:
                raise
            # A bare task cancelled from outside its scope: the loop is shutting down.
        except BaseException as e:
            if self._tg is not None:
                raise
            if self._error is None:  # handed to the supervisor, as a task group would
                self._error = e
            self.cancel()
        finally:
            self._scopes.discard(scope)
            if self._tg is None:
                self._running -= 1
                idle = self._idle
                if self._running == 0 and idle is not None and not idle.done():
                    idle.set_result(None)

    async def _all_done(self) -> None:
        while self._running:
            assert self._loop is not None
            self._idle = self._loop.create_future()
            await self._idle
