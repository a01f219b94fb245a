"""`SessionHandle`: a program state's engine session, seen from the SDK.

A state talks to the engine through one session, opened on first use (from the run's
pin, or the pin ``program.cache()`` made when the state's input starts with its prefix).
What the state appends locally is queued here (`pending`) and only this *delta* is sent,
appended to the session; the history is never re-sent. The handle also keeps the
sessions the state must close when it ends (`owned`): its own, and the forks ``select``
and ``gen(n=k)`` made. Nothing here waits for a close to be answered.

Runs in the event loop of the run's client (no locks needed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import anyio
from radixlm.runtime.protocol import (
    Done,
    Input,
    Message,
    OpenSession,
    SamplingParams,
    SessionOpened,
)
from radixlm.sdk.errors import NotFoundError, ProgramError
from radixlm.sdk.prefix import strip_prefix

if TYPE_CHECKING:
    from radixlm.sdk.client import AsyncClient
    from radixlm.sdk.run import ProgramRun

__all__ = ["APPEND_ONLY", "SessionHandle"]

# Appending input to a session without generating (and scoring select's choices).
APPEND_ONLY = SamplingParams(max_tokens=0)


class SessionHandle:
    """One state's engine session (`id`, None until opened), its length in tokens, the
    input not yet sent (`pending`), and the sessions to close when the state ends."""

    __slots__ = ("client", "handed_over", "id", "length", "owned", "pending", "run")

    def __init__(self, run: ProgramRun) -> None:
        self.run = run
        self.client: AsyncClient = run.client
        self.id: str | None = None
        self.length = 0
        self.owned: set[str] = set()  # engine sessions to close when the state ends
        self.handed_over = False  # its session went to its last fork (nothing followed)
        self.pending: list[Input] = []  # appended locally, not yet sent to the engine

    # -- the delta not yet sent ---------------------------------------------------------------

    def pend_text(self, value: str) -> None:
        if not value:
            return
        pending = self.pending
        last = pending[-1] if pending else None
        if last is not None and last.text is not None:
            pending[-1] = Input(text=last.text + value)
        else:
            pending.append(Input(text=value))

    def pend_message(self, msg: Message) -> None:
        pending = self.pending
        last = pending[-1] if pending else None
        if last is not None and last.messages is not None and not last.add_generation_prompt:
            pending[-1] = Input(messages=[*last.messages, msg], add_generation_prompt=False)
        else:
            pending.append(Input(messages=[msg], add_generation_prompt=False))

    def pend_generation_prompt(self) -> None:
        """Ask for the assistant header after the messages pending (or after the history)."""
        pending = self.pending
        last = pending[-1] if pending else None
        if last is not None and last.messages is not None and not last.add_generation_prompt:
            pending[-1] = Input(messages=last.messages, add_generation_prompt=True)
        else:
            pending.append(Input(messages=[], add_generation_prompt=True))

    # -- sending it -----------------------------------------------------------------------------

    async def push(self, keep_last: bool) -> Input | None:
        """Send what is pending to the session (opening it on first use). With `keep_last`,
        the last piece is returned instead, to travel with the request that follows."""
        inputs, self.pending = self.pending, []
        if self.id is not None:
            last = inputs.pop() if keep_last and inputs else None
        else:
            if self.handed_over:  # pragma: no cover - the executor checked nothing follows
                raise ProgramError("internal: this state gave its session to a fork")
            run = self.run
            whole = list(inputs)
            cached = self._from_cached_prefix(inputs) if run.pin is None else None
            try:
                last = await self._open(inputs, keep_last, cached or run.pin)
            except NotFoundError:
                if cached is None:
                    raise
                # The pin `program.cache()` made is gone (unpinned): start from scratch.
                run.cached_prefix.gone = True  # type: ignore[union-attr]
                run.cached_prefix = None
                inputs = whole
                last = await self._open(inputs, keep_last, None)
        client = self.client
        for inp in inputs:  # pieces of different kinds (text, messages): one append each
            msg = client.generate_message(inp, APPEND_ONLY, session=self.id)
            self.took((await client.run_generate(msg))[0])
        return last

    async def _open(self, inputs: list[Input], keep_last: bool, pinned: str | None
                    ) -> Input | None:
        """Open the session (from `pinned`) with the first of `inputs`; with `keep_last`,
        the last one is taken off and returned, as `push` returns it."""
        last = inputs.pop() if keep_last and inputs else None
        first = inputs.pop(0) if inputs else None
        client = self.client
        with anyio.CancelScope(shield=True):  # a cancel must not lose the new id
            opened = await client.call(OpenSession(
                rid=client.new_rid(), input=first, pinned=pinned, namespace=self.run.namespace,
            ), SessionOpened)
        self.id = opened.session
        self.owned.add(opened.session)
        self.length = opened.length
        return last

    def _from_cached_prefix(self, inputs: list[Input]) -> str | None:
        """The pin made by ``program.cache()`` when the state's input starts with its
        prefix (which is then taken off `inputs`: the pin holds it already)."""
        cached = self.run.cached_prefix
        if cached is None or not inputs:
            return None
        matched, rest = strip_prefix(inputs[0], cached.input)
        if not matched:
            return None
        if rest is None:
            inputs.pop(0)
        else:
            inputs[0] = rest
        return cached.name

    def took(self, done: Done) -> None:
        """A request on the session finished: its length is the engine's."""
        if done.session_length is not None:
            self.length = done.session_length

    async def truncate(self, length: int, then: str) -> None:
        """Cut the session back to `length` tokens and send `then` before anything else
        pending (``separate_reasoning`` re-feeds the answer without its thinking)."""
        assert self.id is not None
        await self.client.truncate_session(self.id, length)
        self.length = length
        later, self.pending = self.pending, []
        self.pend_text(then)
        for inp in later:
            if inp.text is not None:
                self.pend_text(inp.text)
            else:
                self.pending.append(inp)

    # -- forks and closing ------------------------------------------------------------------------

    async def fork(self, n: int) -> list[str]:
        """`n` forks of the session; the caller owns them (closes them, or has them
        adopted): no cancellation comes between their ids and the caller."""
        assert self.id is not None
        with anyio.CancelScope(shield=True):  # a cancel must not lose the new ids
            return await self.client.fork_session(self.id, n)

    def switch(self, keep: str, length: int | None, drop: Iterable[str]) -> None:
        """Continue in session `keep` (a fork of the current one) and close `drop`."""
        self.owned.add(keep)
        self.id = keep
        if length is not None:
            self.length = length
        self.close([s for s in drop if s != keep])

    def hand_over(self) -> str:
        """Give the session to a fork (this state sends nothing more): it is the fork's
        to close now."""
        sid = self.id
        assert sid is not None
        self.owned.discard(sid)
        self.id = None
        self.handed_over = True
        return sid

    def adopt(self, session: str, length: int) -> None:
        """Start from `session` (a fork's, `length` tokens), which this state closes."""
        self.id = session
        self.length = length
        self.owned.add(session)

    def close(self, sessions: Iterable[str]) -> None:
        """Close sessions the state no longer needs; nothing waits for the answers."""
        client = self.client
        for sid in list(sessions):
            self.owned.discard(sid)
            if client.alive:
                client.close_session_unawaited(sid)
