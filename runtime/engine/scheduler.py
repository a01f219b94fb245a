"""The scheduler: the seed's §4.2 cache lifecycle, one step at a time.

Each `step()`:
1. **decode** slots: every running decode gets the slot of its next token (its last
   page first, then a new page); when the pool is exhausted even after eviction and
   `SessionManager.make_room`, the newest running request is *retracted*: what it has
   computed goes into the tree as cache, its private slots are freed and it requeues
   with its output kept, so resuming mostly hits.
2. **prefill** under the `chunked_prefill` token budget: unfinished chunked prompts
   first, then waiting requests in policy order: **match** (not a reservation) →
   in-batch dedup (hold requests whose shared new prefix another one is computing) →
   **lock** the match → **allocate only the uncached suffix** (evicting unlocked leaves
   when short) — or leave it waiting.
3. one forward over decodes and prefill chunks together (continuous batching).
4. after a chunk: **insert** the computed pages, free duplicate slots at once, move the
   lock to the new node. After the last chunk: sample. At finish: **insert prompt, then
   prompt + output** (the output is its own node, evicted first), **unlock**, **free**
   what never joined the tree (a partial last page, discarded tokens). Shared pages are
   never freed at finish.

Invariant (asserted after every step with `check_invariants`):
free + evictable + protected + private == capacity.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from radixlm.cache import MatchResult, OutOfSlots, PrefixCache, TreeNode
from radixlm.runtime.engine import kv
from radixlm.runtime.engine.batch import Scheduled, build_batch
from radixlm.runtime.engine.commands import answer
from radixlm.runtime.engine.errors import RequestError
from radixlm.runtime.engine.messages import (
    ClientGone,
    EngineAbort,
    EngineCommand,
    EngineFinishAt,
    EngineGenerate,
    EngineOpenSession,
    EnginePin,
    StepOutputs,
    ToClient,
    ToFrontend,
    TokenOutput,
)
from radixlm.runtime.engine.options import SchedulerOptions
from radixlm.runtime.engine.policy import held_back, order_waiting
from radixlm.runtime.engine.request import Request, RequestGroup, RequestKind
from radixlm.runtime.engine.state import TERMINAL, ReqState, advance
from radixlm.runtime.engine.tails import TailHold
from radixlm.runtime.engine.turns import TurnGlue
from radixlm.runtime.model.batch import ForwardBatch
from radixlm.runtime.protocol import (
    Error,
    ErrorCode,
    SamplingParams,
    Struct,
    TopLogprob,
    Usage,
    encode,
)
from radixlm.runtime.sampling import Sampler, make_generator, prompt_logprobs, validate_sampling

log = logging.getLogger(__name__)

MAX_N = 64  # branches per request (the frontend checks the same bound)


class ForwardModel(Protocol):
    """What the scheduler needs of `ModelRunner`."""

    device: torch.device

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


@dataclass
class Counters:
    """Cumulative figures for stats, logs and benchmarks."""

    steps: int = 0
    forward_s: float = 0.0
    prompt_tokens: int = 0  # full prompts admitted (first admission only)
    cached_tokens: int = 0  # of those, prefix-cache hits
    computed_tokens: int = 0  # prompt tokens actually run through the model (incl. resumes)
    generated_tokens: int = 0
    retractions: int = 0
    finished: int = 0


class Scheduler:
    """Drive with `handle(msg)` for every inbound message, `step()` while `has_work()`,
    and `take_outbox()` after each to get what goes to the frontend."""

    def __init__(
        self,
        cache: PrefixCache,
        model: ForwardModel,
        sampler: Sampler,
        options: SchedulerOptions,
        *,
        eos_token_ids: Iterable[int] = (),
        sessions=None,  # SessionManager | None (None: sessions and pins refused)
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.model = model
        self.sampler = sampler
        self.opt = options
        self.sessions = sessions
        self.clock = clock
        self.page_size = cache.page_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = sampler.vocab_size
        self.device = torch.device(model.device)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # holding KV, in admission order (last = newest)
        self.groups: dict[int, RequestGroup] = {}
        self.counters = Counters()
        self.turns = TurnGlue(sessions, self._reply)
        self.tails = TailHold()  # messages for sessions whose reported turn runs its tail
        self._outputs: list[TokenOutput] = []
        self._outbox: list[ToFrontend] = []
        self._arrival = itertools.count()
        self._internal_keys = itertools.count(-1, -1)
        self._ratio = options.init_new_token_ratio
        self._epoch = 0  # bumped whenever tree nodes may have been evicted (stale matches)
        self._last_tick = -math.inf
        self._blocked: Request | None = None  # the request admission last stopped at

    # ============================================================== inbound messages
    def handle(self, msg) -> None:
        """One message from the frontend (Shutdown is the loop's business). A failure
        answers that message's client with INTERNAL and leaves the engine serving.
        Messages for a session whose turn is finishing its tail wait for it (tails.py)."""
        if self.tails.defer(msg):
            return
        self._handle(msg)
        self._replay_held()

    def _replay_held(self) -> None:
        for msg in self.tails.take_ready():  # (what these release is replayed by `handle`)
            self.handle(msg)

    def _handle(self, msg) -> None:
        try:
            self._dispatch(msg)
        except Exception as exc:  # noqa: BLE001
            log.exception("scheduler: handling %s failed", type(msg).__name__)
            error = RequestError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
            key = getattr(msg, "key", None)
            if key is not None and key in self.groups:
                self._fail_group(self.groups[key], error)
            elif isinstance(msg, (EngineGenerate, EngineOpenSession, EnginePin, EngineCommand)):
                rid = msg.msg.rid if isinstance(msg, EngineCommand) else msg.rid
                self._reply(msg.client, Error(rid=rid, code=error.code, message=error.message))
                if isinstance(msg, EngineGenerate):
                    self._outputs.append(
                        TokenOutput(key=msg.key, token_ids=[], finish_reason="error")
                    )

    def _dispatch(self, msg) -> None:
        if isinstance(msg, EngineGenerate):
            self._on_generate(msg)
        elif isinstance(msg, EngineAbort):
            self.abort(msg.key)
        elif isinstance(msg, EngineFinishAt):
            self._on_finish_at(msg)
        elif isinstance(msg, EngineOpenSession):
            self._on_open_session(msg)
        elif isinstance(msg, EnginePin):
            self._on_pin(msg)
        elif isinstance(msg, EngineCommand):
            self._reply(msg.client, answer(self, msg))
        elif isinstance(msg, ClientGone):
            self._on_client_gone(msg.client)
        else:
            log.warning("scheduler: ignoring unexpected message %r", type(msg).__name__)

    def _on_generate(self, msg: EngineGenerate) -> None:
        if msg.key in self.groups:
            self._reply(
                msg.client,
                Error(
                    rid=msg.rid,
                    code=ErrorCode.DUPLICATE_ID,
                    message=f"engine key {msg.key} is already in flight",
                ),
            )
            return
        turn_open = False
        try:
            self._check_sampling(msg.sampling, msg.n)
            appended = np.asarray(msg.input_ids, dtype=np.int64)
            namespace = msg.namespace
            if msg.session is not None:
                prompt = self.turns.begin(msg.session, msg.client, appended, namespace)
                turn_open = True
                namespace = self.turns.namespace_of(msg.session, msg.client)
            else:
                prompt = appended
            history = len(prompt) - len(appended)
            start = msg.prompt_logprobs_start
            if start is not None and not 0 <= start <= len(appended):
                raise RequestError(
                    ErrorCode.INVALID_PARAMS,
                    f"prompt_logprobs_start ({start}) must be in [0, {len(appended)}]",
                )
            self._check_fits(len(prompt), msg.sampling.max_tokens, history)
        except RequestError as e:
            if turn_open:
                self.turns.abort(msg.session)
            self._reply(msg.client, Error(rid=msg.rid, code=e.code, message=e.message))
            self._outputs.append(TokenOutput(key=msg.key, token_ids=[], finish_reason="error"))
            return
        group = RequestGroup(
            key=msg.key,
            kind=RequestKind.GENERATE,
            client=msg.client,
            rid=msg.rid,
            prompt=prompt,
            sampling=msg.sampling,
            n=msg.n,
            namespace=namespace,
            session=msg.session,
            prompt_logprobs_start=None if start is None else history + start,
            priority=msg.priority,
            appended_len=len(appended),
            session_turn_open=turn_open,
        )
        self._enqueue(group)

    def _on_open_session(self, msg: EngineOpenSession) -> None:
        try:
            session, prompt = self.turns.open(msg)
            if prompt is None:
                return  # no input: answered already
            try:
                self._check_fits(len(prompt), 0, len(prompt) - len(msg.input_ids))
            except RequestError:
                self.turns.discard_open(session, msg.client)
                raise
        except RequestError as e:
            self._reply(msg.client, Error(rid=msg.rid, code=e.code, message=e.message))
            return
        ns = self.turns.namespace_of(session, msg.client)
        self._enqueue(
            self._prefill_only_group(
                RequestKind.OPEN_SESSION, msg.client, msg.rid, prompt, ns, session=session
            )
        )

    def _on_pin(self, msg: EnginePin) -> None:
        prompt = np.asarray(msg.input_ids, dtype=np.int64)
        try:
            if not len(prompt):
                raise RequestError(ErrorCode.EMPTY_PROMPT, f"pin {msg.name!r} has an empty input")
            self.turns.check_pin(msg.name, prompt, msg.namespace)
            self._check_fits(len(prompt), 0, 0)
        except RequestError as e:
            self._reply(msg.client, Error(rid=msg.rid, code=e.code, message=e.message))
            return
        group = self._prefill_only_group(
            RequestKind.PIN, msg.client, msg.rid, prompt, msg.namespace
        )
        group.pin_name = msg.name
        self._enqueue(group)

    def _prefill_only_group(
        self,
        kind: RequestKind,
        client: bytes,
        rid: str,
        prompt: np.ndarray,
        namespace: str | None,
        session: str | None = None,
    ) -> RequestGroup:
        return RequestGroup(
            key=next(self._internal_keys), kind=kind, client=client, rid=rid,
            prompt=np.asarray(prompt, dtype=np.int64), sampling=SamplingParams(max_tokens=0),
            namespace=namespace, session=session, session_turn_open=session is not None,
        )  # fmt: skip

    def _check_sampling(self, sampling: SamplingParams, n: int) -> None:
        problem = validate_sampling(sampling, self.vocab_size)
        if problem is not None:
            raise RequestError(ErrorCode.INVALID_PARAMS, problem)
        if not 1 <= n <= MAX_N:
            raise RequestError(ErrorCode.INVALID_PARAMS, f"n must be in [1, {MAX_N}], got {n}")
        if n > 1 and sampling.max_tokens == 0:
            raise RequestError(ErrorCode.INVALID_PARAMS, "n > 1 needs max_tokens >= 1")

    def _check_fits(self, prompt_len: int, max_tokens: int, history_len: int) -> None:
        """Refuse up front what can never run: empty, beyond the context, or beyond the
        pool less what pins and hard sessions retain (the request's own history aside)."""
        if prompt_len == 0:
            raise RequestError(ErrorCode.EMPTY_PROMPT, "the prompt is empty")
        total = prompt_len + max_tokens
        ctx = self.opt.context_length
        if total > ctx:
            raise RequestError(
                ErrorCode.TOO_LONG,
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context length ({ctx})",
            )
        cap = self.cache.capacity
        if total > cap:
            raise RequestError(
                ErrorCode.TOO_LONG,
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the KV "
                f"pool ({cap} tokens)",
            )
        retained = self.turns.unreclaimable_tokens()
        if total > cap - max(0, retained - history_len):
            raise RequestError(
                ErrorCode.CAPACITY,
                f"prompt + max_tokens ({total} tokens) cannot fit: pins and hard sessions "
                f"retain {retained} of the pool's {cap} tokens",
            )

    def _enqueue(self, group: RequestGroup) -> None:
        g = group
        g.stop_ids = frozenset(g.sampling.stop_token_ids) | (
            frozenset() if g.sampling.ignore_eos else self.eos_token_ids
        )
        g.token_limit = min(g.prompt_len + g.max_tokens, self.opt.context_length)
        seed = g.sampling.seed
        for i in range(g.n):
            r = Request.new(g, i, next(self._arrival), self.page_size)
            if seed is not None:
                r.generator = make_generator(seed + i, self.device)
            if i > 0:
                r.after = g.branches[0]
            if g.sampling.logprobs or g.sampling.top_logprobs:
                r.logprobs = []
                r.top_logprobs = [] if g.sampling.top_logprobs else None
            g.branches.append(r)
            self.waiting.append(r)
        self.groups[g.key] = g

    def abort(self, key: int) -> None:
        """The client aborted: finish every live branch with "abort" (computed KV stays
        as cache). A turn that already reported Done just ends: its history stands."""
        g = self.groups.get(key)
        if g is None:
            return
        for r in g.branches:
            if r.state in TERMINAL:
                continue
            if r.reported:
                self._end(r, ReqState.FINISHED, *r.pending_end)  # type: ignore[misc]
            else:
                self._end(r, ReqState.ABORTED, "abort")

    def _on_finish_at(self, msg: EngineFinishAt) -> None:
        g = self.groups.get(msg.key)
        if g is None or not 0 <= msg.index < len(g.branches):
            return
        r = g.branches[msg.index]
        if r.state in TERMINAL or r.reported:  # reported: the frontend truncates the history
            return
        keep = max(0, min(msg.keep_tokens, len(r.output)))
        del r.output[keep:]
        r.num_tokens = g.prompt_len + keep
        if r.logprobs is not None:
            del r.logprobs[keep:]
        if r.top_logprobs is not None:
            del r.top_logprobs[keep:]
        if g.session is not None and r.state is ReqState.DECODING and r.kv_len < r.num_tokens:
            r.pending_end = ("stop", msg.matched_stop)  # kept tokens' KV first (see _sample)
            self._report_early(r, None)
            return
        self._end(r, ReqState.FINISHED, "stop", msg.matched_stop)

    def _on_client_gone(self, client: bytes) -> None:
        for g in [g for g in self.groups.values() if g.client == client]:
            for r in g.branches:
                if r.state not in TERMINAL:
                    self._end(r, ReqState.ABORTED, "abort")
        self.turns.client_gone(client)

    # ==================================================================== the loop
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def maybe_tick(self, now: float | None = None) -> None:
        """SessionManager.tick at most every `tick_interval_s`."""
        now = self.clock() if now is None else now
        if now - self._last_tick >= self.opt.tick_interval_s:
            self._last_tick = now
            if self.turns.tick(now):
                self._epoch += 1

    def step(self) -> bool:
        """One scheduling step and forward; returns whether a forward ran. A failure in
        the step fails that step's requests (INTERNAL) and leaves the engine serving."""
        plan: list[Scheduled] = []
        touched: list[Request] = []
        try:
            self._schedule(plan, touched)
            if not plan:
                self._break_stall()
                return False
            t0 = time.perf_counter()
            logits = self.model.forward(build_batch(plan, self.device))
            self.counters.forward_s += time.perf_counter() - t0
            self._after_forward(plan, logits)
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
            log.exception("scheduler step failed; failing its requests")
            self._fail(set(s.req for s in plan) | set(touched), exc)
        finally:
            self.counters.steps += 1
            self._ratio = max(
                self.opt.min_new_token_ratio, self._ratio - self.opt.new_token_ratio_decay
            )
        self._replay_held()
        if self.opt.check_invariants:
            self.check_integrity()
        return True

    def take_outbox(self) -> list[ToFrontend]:
        """Replies so far, then one StepOutputs with every new token since the last call."""
        out = self._outbox
        if self._outputs:
            out.append(StepOutputs(outputs=self._outputs))
            self._outputs = []
        self._outbox = []
        return out

    # ================================================================== scheduling
    def _schedule(self, plan: list[Scheduled], touched: list[Request]) -> None:
        self._schedule_decodes(plan)
        budget = self.opt.chunked_prefill
        for r in self.running:
            if budget <= 0:
                break
            if r.state is ReqState.PREFILLING:
                ext = self._chunk(r, budget)
                if self._grow(r, r.kv_len + ext):
                    plan.append(Scheduled(r, ext, self._logits_from(r, ext)))
                    budget -= ext
        if budget > 0 and self.waiting and len(self.running) < self.opt.max_running:
            self._admit(plan, budget, touched)

    def _schedule_decodes(self, plan: list[Scheduled]) -> None:
        """Every running decode gets the slot of its next token: its last page while it
        has room, else a new page, all allocated in one call. When the pool cannot give
        them even after eviction and make_room, retract the newest running request."""
        decoding = [r for r in self.running if r.state is ReqState.DECODING]
        if not decoding:
            return
        psize = self.page_size
        while True:
            needy = [r for r in decoding if r.num_tokens > r.alloc_len]
            if psize == 1:
                need = sum(r.num_tokens - r.alloc_len for r in needy)
            else:
                need = sum(-(-(r.num_tokens - r.alloc_len) // psize) for r in needy) * psize
            if need <= self._available() or need <= self._make_room(need):
                break
            victim = self.running[-1]
            if len(self.running) == 1:
                # Alone and still no room: pins and hard sessions hold the rest of the pool.
                log.warning("request %s stopped at %d tokens: the KV pool is full of "
                            "retained sessions/pins", victim.group.rid, len(victim.output))
                self._end(victim, ReqState.FINISHED, *(victim.pending_end or ("length", None)))
            else:
                self._retract(victim)
            if victim in decoding:
                decoding.remove(victim)
        if need:
            if need > self.cache.allocator.free_size:
                self._epoch += 1  # this allocation evicts
            slots = self.cache.alloc(need)
            off = 0
            for r in needy:
                start = r.alloc_len
                end = start + -(-(r.num_tokens - start) // psize) * psize
                r.slots[start:end] = slots[off : off + end - start]
                off += end - start
                r.alloc_len = end
        for r in decoding:
            ext = r.num_tokens - r.kv_len
            # A tail row (pending_end) only computes its token's KV: no logits for it.
            plan.append(Scheduled(r, ext, ext if r.pending_end is not None else ext - 1))

    def _admit(self, plan: list[Scheduled], budget: int, touched: list[Request]) -> None:
        opt = self.opt
        matches: dict[int, tuple[MatchResult, int]] = {}

        def match(r: Request) -> tuple[TreeNode, int]:
            m = self._match(r)
            matches[id(r)] = (m, self._epoch)
            return m.node, m.length

        order = order_waiting(opt.policy, self.waiting, match, opt.max_matched_waiting)
        inflight = [r for r in self.running if r.state is ReqState.PREFILLING]
        reserve = sum(self._future_need(r) for r in self.running)
        self._blocked = None
        try:
            for r in order:
                if budget <= 0 or len(self.running) >= opt.max_running:
                    break
                cached = matches.get(id(r))
                if cached is not None and cached[1] == self._epoch:
                    m = cached[0]
                else:
                    m = self._match(r)
                if held_back(r, m.length, inflight, opt.dedup_min_tokens, self.page_size):
                    continue
                touched.append(r)
                kv.attach(self.cache, r, m)
                ext = self._chunk(r, budget)
                need = self._pages(r.kv_len + ext) - r.alloc_len
                want = need + (reserve + self._future_need(r) - need if self.running else 0)
                if want > self._available() and want > self._make_room(want):
                    kv.detach(self.cache, r)
                    self._blocked = r
                    break
                restored = self._restore(r)
                if restored:
                    ext = self._chunk(r, budget)
                if not self._grow(r, r.kv_len + ext):
                    kv.detach(self.cache, r)
                    self._blocked = r
                    break
                advance(r, ReqState.PREFILLING)
                self.running.append(r)
                if r.cached_tokens < 0:  # first admission: usage and hit-rate figures
                    r.cached_tokens = m.length + restored
                    if r.index == 0:
                        self.turns.note_reuse(r, m.length, restored)
                    self.counters.prompt_tokens += r.group.prompt_len
                    self.counters.cached_tokens += r.cached_tokens
                plan.append(Scheduled(r, ext, self._logits_from(r, ext)))
                budget -= ext
                inflight.append(r)
                reserve += self._future_need(r)
        finally:
            self.waiting = [r for r in self.waiting if r.state is ReqState.WAITING]

    def _restore(self, r: Request) -> int:
        """Copy back session history the host tier kept (demoted sessions): those tokens
        count as computed; returns how many."""
        slots = self.turns.restore_slots(r, r.kv_len)
        if slots is None or not len(slots):
            return 0
        self._epoch += 1  # the restore allocated, maybe evicting
        limit = min(r.num_tokens - 1, r.plp_next - 1 if r.owes_prompt_logprobs else r.num_tokens)
        keep = min(len(slots), max(0, limit - r.kv_len))
        keep -= keep % self.page_size
        if keep < len(slots):
            self.cache.free(slots[keep:])
        end = r.kv_len + keep
        r.slots[r.kv_len : end] = slots[:keep]
        r.kv_len = r.alloc_len = end
        return keep

    def _break_stall(self) -> None:
        """Nothing could be scheduled. When that cannot change by itself, fail the
        request in the way rather than spin: a waiting request that does not fit even
        with nothing running (pins and sessions hold the pool), or a lone chunked prefill
        that cannot grow."""
        if self.running:
            stuck = [r for r in self.running if r.state is ReqState.PREFILLING]
            if len(stuck) == len(self.running):
                if len(stuck) > 1:
                    self._retract(stuck[-1])
                else:
                    self._fail_group(
                        stuck[0].group,
                        RequestError(
                            ErrorCode.CAPACITY, "the KV pool is full of retained sessions/pins"
                        ),
                    )
            return
        r = self._blocked
        if r is not None and r.state is ReqState.WAITING:
            self._fail_group(
                r.group,
                RequestError(
                    ErrorCode.CAPACITY,
                    f"the request needs {r.num_tokens} KV slots but only {self._available()} "
                    f"can be freed: pins and sessions hold the rest of the pool",
                ),
            )

    # ------------------------------------------------------------------ helpers
    def _match(self, r: Request) -> MatchResult:
        """The cached prefix of what the request must compute: at least its last token
        (its logits sample the next one), and everything from the first prompt position
        whose logprob is still owed."""
        limit = r.num_tokens - 1
        if r.owes_prompt_logprobs:
            limit = min(limit, r.plp_next - 1)
        return self.cache.match(r.tokens[:limit], r.group.namespace)

    def _chunk(self, r: Request, budget: int) -> int:
        """Tokens to compute this step; a cut chunk ends on a page boundary if it can."""
        remaining = r.num_tokens - r.kv_len
        if remaining <= budget:
            return remaining
        end = r.kv_len + budget
        aligned = end - end % self.page_size
        return (aligned if aligned > r.kv_len else end) - r.kv_len

    def _logits_from(self, r: Request, ext: int) -> int:
        if r.owes_prompt_logprobs:
            return min(max(0, r.plp_next - 1 - r.kv_len), ext - 1)
        return ext - 1

    def _pages(self, n: int) -> int:
        p = self.page_size
        return -(-n // p) * p

    def _available(self) -> int:
        return self.cache.allocator.free_size + self.cache.tree.evictable_size

    def _make_room(self, need: int) -> int:
        """Ask the session manager to demote idle soft sessions; returns what is
        available afterwards."""
        short = need - self._available()
        if short > 0 and self.turns.make_room(short):
            self._epoch += 1
        return self._available()

    def _grow(self, r: Request, upto: int) -> bool:
        need = upto - r.alloc_len
        if need <= 0:
            return True
        if need > self.cache.allocator.free_size:
            self._epoch += 1  # the allocation evicts: earlier matches may be stale
        try:
            kv.grow(self.cache, r, upto)
            return True
        except OutOfSlots:
            pass
        if self._make_room(self._pages(need)) < need:
            return False
        try:
            kv.grow(self.cache, r, upto)
            return True
        except OutOfSlots:
            return False

    def _future_need(self, r: Request) -> int:
        """Slots `r` will still want: the rest of its prompt plus an estimate of its
        remaining output (reserve for running requests when admitting new ones)."""
        prompt_left = max(0, r.num_tokens - r.alloc_len)
        if r.is_prefill_only:
            return prompt_left
        out_left = min(r.remaining_new_tokens, self.opt.reserve_clip)
        return prompt_left + math.ceil(out_left * self._ratio)

    # ================================================================ after forward
    def _after_forward(self, plan: list[Scheduled], logits: torch.Tensor) -> None:
        to_sample: list[Request] = []
        rows: list[int] = []
        row = 0
        decoding = ReqState.DECODING
        for s in plan:
            r, ext = s.req, s.extend
            if r.state is decoding:  # the hot path: one token in, one token out
                r.kv_len += ext
                row += ext - s.logits_from
                if r.pending_end is not None:  # its last token's KV is now computed
                    self._end(r, ReqState.FINISHED, *r.pending_end)
                    continue
                to_sample.append(r)
                rows.append(row - 1)
                continue
            n_rows = ext - s.logits_from
            if r.owes_prompt_logprobs:
                self._take_prompt_logprobs(r, logits[row : row + n_rows], r.kv_len + s.logits_from)
            row += n_rows
            self.counters.computed_tokens += ext
            r.kv_len += ext
            # Insert what is computed now (a chunk: for dedup and retraction; the whole
            # prompt: its pages become shared) and move the lock there.
            kv.cache_prefix(self.cache, r, r.kv_len, relock=True)
            if r.kv_len < r.num_tokens:
                continue
            if r.index == 0:
                r.group.prefilled = True
            if r.is_prefill_only:
                self._end(r, ReqState.FINISHED, "length")
                continue
            advance(r, decoding)
            to_sample.append(r)
            rows.append(row - 1)
        if to_sample:
            self._sample(to_sample, logits, rows)

    def _take_prompt_logprobs(self, r: Request, rows: torch.Tensor, first_pos: int) -> None:
        """Rows predict tokens first_pos+1 ...; keep those the request still owes."""
        g = r.group
        lo = max(0, r.plp_next - 1 - first_pos)
        hi = min(rows.shape[0], g.prompt_len - 1 - first_pos)
        if hi <= lo:
            return
        targets = r.tokens[first_pos + lo + 1 : first_pos + hi + 1]
        top_n = g.sampling.top_logprobs
        res = prompt_logprobs(rows[lo:hi], targets, top_n, self.vocab_size)
        if g.prompt_logprobs is None:
            g.prompt_logprobs = []
            g.prompt_top_logprobs = [] if top_n else None
        g.prompt_logprobs.extend(res.logprobs)
        if res.top_logprobs is not None and g.prompt_top_logprobs is not None:
            g.prompt_top_logprobs.extend(_tops(t) for t in res.top_logprobs)
        r.plp_next = first_pos + hi + 1

    def _sample(self, reqs: list[Request], logits: torch.Tensor, rows: list[int]) -> None:
        if len(rows) != logits.shape[0]:
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        params = [r.group.sampling for r in reqs]
        prompts = None
        if any(p.repetition_penalty != 1.0 for p in params):
            prompts = [r.tokens[: r.group.prompt_len] for r in reqs]
        gens = [r.generator for r in reqs]
        res = self.sampler.sample(
            logits, params, [r.output for r in reqs], prompts,
            gens if any(g is not None for g in gens) else None,
        )  # fmt: skip
        self.counters.generated_tokens += len(reqs)
        outputs = self._outputs
        lps, tops = res.logprobs, res.top_logprobs
        for i, (r, tok) in enumerate(zip(reqs, res.token_ids, strict=True)):
            out = TokenOutput(key=r.group.key, token_ids=[tok], index=r.index)
            if r.logprobs is not None and lps is not None:
                r.logprobs.append(lps[i])
                out.logprobs = [lps[i]]
                if r.top_logprobs is not None and tops is not None:
                    top = _tops(tops[i])
                    r.top_logprobs.append(top)
                    out.top_logprobs = [top]
            n = r.num_tokens
            r.tokens[n] = tok
            r.num_tokens = n + 1
            r.output.append(tok)
            outputs.append(out)
            g = r.group
            if tok in g.stop_ids:
                self._finish_sampled(r, "stop", tok, out)
            elif n + 1 >= g.token_limit:
                self._finish_sampled(r, "length", None, out)

    def _finish_sampled(
        self, r: Request, reason: str, matched: int | None, out: TokenOutput
    ) -> None:
        """A session turn ends one step later: its last sampled token still needs its KV
        (one more decode row, no sampling, the *tail*), or the next turn would miss that
        token. Its Done goes out now (see `_report_early`). Plain requests end at once;
        their last token joins no history."""
        if r.group.session is not None:
            r.pending_end = (reason, matched)
            self._report_early(r, out)
            return
        self._end(r, ReqState.FINISHED, reason, matched, out=out)

    def _report_early(self, r: Request, out: TokenOutput | None) -> None:
        """Send an n == 1 session turn's Done before its tail runs, and hold messages for
        its session until the turn ends (tails.py), so the client waits no extra step.
        n > 1 branches report at the end: their new sessions are made then."""
        g = r.group
        if g.n != 1 or g.kind is not RequestKind.GENERATE or g.session is None:
            return
        assert r.pending_end is not None
        r.reported = True
        r.session = g.session
        r.finish_reason, r.matched_stop = r.pending_end
        self._emit_last(r, out, None)
        self.tails.hold(g.session)

    # ============================================================ ending requests
    def _cache_kv(self, r: Request) -> TreeNode:
        """Insert what the request computed: the prompt first, then prompt + output, so
        the output is its own node (a leaf, evicted before the prompt it hangs off)."""
        limit = min(r.kv_len, r.num_tokens)
        prompt_end = min(r.group.prompt_len, limit)
        if prompt_end - prompt_end % self.page_size > r.tree_len:
            kv.cache_prefix(self.cache, r, prompt_end, relock=False)
        return kv.cache_prefix(self.cache, r, limit, relock=False)

    def _retract(self, r: Request) -> None:
        """Give the pool back: computed KV → cache, private slots → free; requeue with the
        output kept (it resumes as prompt + output so far). A turn that only waits for its
        last token's KV ends now instead (that token is recomputed by the next turn)."""
        if r.pending_end is not None:
            self._end(r, ReqState.FINISHED, *r.pending_end)
            return
        self._cache_kv(r)
        kv.detach(self.cache, r)
        self.running.remove(r)
        advance(r, ReqState.RETRACTED)
        advance(r, ReqState.WAITING)
        self.waiting.append(r)
        self.counters.retractions += 1
        self._ratio = min(1.0, max(self._ratio, self.opt.init_new_token_ratio) + 0.1)
        log.info(
            "retracted request %s (%d+%d tokens) to free KV; it will resume",
            r.group.rid,
            r.group.prompt_len,
            len(r.output),
        )

    def _end(
        self,
        r: Request,
        state: ReqState,
        reason: str,
        matched: int | str | None = None,
        *,
        out: TokenOutput | None = None,
        error: RequestError | None = None,
    ) -> None:
        """Finish/abort one branch: cache its KV (not after an error), settle its session
        turn or pin, unlock, free its private slots, and emit its last output."""
        g = r.group
        node = None
        try:
            if r.locked is not None and error is None:
                node = self._cache_kv(r)
            if state is ReqState.FINISHED:
                self.turns.finish(r, node)
            else:
                self.turns.fail(r)
        finally:
            if r.locked is not None or r.alloc_len:
                kv.detach(self.cache, r)
            if r.state in (ReqState.PREFILLING, ReqState.DECODING):
                self.running.remove(r)
            elif r.state is ReqState.WAITING:
                self.waiting.remove(r)
            advance(r, state)
        r.finish_reason, r.matched_stop = reason, matched
        if state is ReqState.FINISHED:
            self.counters.finished += 1
        if r.reported:  # its Done went out already; the session is idle again now
            self.tails.release(g.session, replay=state is ReqState.FINISHED)
        elif g.kind is RequestKind.GENERATE:
            self._emit_last(r, out, error)
        if all(b.state in TERMINAL for b in g.branches):
            self.groups.pop(g.key, None)
            self.turns.group_done(g)

    def _emit_last(self, r: Request, out: TokenOutput | None, error: RequestError | None) -> None:
        g = r.group
        if error is not None:
            out = TokenOutput(key=g.key, token_ids=[], index=r.index, finish_reason="error")
            self._outputs.append(out)
            return
        if out is None:
            out = TokenOutput(key=g.key, token_ids=[], index=r.index)
            self._outputs.append(out)
        out.finish_reason = r.finish_reason
        out.matched_stop = r.matched_stop
        out.usage = Usage(
            prompt_tokens=g.prompt_len,
            cached_tokens=max(r.cached_tokens, 0),
            completion_tokens=len(r.output),
            recomputed_tokens=g.recomputed_tokens,
            restored_tokens=g.restored_tokens,
        )
        if g.prompt_logprobs_start is not None:
            out.prompt_logprobs = g.prompt_logprobs or []
            out.prompt_top_logprobs = g.prompt_top_logprobs
        if r.session is not None:
            out.session = r.session
            out.session_length = r.num_tokens

    def _fail_group(self, g: RequestGroup, error: RequestError) -> None:
        """End every live branch of `g` with an error: one Error reply to the client.
        A turn that already reported Done ends quietly (its history stands without the
        tail: the next turn recomputes that one token)."""
        for r in g.branches:
            if r.reported and r.state not in TERMINAL:
                try:
                    self._end(r, ReqState.FINISHED, *r.pending_end)  # type: ignore[misc]
                except Exception:  # noqa: BLE001 - fall through to failing it
                    log.exception("could not end reported turn %s", g.rid)
        if all(r.state in TERMINAL for r in g.branches):
            return
        self._reply(g.client, Error(rid=g.rid, code=error.code, message=error.message))
        for r in g.branches:
            if r.state not in TERMINAL:
                try:
                    self._end(r, ReqState.ABORTED, "error", error=error)
                except Exception:  # noqa: BLE001 - keep failing the others
                    log.exception("could not release request %s cleanly", g.rid)

    def _fail(self, reqs: Iterable[Request], exc: BaseException) -> None:
        error = RequestError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        for g in {id(r.group): r.group for r in reqs}.values():
            if any(r.state not in TERMINAL for r in g.branches):
                self._fail_group(g, error)

    def _reply(self, client: bytes, msg: Struct) -> None:
        self._outbox.append(ToClient(client=client, data=encode(msg)))

    # ====================================================================== stats
    def private_tokens(self) -> int:
        return sum(r.private for r in self.running)

    def check_integrity(self) -> None:
        """The pool invariant plus the cache's own structural checks (debug/tests)."""
        self.cache.check_integrity(self.private_tokens())
        for r in self.waiting:
            assert r.alloc_len == 0 and r.locked is None, f"waiting request holds KV: {r}"

    def log_flush(self, freed: int) -> None:
        log.info("cache flushed: %d tokens evicted, %s", freed, self.cache)

    def flush_cache(self) -> int:
        """Evict everything evictable (locked content stays); returns tokens freed."""
        self._epoch += 1
        return self.cache.evict(self.cache.tree.evictable_size)


def _tops(pairs: list[tuple[int, float]]) -> list[TopLogprob]:
    return [TopLogprob(token_id=t, logprob=lp) for t, lp in pairs]
