"""The event-loop side of a program state: its data and the executor applying its ops.

One executor per state applies the state's operations in order (the root's runs in the
run's supervisor task, a fork's in a task of its own, started once the fork happened).
Local operations (text, roles, variables) are applied inline, without a coroutine. A
state owns an engine session (opened on first use, from the run's pin if any); text,
role messages and ids accumulate locally and only the *delta* since the last request goes
to the engine, appended to the session. ``fork`` is ``ForkSession`` (nothing is re-sent
or re-tokenized) -- and a state with nothing left to send hands its own session to its
last fork, so fork(k) asks for k - 1; ``select`` scores every choice in its own fork of
the session (``max_tokens=0`` with the prompt logprobs of the appended choice);
``gen(n=k)`` is one Generate with ``n=k``. A state's sessions are closed when it ends,
fails or is cancelled (without awaiting the answers).

Roles: a whole message (``rl.user("hi")``) is sent as a protocol ``Message`` and rendered
by the engine as a template delta. An assistant turn containing ``gen``/``select`` asks
for the assistant header (``add_generation_prompt``) and the engine closes the turn when
the next message is appended, so the SDK never needs the chat template.

Everything here runs in the event loop of the run's client (no locks needed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import msgspec
from radixlm.runtime.protocol import (
    Chunk,
    Done,
    Input,
    Message,
    OpenSession,
    SamplingParams,
    SessionOpened,
)
from radixlm.runtime.transport.mailbox import EMPTY, Latch, Mailbox
from radixlm.sdk.choices import decide
from radixlm.sdk.errors import NotFoundError, ProgramError, plain_errors
from radixlm.sdk.lang import (
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    Text,
    VarScopeBegin,
    VarScopeEnd,
)
from radixlm.sdk.options import branch_seed
from radixlm.sdk.prefix import strip_prefix
from radixlm.sdk.reasoning import reasoning_name, split_reasoning
from radixlm.sdk.results import meta_info
from radixlm.sdk.stream_meta import StreamLog
from radixlm.sdk.text_buffer import TextBuffer

if TYPE_CHECKING:
    from radixlm.sdk.client import AsyncClient
    from radixlm.sdk.run import ProgramRun

__all__ = ["END", "ForkOp", "JoinOp", "SetVarOp", "StateCore"]


# -- operations beyond the expression vocabulary ----------------------------------------


@dataclass(frozen=True, eq=False)
class ForkOp:
    children: tuple[StateCore, ...]


@dataclass(frozen=True, eq=False)
class JoinOp:
    children: tuple[StateCore, ...]
    mode: str


@dataclass(frozen=True)
class SetVarOp:
    name: str
    value: Any


class _End:
    """No more operations for this state: close its sessions."""


END = _End()


# -- the loop side: one state's data and executor ----------------------------------------


class StateCore:
    """A state's data (written only in the event loop) and the executor applying its ops."""

    __slots__ = ("run", "client", "submitted", "end_submitted", "ops", "started", "done_ops",
                 "resolved", "finished", "_on_finish", "error", "session", "session_length",
                 "owned", "handed_over", "_text", "fork_text_pos", "messages", "variables",
                 "meta", "var_done", "pending", "role", "role_open", "role_content",
                 "role_start", "scopes", "streams", "outputs", "seed_offset")

    def __init__(self, run: ProgramRun, *, forked: bool = False) -> None:
        self.run = run
        self.client: AsyncClient = run.client
        # Program-body side (caller thread): how many ops were submitted, and whether END was.
        self.submitted = 0
        self.end_submitted = False
        # Event-loop side.
        self.ops: Mailbox[Any] = Mailbox(run.new_waiter)
        self.started = False  # its executor runs (or ran): once it has ops and is resolved
        self.done_ops = 0
        self.resolved = not forked  # a fork child becomes usable when its parent forked
        self.finished = False
        self._on_finish: list[Callable[[], None]] = []
        self.error: BaseException | None = None
        self.session: str | None = None
        self.session_length = 0
        self.owned: set[str] = set()  # engine sessions to close when this state ends
        self.handed_over = False  # its session went to its last fork (nothing followed)
        self._text = TextBuffer()
        self.fork_text_pos = 0
        self.messages: list[dict[str, str]] = []
        self.variables: dict[Any, Any] = {}
        self.meta: dict[Any, Any] = {}
        self.var_done: set[Any] = set()
        self.pending: list[Input] = []  # appended locally, not yet sent to the engine
        self.role: str | None = None
        self.role_open = False  # the assistant header was sent: generated text follows it
        self.role_content: list[str] = []
        self.role_start = 0  # where the current role's content starts in the text
        self.scopes: dict[str, int] = {}  # var_scope name -> where its text starts
        self.streams: dict[Any, StreamLog] = {}  # streaming gens' tokens and logprobs
        self.outputs: dict[Any, _Output] = {}  # where each gen's output is
        # Fork child i samples with the run's seed + its parent's offset + i, as branch i
        # of a ``gen(n=k)`` does: seeded forks differ from each other and rerun the same.
        self.seed_offset = 0

    @property
    def text(self) -> str:
        return str(self._text)

    def settled(self, target: int) -> bool:
        """Whether the first `target` ops ran (or never will)."""
        return self.done_ops >= target or self.error is not None or self.finished

    # -- executor ----------------------------------------------------------------------

    async def execute(self) -> None:
        ops, notify, local = self.ops, self.run.notify, _LOCAL_OPS
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
                    apply_local(self, op)
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
            self._close_sessions(self.owned)
            self.finished = True
            for callback in self._on_finish:
                callback()
            self.run.notify()

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

    def _close_sessions(self, sessions: set[str] | list[str]) -> None:
        """Close sessions this state no longer needs; nothing waits for the answers."""
        for sid in list(sessions):
            self.owned.discard(sid)
            if self.client.alive:
                self.client.close_session_unawaited(sid)

    async def _apply(self, op: Any) -> None:
        """An op that may talk to the engine (the local ones are in `_LOCAL_OPS`)."""
        if isinstance(op, Gen):
            await self._gen(op)
        elif isinstance(op, ForkOp):
            await self._fork(op.children)
        elif isinstance(op, Select):
            await self._select(op)
        elif isinstance(op, JoinOp):
            await self._join(op.children, op.mode)
        elif isinstance(op, SeparateReasoning):
            await self._separate_reasoning(op)
        else:  # pragma: no cover - ProgramState only submits the ops above
            raise ProgramError(f"unknown program operation {op!r}")

    def _set_var(self, name: Any, value: Any) -> None:
        self.variables[name] = value
        self.var_done.add(name)

    def _scope_begin(self, name: str) -> None:
        self.scopes[name] = len(self._text)

    def _scope_end(self, name: str) -> None:
        """``with s.var_scope(name)`` ended: the text appended inside is the variable."""
        start = self.scopes.pop(name, None)
        if start is None:  # pragma: no cover - var_scope() always submits both
            raise ProgramError(f"var_scope({name!r}) ended without beginning")
        self._set_var(name, self._text.since(start))

    # -- local text and roles ------------------------------------------------------------

    def _add_text(self, value: str) -> None:
        self._text.append(value)
        if self.role is not None:
            self.role_content.append(value)
        if self.role is None or self.role_open:
            self._pend_text(value)

    def _add_generated(self, value: str) -> None:
        """Text the engine produced: already in the session's history."""
        self._text.append(value)
        if self.role is not None:
            self.role_content.append(value)

    def _pend_text(self, value: str) -> None:
        if not value:
            return
        last = self.pending[-1] if self.pending else None
        if last is not None and last.text is not None:
            self.pending[-1] = Input(text=last.text + value)
        else:
            self.pending.append(Input(text=value))

    def _pend_message(self, msg: Message) -> None:
        last = self.pending[-1] if self.pending else None
        if last is not None and last.messages is not None and not last.add_generation_prompt:
            self.pending[-1] = Input(messages=[*last.messages, msg], add_generation_prompt=False)
        else:
            self.pending.append(Input(messages=[msg], add_generation_prompt=False))

    def _role_begin(self, role: str) -> None:
        if self.role is not None:
            raise ProgramError(f"rl.{role}() inside rl.{self.role}(): roles cannot nest")
        self.role, self.role_open, self.role_content = role, False, []
        self.role_start = len(self._text)

    def _role_end(self, role: str) -> None:
        if self.role != role:
            raise ProgramError(f"{role}_end() without a matching {role}_begin()")
        content = "".join(self.role_content)
        if not self.role_open:
            self._pend_message(Message(role=role, content=content))
        self.messages.append({"role": role, "content": content})
        self.role, self.role_open, self.role_content = None, False, []

    def _open_turn(self) -> None:
        """Before generating inside a role: send the assistant header, then the turn's text."""
        if self.role is None or self.role_open:
            return
        if self.role != "assistant":
            raise ProgramError(
                f"gen()/select() inside rl.{self.role}() is not supported: the engine renders "
                f"{self.role} messages whole; generate inside rl.assistant(...)"
            )
        last = self.pending[-1] if self.pending else None
        if last is not None and last.messages is not None and not last.add_generation_prompt:
            self.pending[-1] = Input(messages=last.messages, add_generation_prompt=True)
        else:
            self.pending.append(Input(messages=[], add_generation_prompt=True))
        self.role_open = True
        self._pend_text("".join(self.role_content))

    # -- engine requests ------------------------------------------------------------------

    async def _push(self, keep_last: bool) -> Input | None:
        """Send what is pending to the session (opening it on first use). With `keep_last`,
        the last piece is returned instead, to travel with the request that follows."""
        inputs, self.pending = self.pending, []
        if self.session is not None:
            last = inputs.pop() if keep_last and inputs else None
        else:
            if self.handed_over:  # pragma: no cover - `_fork` checked nothing follows
                raise ProgramError("internal: this state gave its session to a fork")
            whole = list(inputs)
            cached = self._from_cached_prefix(inputs) if self.run.pin is None else None
            try:
                last = await self._open(inputs, keep_last, cached or self.run.pin)
            except NotFoundError:
                if cached is None:
                    raise
                # The pin `program.cache()` made is gone (unpinned): start from scratch.
                self.run.cached_prefix.gone = True  # type: ignore[union-attr]
                self.run.cached_prefix = None
                inputs = whole
                last = await self._open(inputs, keep_last, None)
        for inp in inputs:  # pieces of different kinds (text, messages): one append each
            msg = self.client.generate_message(inp, _APPEND_ONLY, session=self.session)
            done = (await self.client.run_generate(msg))[0]
            self._took(done)
        return last

    async def _open(self, inputs: list[Input], keep_last: bool, pinned: str | None
                    ) -> Input | None:
        """Open this state's session (from `pinned`) with the first of `inputs`; with
        `keep_last`, the last one is taken off and returned, as `_push` returns it."""
        last = inputs.pop() if keep_last and inputs else None
        first = inputs.pop(0) if inputs else None
        with anyio.CancelScope(shield=True):  # a cancel must not lose the new id
            opened = await self.client.call(OpenSession(
                rid=self.client.new_rid(), input=first, pinned=pinned,
                namespace=self.run.namespace,
            ), SessionOpened)
        self.session = opened.session
        self.owned.add(opened.session)
        self.session_length = opened.length
        return last

    def _from_cached_prefix(self, inputs: list[Input]) -> str | None:
        """The pin made by ``program.cache()`` when this state's input starts with its
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

    def _took(self, done: Done) -> None:
        if done.session_length is not None:
            self.session_length = done.session_length

    def _switch_session(self, keep: str, length: int | None, drop: list[str]) -> None:
        """Continue in session `keep` (a fork of the current one) and close `drop`."""
        self.owned.add(keep)
        self.session = keep
        if length is not None:
            self.session_length = length
        self._close_sessions([s for s in drop if s != keep])

    async def _gen(self, op: Gen) -> None:
        self._open_turn()
        pending = self.pending
        if self.session is not None and len(pending) <= 1:  # the usual case: nothing to push
            last = pending.pop() if pending else None
        else:
            last = await self._push(keep_last=True)
        run = self.run
        sampling = run.sampling_for(op.sampling, op.dtype_stop)
        if self.seed_offset and sampling.seed is not None:
            sampling = msgspec.structs.replace(
                sampling, seed=branch_seed(sampling.seed, self.seed_offset))
        n = op.n if op.n is not None else run.gen_defaults.n
        logprob_start = (op.logprob_start_len if op.logprob_start_len is not None
                         else run.gen_defaults.logprob_start_len)
        # SGLang's logprob_start_len counts in the whole prompt (the state's text); the
        # protocol's start counts from the appended input (negative: into the history).
        plp_start = None
        if logprob_start is not None and sampling.logprobs:
            plp_start = logprob_start - self.session_length
        texts = op.text_in_logprobs if op.text_in_logprobs is not None else \
            run.gen_defaults.text_in_logprobs
        stream = run.stream and n == 1
        msg = self.client.generate_message(last or Input(input_ids=[]), sampling,
                                           session=self.session, n=n, stream=stream,
                                           prompt_logprobs_start=plp_start,
                                           logprob_texts=bool(texts))
        name = op.name
        text_start = len(self._text)
        start = time.perf_counter()
        if n > 1:
            req = self.client.request(msg)
            try:
                async with req:
                    while not req.finished:
                        await req.receive()
            finally:  # every branch got a session of its own, aborted ones included
                self.owned.update(d.session for d in req.dones if d.session is not None)
            dones = sorted(req.dones, key=lambda d: d.index)
            latency = time.perf_counter() - start
            branches = [d.session for d in dones if d.session is not None]
            if branches:
                old = self.session
                self._switch_session(branches[0], dones[0].session_length,
                                     [*branches[1:], *([old] if old else [])])
            self.variables[name] = [d.text for d in dones]
            self.meta[name] = [_gen_meta(d, latency, logprob_start) for d in dones]
            done = dones[0]
            self._add_generated(done.text)
        elif stream:
            self.variables[name] = ""
            log = self.streams[name] = StreamLog(msg.rid)
            done = None
            async with self.client.request(msg) as req:
                while not req.finished:
                    reply = await req.receive()
                    if isinstance(reply, Chunk):
                        log.add(reply)
                        self.variables[name] += reply.text
                        self._add_generated(reply.text)
                        self.run.notify()
                    elif isinstance(reply, Done):
                        done = reply
            assert done is not None
            self._took(done)
            self.meta[name] = _gen_meta(done, time.perf_counter() - start, logprob_start)
        else:
            done = (await self.client.run_generate(msg))[0]
            self._took(done)
            self.variables[name] = done.text
            self.meta[name] = _gen_meta(done, time.perf_counter() - start, logprob_start)
            self._add_generated(done.text)
        self.outputs[name] = _Output(text_start, len(self._text), done.usage.prompt_tokens)
        self.var_done.add(name)

    async def _select(self, op: Select) -> None:
        self._open_turn()
        await self._push(keep_last=False)
        assert self.session is not None
        with anyio.CancelScope(shield=True):  # a cancel must not lose the new ids
            forks = await self.client.fork_session(self.session, len(op.choices))
        self.owned.update(forks)
        dones: list[Done | None] = [None] * len(forks)
        start = time.perf_counter()

        async def score(i: int) -> None:
            msg = self.client.generate_message(Input(text=op.choices[i]), _APPEND_ONLY,
                                               session=forks[i], prompt_logprobs_start=0)
            dones[i] = (await self.client.run_generate(msg))[0]

        with plain_errors():
            async with anyio.create_task_group() as tg:
                for i in range(len(forks)):
                    tg.start_soon(score, i)
                self.client.cork()  # their requests, one write
        scored = [d for d in dones if d is not None]
        logprobs = [list(d.prompt_logprobs or []) for d in scored]
        unconditional = None
        if getattr(op.method, "requires_unconditional_logprobs", False):
            unconditional = await self._unconditional(op.choices, [len(lp) for lp in logprobs])
        index, decision_meta = decide(op.method, list(op.choices), logprobs, unconditional)
        history = self.session_length  # where the chosen choice begins in its session
        old = self.session
        self._switch_session(forks[index], scored[index].session_length, [*forks, old])
        choice = op.choices[index]
        latency = time.perf_counter() - start
        self.variables[op.name] = choice
        self.meta[op.name] = {
            "choices": list(op.choices),
            "choices_method": getattr(op.method, "name", type(op.method).__name__),
            **decision_meta,
            # Alternatives are not asked for when scoring: one None per token, as SGLang
            # writes a position without them.
            "input_top_logprobs": [[None] * len(lp) for lp in logprobs],
            "prompt_tokens": sum(d.usage.prompt_tokens for d in scored),
            "cached_tokens": sum(d.usage.cached_tokens for d in scored),
            "completion_tokens": 0,
            "finish_reason": {"type": "stop", "matched": None},
            "e2e_latency": latency,
        }
        self.var_done.add(op.name)
        text_start = len(self._text)
        self._add_generated(choice)
        self.outputs[op.name] = _Output(text_start, len(self._text), history)

    async def _unconditional(self, choices: tuple[str, ...], lengths: list[int]
                             ) -> list[list[float | None]]:
        """Each choice's tokens scored with no context (plain requests): the last
        ``len - 1`` logprobs, after a None for the first token (it has no context)."""
        out: list[list[float | None]] = [[] for _ in choices]

        async def one(i: int) -> None:
            msg = self.client.generate_message(Input(text=choices[i]), _APPEND_ONLY,
                                               namespace=self.run.namespace,
                                               prompt_logprobs_start=0)
            values = list((await self.client.run_generate(msg))[0].prompt_logprobs or [])
            n = lengths[i]
            tail: list[float | None] = list(values[-(n - 1):]) if n > 1 else []
            out[i] = ([None] * (n - len(tail)) + tail) if n else []

        with plain_errors():
            async with anyio.create_task_group() as tg:
                for i in range(len(choices)):
                    tg.start_soon(one, i)
                self.client.cork()
        return out

    async def _separate_reasoning(self, op: SeparateReasoning) -> None:
        """Move each named gen's thinking block into ``<name>_reasoning_content``; the
        state's text and its session keep only the answer (the session is cut back to
        where the gen began and the answer appended, so the model does not see the
        reasoning again, as with SGLang's text). Streamed runs are left as they are."""
        if self.run.stream:
            return
        for name in op.names:
            value = self.variables.get(name)
            if isinstance(value, list):  # gen(n=k): each branch; the state has the first
                pairs = [split_reasoning(v, op.format) for v in value]
                self._set_var(name, [a for _, a in pairs])
                self._set_var(reasoning_name(name), [r for r, _ in pairs])
                reasoning, answer = pairs[0] if pairs else ("", "")
                value = value[0] if value else ""
            elif isinstance(value, str):
                reasoning, answer = split_reasoning(value, op.format)
                self._set_var(name, answer)
                self._set_var(reasoning_name(name), reasoning)
            else:
                continue
            out = self.outputs.get(name)
            if out is not None and answer != value:
                await self._replace_output(out, answer)

    async def _replace_output(self, out: _Output, answer: str) -> None:
        text = str(self._text)
        after = text[out.text_end:]
        self._text.truncate(out.text_start)
        self._text.append(answer + after)
        if self.role is not None:
            self.role_content = [self._text.since(self.role_start)]
        if self.session is not None:
            await self.client.truncate_session(self.session, out.prompt_tokens)
            self.session_length = out.prompt_tokens
            later, self.pending = self.pending, []
            self._pend_text(answer)
            for inp in later:
                if inp.text is not None:
                    self._pend_text(inp.text)
                else:
                    self.pending.append(inp)

    async def _fork(self, children: tuple[StateCore, ...]) -> None:
        try:
            await self._push(keep_last=False)
            assert self.session is not None
            # A state that will not talk to the engine again hands its own session to its
            # last fork: one session fewer to fork now and to close later.
            hand_over = not self._engine_needed_later()
            ids: list[str] = []
            if len(children) > hand_over:
                with anyio.CancelScope(shield=True):  # a cancel must not lose the new ids
                    ids = await self.client.fork_session(self.session,
                                                         len(children) - hand_over)
        except BaseException as e:
            for child in children:
                child.fail(ProgramError(f"fork failed: {e}"))
            raise
        if hand_over:
            ids.append(self.session)
            self.owned.discard(self.session)
            self.session = None
            self.handed_over = True
        for i, (child, sid) in enumerate(zip(children, ids, strict=False)):
            child._adopt(self, sid, self.seed_offset + i)
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

    def _adopt(self, parent: StateCore, session: str, seed_offset: int) -> None:
        self.session = session
        self.seed_offset = seed_offset
        self.owned.add(session)
        self.session_length = parent.session_length
        self._text = parent._text.copy()
        self.fork_text_pos = len(parent._text)
        self.messages = list(parent.messages)
        self.variables = dict(parent.variables)
        self.meta = dict(parent.meta)
        self.var_done = set(parent.var_done)
        self.role, self.role_open = parent.role, parent.role_open
        self.role_content = list(parent.role_content)
        self.role_start = parent.role_start
        self.scopes = dict(parent.scopes)
        self.outputs = dict(parent.outputs)
        self._resolve()

    def _resolve(self) -> None:
        """A fork child's parent forked (or failed to): its executor may start."""
        self.resolved = True
        self.run.resolved(self)
        self.run.notify()

    def when_finished(self, callback: Callable[[], None]) -> None:
        """Call `callback` when this state finishes (now if it has)."""
        if self.finished:
            callback()
        else:
            self._on_finish.append(callback)

    async def _join(self, children: tuple[StateCore, ...], mode: str) -> None:
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
            before = set(self.variables)
            for child in children:
                for key, value in child.variables.items():
                    if key in before:
                        continue
                    self.variables.setdefault(key, []).append(value)
                    self.meta.setdefault(key, []).append(child.meta.get(key))
                    self.var_done.add(key)
        elif mode == "concate_and_append":
            self._add_text("".join(c.text[c.fork_text_pos:] for c in children))
        else:
            raise ProgramError(f"join mode must be 'gather_variable' or 'concate_and_append', "
                               f"got {mode!r}")

    # -- streaming reads ------------------------------------------------------------------

    def _stream_source(self, var: Any) -> str:
        value = self.text if var is None else self.variables.get(var, "")
        return value if isinstance(value, str) else ""

    def _stream_done(self, var: Any) -> bool:
        if var is None:
            return self.finished or self.run.ended
        return var in self.var_done or self.finished or self.run.ended

    async def next_piece(self, var: Any, cursor: int, tokens: int
                         ) -> tuple[str, bool, dict[str, Any] | None, int]:
        """`next_text`, with the meta info of the tokens after `tokens` (see
        `StreamLog`) and the token count it covers, taken in the same loop step."""
        chunk, done = await self.next_text(var, cursor)
        log = self.streams.get(var)
        final = self.meta.get(var) if var in self.var_done else None
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


