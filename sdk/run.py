"""`ProgramRun`: one execution of a program -- the operations the body appends, handed
to the event loop in batches, and the supervisor task running every state's executor.

The body (caller thread, or the loop itself for ``async def`` programs) never blocks on
appending: operations are buffered here and delivered to the loop in one hop when the
body reads a value that is not ready, or returns. Reads wait in the loop (`wait_until`)
on a condition that every state change re-checks (`notify`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import anyio
from anyio.from_thread import BlockingPortal
from anyio.lowlevel import EventLoopToken
from radixlm.sdk.errors import EngineDeadError, ProgramError
from radixlm.sdk.executor import END, StateCore

if TYPE_CHECKING:
    from radixlm.sdk.client import AsyncClient

__all__ = ["ProgramRun", "await_future"]


class ProgramRun:
    """One execution of a program: its states, the op buffer, and the supervisor task.

    `loop_thread`/`token` name the event loop the executors run in; `portal`, when the
    loop is a sync client's, lets async code on another loop wait on this run.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        defaults: dict[str, Any],
        stream: bool,
        pin: str | None,
        namespace: str | None,
        loop_thread: int,
        token: EventLoopToken,
        portal: BlockingPortal | None = None,
    ) -> None:
        self.client = client
        self.defaults = defaults
        self.stream = stream
        self.pin = pin
        self.namespace = namespace
        self.loop_thread = loop_thread
        self.token = token
        self.portal = portal
        self.cores: list[StateCore] = []
        self._pending: list[tuple[StateCore, Any]] = []
        self._batches_send, self._batches = anyio.create_memory_object_stream[Any](math.inf)
        self._changed: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None
        self._cancel_requested = False
        self.body_error: BaseException | None = None
        self.body_done = False
        self.ended = False
        self.future: Future[None] | None = None  # the supervisor, when started via a portal
        from radixlm.sdk.state import ProgramState  # the user-facing side (imports this one)

        self.root = ProgramState(self, self.new_core())

    def new_core(self, *, forked: bool = False) -> StateCore:
        core = StateCore(self, forked=forked)
        self.cores.append(core)
        return core

    # -- the body's side ------------------------------------------------------------------

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread

    def submit(self, core: StateCore, op: Any) -> None:
        if core.end_submitted:
            raise ProgramError("this state has ended (its program returned, or it was joined)")
        self._pending.append((core, op))
        core.submitted += 1

    def end(self, core: StateCore) -> None:
        if not core.end_submitted:
            self._pending.append((core, END))
            core.end_submitted = True

    def commit(self, *, final: bool = False) -> None:
        """Hand the buffered ops to the executors (with `final`: end every state)."""
        if self.body_done:
            return
        if final:
            for core in self.cores:
                self.end(core)
            self.body_done = True
        batch, self._pending = self._pending, []
        if not batch and not final:
            return
        if self.in_loop_thread():
            self._accept(batch, final)
        else:
            self._from_thread(anyio.from_thread.run_sync, self._accept, batch, final)

    def _from_thread(self, call: Callable[..., Any], fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(fn, *args, token=self.token)
        except anyio.RunFinishedError:
            raise EngineDeadError("the client this program runs on is closed") from None

    def block_until(self, ready: Callable[[], bool]) -> None:
        """Wait (from the body's thread) until `ready()`; commits buffered ops first."""
        self.commit()
        if ready() or self.ended:
            return
        if self.in_loop_thread():
            raise ProgramError(
                "reading a value that is not ready yet would block the event loop: in an "
                "`async def` program use `await s.aget(name)` / `await s.atext()`"
            )
        self._from_thread(anyio.from_thread.run, self.wait_until, ready)

    async def await_until(self, ready: Callable[[], bool]) -> None:
        """Wait from async code (on this run's loop, or on another through the portal)."""
        self.commit()
        if ready() or self.ended:
            return
        if self.in_loop_thread():
            await self.wait_until(ready)
        elif self.portal is not None:
            await await_future(self.portal.start_task_soon(self.wait_until, ready))
        else:
            raise ProgramError("this program state belongs to another event loop")

    def cancel(self) -> None:
        """Cancel the run from any thread: in-flight requests are aborted, sessions closed."""
        if self.in_loop_thread():
            self._cancel()
        else:
            with contextlib.suppress(anyio.RunFinishedError):
                anyio.from_thread.run_sync(self._cancel, token=self.token)

    def first_error(self) -> BaseException | None:
        if self.body_error is not None:
            return self.body_error
        return next((c.error for c in self.cores if c.error is not None), None)

    # -- the loop's side ------------------------------------------------------------------

    def _accept(self, batch: list[tuple[StateCore, Any]], final: bool) -> None:
        try:
            self._batches_send.send_nowait(batch)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            for core, op in batch:  # the run was cancelled: these never run
                core.reject(op)
        if final:
            self._batches_send.close()

    def _cancel(self) -> None:
        self._cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    def notify(self) -> None:
        event, self._changed = self._changed, None
        if event is not None:
            event.set()

    async def wait_until(self, ready: Callable[[], bool]) -> None:
        while not (ready() or self.ended):
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    async def supervise(self) -> None:
        """Run every state's executor; returns when the body ended and all states finished."""
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._cancel_requested:
                    scope.cancel()
                async with anyio.create_task_group() as tg:
                    async for batch in self._batches:
                        for core, op in batch:
                            self._feed(tg, core, op)
        finally:
            self._batches.close()
            self.ended = True
            self.notify()

    def _feed(self, tg: Any, core: StateCore, op: Any) -> None:
        if core.ops_send is None:
            core.ops_send, ops = anyio.create_memory_object_stream[Any](math.inf)
            tg.start_soon(core.execute, ops)
        try:
            core.ops_send.send_nowait(op)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            core.reject(op)  # the state failed; its later ops never run


async def await_future(fut: Future[Any]) -> Any:
    """Await a concurrent future from any anyio event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio): wait in a worker thread
        return await anyio.to_thread.run_sync(fut.result, abandon_on_cancel=True)
    return await asyncio.wrap_future(fut)
