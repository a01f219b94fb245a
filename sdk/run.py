"""`ProgramRun`: one execution of a program -- the operations the body appends, handed
to the event loop in batches, and the supervisor task running every state's executor.

The body (caller thread, or the loop itself for ``async def`` programs) never blocks on
appending: operations are buffered here and delivered to the loop in one hop when the
body reads a value that is not ready, or returns (a one-way ``post``: nothing waits for
the loop to take them; a sync run's first commit also starts the supervisor, in the same
hop). Reads wait in the loop (`wait_until`) on a condition that every state change
re-checks (`notify`).

The supervisor runs the root state's executor itself, and starts a task per forked state
once its fork happened and it has operations (nothing waits to be resolved): a program
without forks costs no task but the supervisor's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.from_thread import BlockingPortal
from anyio.lowlevel import EventLoopToken, checkpoint
from radixlm.runtime.transport.mailbox import Latch
from radixlm.sdk.errors import EngineDeadError, ProgramError
from radixlm.sdk.executor import END, StateExecutor
from radixlm.sdk.options import GenDefaults, protocol_options, sampling_params
from radixlm.sdk.prefix import CachedPrefix
from radixlm.sdk.tasks import TaskSet

if TYPE_CHECKING:
    from radixlm.runtime.protocol import SamplingParams
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
        cached_prefix: CachedPrefix | None = None,
    ) -> None:
        self.client = client
        # What the program's gens default to, and where its sessions start.
        options = dict(defaults)
        self.gen_defaults = GenDefaults.take(options)
        self.defaults = protocol_options("run()", options)  # a gen's options override them
        self.stream, self.pin, self.namespace = stream, pin, namespace
        self.cached_prefix = cached_prefix  # pinned by ``program.cache()``
        # The loop its executors run in.
        self.loop_thread, self.token, self.portal = loop_thread, token, portal
        self.new_waiter = client.new_waiter
        self.executors: list[StateExecutor] = []
        # Ops appended and not yet handed over, as runs of consecutive ops for one state:
        # each run reaches its state's mailbox in one put (one possible wake-up).
        self._pending: list[tuple[StateExecutor, list[Any]]] = []
        self._early: list[tuple[StateExecutor, list[Any]]] = []  # handed over before the supervisor ran
        self._sampling: dict[Any, SamplingParams] = {}
        self._tasks: TaskSet | None = None  # the supervisor's, while it runs
        self._body_ended = Latch(self.new_waiter)  # every state got its END
        self._changed: Latch | None = None
        self._scope: anyio.CancelScope | None = None
        self._cancel_requested = False
        self.body_error: BaseException | None = None
        self.body_done = False
        self.ended = False
        self.future: Future[None] | None = None  # the supervisor, when started from a thread
        # Starts the supervisor from the body's thread at the first commit (a sync run: the
        # body appends everything first, so the loop wakes once, with the whole batch).
        self.spawn: Callable[..., Future[None]] | None = None
        from radixlm.sdk.state import ProgramState  # the user-facing side (imports this one)

        self.root = ProgramState(self, self.new_executor())

    def new_executor(self, *, forked: bool = False) -> StateExecutor:
        state = StateExecutor(self, forked=forked)
        self.executors.append(state)
        return state

    # -- the body's side ------------------------------------------------------------------

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread

    def submit(self, state: StateExecutor, op: Any) -> None:
        self.submit_all(state, [op])

    def submit_all(self, state: StateExecutor, ops: list[Any]) -> None:
        if state.end_submitted:
            raise ProgramError("this state has ended (its program returned, or it was joined)")
        self._buffer(state, ops)
        state.submitted += len(ops)

    def end(self, state: StateExecutor) -> None:
        if not state.end_submitted:
            self._buffer(state, [END])
            state.end_submitted = True

    def _buffer(self, state: StateExecutor, ops: list[Any]) -> None:
        pending = self._pending
        if pending and pending[-1][0] is state:
            pending[-1][1].extend(ops)
        else:
            pending.append((state, list(ops)))

    def commit(self, *, final: bool = False) -> None:
        """Hand the buffered ops to the executors (with `final`: end every state)."""
        if self.body_done:
            return
        if final:
            for state in self.executors:
                self.end(state)
            self.body_done = True
        batch, self._pending = self._pending, []
        if not batch and not final:
            return
        if self.in_loop_thread():
            self._accept(batch, final)
            return
        if self.future is None and self.spawn is not None:  # one hop: the batch rides along
            self.future = self.spawn(self._supervise_from, batch, final)
        else:
            self.client.post(self._accept, batch, final)

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
        return next((c.error for c in self.executors if c.error is not None), None)

    # -- the loop's side ------------------------------------------------------------------

    def _accept(self, batch: list[tuple[StateExecutor, list[Any]]], final: bool) -> None:
        tasks = self._tasks
        if self.ended:
            for state, ops in batch:  # the run was cancelled: these never run
                for op in ops:
                    state.reject(op)
        elif tasks is None:  # the supervisor has not started yet
            self._early += batch
        else:
            for state, ops in batch:
                self._feed(tasks, state, ops)
        if final:
            self._body_ended.set()

    def _cancel(self) -> None:
        self._cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    def notify(self) -> None:
        latch, self._changed = self._changed, None
        if latch is not None:
            latch.set()

    async def wait_until(self, ready: Callable[[], bool]) -> None:
        while not (ready() or self.ended):
            if self._changed is None:
                self._changed = Latch(self.new_waiter)
            await self._changed.wait()

    async def _supervise_from(self, batch: list[tuple[StateExecutor, list[Any]]],
                              final: bool) -> None:
        self._accept(batch, final)
        await self.supervise()

    async def supervise(self) -> None:
        """Run every state's executor (the root's in this task); returns when the body
        ended and all states finished."""
        root = self.executors[0]
        try:
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._cancel_requested:  # e.g. the body raised: none of its ops run
                    scope.cancel()
                    await checkpoint()
                async with TaskSet() as tasks:
                    self._tasks = tasks
                    root.started = True
                    early, self._early = self._early, []
                    for state, ops in early:
                        self._feed(tasks, state, ops)
                    await root.execute()
                    await self._body_ended.wait()
        finally:
            self._tasks = None
            self.ended = True
            self.notify()
            for state, ops in self._early:  # handed over as the run ended: never run
                for op in ops:
                    state.reject(op)

    def _feed(self, tasks: TaskSet, state: StateExecutor, ops: list[Any]) -> None:
        if not state.ops.put_many(ops):
            for op in ops:  # the state failed; its later ops never run
                state.reject(op)
        elif not state.started and state.resolved:
            state.started = True
            tasks.start(state.execute)

    def sampling_for(self, options: dict[str, Any], extra_stop: tuple[str, ...] = ()
                     ) -> SamplingParams:
        """The `SamplingParams` of a gen with these options over the run's defaults (and
        `extra_stop` added to its stop strings), built once per distinct options: a
        program's gens mostly repeat theirs."""
        try:
            cached = self._sampling.get(key := (tuple(options.items()), extra_stop))
        except TypeError:  # an unhashable value (a stop list): built each time
            return self._build_sampling(options, extra_stop)
        if cached is None:
            cached = self._sampling[key] = self._build_sampling(options, extra_stop)
        return cached

    def _build_sampling(self, options: dict[str, Any], extra_stop: tuple[str, ...]
                        ) -> SamplingParams:
        params = sampling_params({**self.defaults, **options})
        if extra_stop:
            stops = [*params.stop, *(s for s in extra_stop if s not in params.stop)]
            params = msgspec.structs.replace(params, stop=stops)
        return params

    def resolved(self, state: StateExecutor) -> None:
        """`state` (a fork child) can run now: start it if it has ops."""
        tasks = self._tasks
        if not state.started and len(state.ops) and tasks is not None:
            state.started = True
            tasks.start(state.execute)


async def await_future(fut: Future[Any]) -> Any:
    """Await a concurrent future from any anyio event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio): wait in a worker thread
        return await anyio.to_thread.run_sync(fut.result, abandon_on_cancel=True)
    return await asyncio.wrap_future(fut)
