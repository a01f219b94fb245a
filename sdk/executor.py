"""`StateExecutor`: applies one program state's operations, in order, in the event loop.

Each state of a run has one executor, with the state's data (`StateData`) and its engine
session (`SessionHandle`). The root's executor runs in the run's supervisor task, a
fork's in a task of its own, started once the fork happened. Local operations (text,
roles, variables) are applied inline, without a coroutine; the others ask the engine
(`radixlm.sdk.generation`: gen, select, separate_reasoning) or are the tree of states:
``fork`` is ``ForkSession`` (nothing is re-sent or re-tokenized) -- and a state with
nothing left to send hands its own session to its last fork, so fork(k) asks for
k - 1 -- and ``join`` waits for the forks and merges them. A state's sessions are closed
when it ends, fails or is cancelled (without awaiting the answers).

Everything here runs in the event loop of the run's client (no locks needed).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from radixlm.runtime.transport.mailbox import EMPTY, Latch, Mailbox
from radixlm.sdk.errors import ProgramError
from radixlm.sdk.generation import run_gen, run_select, separate_reasoning
from radixlm.sdk.lang import Gen, Select, SeparateReasoning
from radixlm.sdk.session_handle import SessionHandle
from radixlm.sdk.state_data import LOCAL_OPS, StateData

if TYPE_CHECKING:
    from radixlm.sdk.client import AsyncClient
    from radixlm.sdk.run import ProgramRun

__all__ = ["END", "ForkOp", "JoinOp", "StateExecutor"]


# -- operations beyond the expression vocabulary ----------------------------------------


@dataclass(frozen=True, eq=False)
class ForkOp:
    children: tuple[StateExecutor, ...]


@dataclass(frozen=True, eq=False)
class JoinOp:
    children: tuple[StateExecutor, ...]
    mode: str


class _End:
    """No more operations for this state: close its sessions."""


END = _End()


class StateExecutor:
    """One state's operations (a mailbox the run feeds), applied to its data and session."""

    __slots__ = ("_on_finish", "client", "data", "done_ops", "end_submitted", "error",
                 "finished", "ops", "resolved", "run", "seed_offset", "session", "started",
                 "submitted")

    def __init__(self, run: ProgramRun, *, forked: bool = False) -> None:
        self.run = run
        self.client: AsyncClient = run.client
        self.session = SessionHandle(run)
        self.data = StateData(self.session)
        # Program-body side (caller thread): how many ops were submitted, and whether END was.
        self.submitted = 0
        self.end_submitted = False
        # Event-loop side.
        self.ops: Mailbox[Any] = Mailbox(run.new_waiter)
        self.started = False  # it runs (or ran): once it has ops and is resolved
        self.done_ops = 0
        self.resolved = not forked  # a fork child becomes usable when its parent forked
        self.finished = False
        self._on_finish: list[Callable[[], None]] = []
        self.error: BaseException | None = None
        # Fork child i samples with the run's seed + its parent's offset + i, as branch i
        # of a ``gen(n=k)`` does: seeded forks differ from each other and rerun the same.
        self.seed_offset = 0

    def settled(self, target: int) -> bool:
        """Whether the first `target` ops ran (or never will)."""
        return self.done_ops >= target or self.error is not None or self.finished

    # -- the loop -----------------------------------------------------------------------------

    async def execute(self) -> None:
        ops, notify, local, data = self.ops, self.run.notify, LOCAL_OPS, self.data
        try:
            while self.error is None:
                op = ops.poll()  # ops already queued run back to back, without awaiting
                if op is EMPTY:
                    # Readers waiting on this state run only while it awaits: one notify
                    # before each await covers every op applied since the last one.
                    notify()
                    try:
                        op = await ops.get()
                    except anyio.EndOfStream:
                        break
                if op is END:
                    break
                apply_local = local.get(type(op))
                if apply_local is not None:
                    apply_local(data, op)
                else:
                    notify()
                    await self._apply(op)
                self.done_ops += 1
        except Exception as e:  # noqa: BLE001 - recorded; reads re-raise it
            self.error = e
        finally:
            ops.close()
            for op in ops.take_all():
                self.reject(op)
            self.session.close(self.session.owned)
            self.finished = True
            for callback in self._on_finish:
                callback()
            self.run.notify()

    def _apply(self, op: Any) -> Awaitable[None]:
        """An op that may talk to the engine (the local ones are `LOCAL_OPS`)."""
        if isinstance(op, Gen):
            return run_gen(self, op)
        if isinstance(op, ForkOp):
            return self._fork(op.children)
        if isinstance(op, Select):
            return run_select(self, op)
        if isinstance(op, JoinOp):
            return self._join(op.children, op.mode)
        if isinstance(op, SeparateReasoning):
            return separate_reasoning(self, op)
        raise ProgramError(f"unknown program operation {op!r}")  # pragma: no cover

    def reject(self, op: Any) -> None:
        """An op that will never run: children waiting on a fork fail with this state."""
        if isinstance(op, ForkOp):
            cause = self.error or ProgramError("the program ended before the fork ran")
            for child in op.children:
                child.fail(ProgramError(f"the state it was forked from failed: {cause}"))

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._resolve()

    def when_finished(self, callback: Callable[[], None]) -> None:
        """Call `callback` when this state finishes (now if it has)."""
        if self.finished:
            callback()
        else:
            self._on_finish.append(callback)

    # -- forks and joins ------------------------------------------------------------------------

    async def _fork(self, children: tuple[StateExecutor, ...]) -> None:
        session = self.session
        try:
            await session.push(keep_last=False)
            # A state that will not talk to the engine again hands its own session to its
            # last fork: one session fewer to fork now and to close later.
            hand_over = not self._engine_needed_later()
            ids: list[str] = []
            if len(children) > hand_over:
                ids = await session.fork(len(children) - hand_over)
        except BaseException as e:
            for child in children:
                child.fail(ProgramError(f"fork failed: {e}"))
            raise
        length = session.length
        if hand_over:
            ids.append(session.hand_over())
        for i, (child, sid) in enumerate(zip(children, ids, strict=False)):
            child._adopt(self, sid, length, self.seed_offset + i)
        if len(children) > 1:
            self.client.cork()  # their executors start now: their first requests, one write
        self.run.notify()

    def _engine_needed_later(self) -> bool:
        """Whether an op queued after the current one may send a request (True unless this
        state's END is queued already, with only local ops before it)."""
        for op in self.ops:
            if op is END:
                return False
            if isinstance(op, (Gen, Select, ForkOp)):
                return True
        return True

    def _adopt(self, parent: StateExecutor, session: str, length: int, seed_offset: int
               ) -> None:
        self.session.adopt(session, length)
        self.seed_offset = seed_offset
        self.data.copy_from(parent.data)
        self._resolve()

    def _resolve(self) -> None:
        """A fork child's parent forked (or failed to): its executor may start."""
        self.resolved = True
        self.run.resolved(self)
        self.run.notify()

    async def _join(self, children: tuple[StateExecutor, ...], mode: str) -> None:
        left = sum(not c.finished for c in children)
        if left:  # one wake-up when the last of them finishes, not one per child
            done = Latch(self.run.new_waiter)

            def one_finished() -> None:
                nonlocal left
                left -= 1
                if left == 0:
                    done.set()

            for child in children:
                if not child.finished:
                    child.when_finished(one_finished)
            await done.wait()
        failed = next((c for c in children if c.error is not None), None)
        if failed is not None:
            raise ProgramError(f"a forked state failed: {failed.error}") from failed.error
        if mode == "gather_variable":
            self.data.gather([c.data for c in children])
        elif mode == "concate_and_append":
            self.data.add_text("".join(c.data.fork_text() for c in children))
        else:
            raise ProgramError(f"join mode must be 'gather_variable' or 'concate_and_append', "
                               f"got {mode!r}")

    # -- streaming reads ------------------------------------------------------------------------

    def _stream_source(self, var: Any) -> str:
        data = self.data
        value = data.text if var is None else data.variables.get(var, "")
        return value if isinstance(value, str) else ""

    def _stream_done(self, var: Any) -> bool:
        if var is None:
            return self.finished or self.run.ended
        return var in self.data.var_done or self.finished or self.run.ended

    async def next_piece(self, var: Any, cursor: int, tokens: int
                         ) -> tuple[str, bool, dict[str, Any] | None, int]:
        """`next_text`, with the meta info of the tokens after `tokens` (see
        `StreamLog`) and the token count it covers, taken in the same loop step."""
        chunk, done = await self.next_text(var, cursor)
        data = self.data
        log = data.streams.get(var)
        final = data.meta.get(var) if var in data.var_done else None
        if log is None:
            return chunk, done, final, tokens
        # Tokens without text yet (held back) ride with the next piece that has some.
        return chunk, done, log.meta_since(tokens, final), len(log.tokens) if chunk else tokens

    async def next_text(self, var: Any, cursor: int) -> tuple[str, bool]:
        """Text of `var` (None: the whole state) past `cursor`, once there is some or it is
        complete; and whether it is complete."""
        await self.run.wait_until(
            lambda: len(self._stream_source(var)) > cursor or self._stream_done(var)
        )
        return self._stream_source(var)[cursor:], self._stream_done(var)