# Appending input to a session without generating (and scoring select's choices).
_APPEND_ONLY = SamplingParams(max_tokens=0)


class _Output(NamedTuple):
    """Where a gen's output is: in the state's text, and in its session's history."""

    text_start: int
    text_end: int
    prompt_tokens: int  # the session's length before the output


def _gen_meta(done: Done, latency_s: float, logprob_start: int | None) -> dict[str, Any]:
    """A gen's meta info. ``input_token_logprobs`` as SGLang lists them: the tokens from
    ``logprob_start_len`` on, the first with the logprob None (SGLang's scheduler keeps the
    logprobs from the start's logits on, which predict the tokens after it); at start 0
    that token's id is not known here either (no logprob comes with it)."""
    info = meta_info(done, latency_s)
    triples = info.get("input_token_logprobs")
    if logprob_start is not None and triples is not None:
        if logprob_start == 0:
            info["input_token_logprobs"] = [(None, None, None), *triples]
        elif triples:
            _, token, text = triples[0]
            info["input_token_logprobs"] = [(None, token, text), *triples[1:]]
    return info

# Ops that never talk to the engine, applied without a coroutine: (state, op) -> None.
_LOCAL_OPS: dict[type, Callable[[StateCore, Any], None]] = {
    Text: lambda core, op: core._add_text(op.value),
    RoleBegin: lambda core, op: core._role_begin(op.role),
    RoleEnd: lambda core, op: core._role_end(op.role),
    SetVarOp: lambda core, op: core._set_var(op.name, op.value),
    VarScopeBegin: lambda core, op: core._scope_begin(op.name),
    VarScopeEnd: lambda core, op: core._scope_end(op.name),
}
