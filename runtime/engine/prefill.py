"""Prefill scheduling: which prompt tokens run this step, under the chunked-prefill budget.

Waiting requests are admitted first, in policy order -- with half the budget while
unfinished chunked prompts run, which share the rest equally (then what is left, oldest
first), so that a new request is admitted within one step of a long prefill and finishes
its prompt within a few, rather than after the long prompt's last chunk: **match**
(not a reservation; a match taken at an older cache epoch is redone) → in-batch dedup
(hold requests whose shared new prefix another one is computing) → **lock** the match
→ **allocate only the uncached suffix** (evicting unlocked leaves, then demoting idle
sessions, when short) — or leave it waiting.

Under the ``program`` policy where prefill is preemptible (slicing.py), a step's prompt
work is one program's: the best-ranked program's chunks in progress, or the waiting
requests of a program that outranks them (the first of the policy's order and the ones of
its program right after it), never several programs' prompts in one forward. On CPU a
forward costs about its tokens, so a second program's prompt in the step would only hold
the first's -- and every decoding program's next token with it. (The scheduler also runs a
decode step before the slice of a program that a decoding program outranks.)

Admission keeps room for the running requests' future tokens: their remaining
max_tokens times `ratio`, which decays while nothing is retracted and jumps back after a
retraction (SGLang's new_token_ratio).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from radixlm.cache import MatchResult, TreeNode
from radixlm.cache.pages import align_down
from radixlm.runtime.engine.batch import Scheduled
from radixlm.runtime.engine.cache_manager import CacheManager
from radixlm.runtime.engine.lifecycle import Endings
from radixlm.runtime.engine.options import SchedulerOptions
from radixlm.runtime.engine.policy import (
    FairShare,
    Programs,
    fair_victims,
    held_back,
    order_waiting,
)
from radixlm.runtime.engine.request import Request
from radixlm.runtime.engine.sessions.controller import SessionController
from radixlm.runtime.engine.state import ReqState
from radixlm.runtime.engine.table import Counters, RequestTable
from radixlm.runtime.protocol import ErrorCode
from radixlm.runtime.rules import RequestError


@dataclass(eq=False)
class PrefillManager:
    """This step's prompt chunks: running chunked prefills, then admissions."""

    table: RequestTable
    kv: CacheManager
    sessions: SessionController
    endings: Endings
    opt: SchedulerOptions
    counters: Counters
    ratio: float = field(init=False)  # future tokens reserved per remaining max_token
    _retractions_seen: int = field(init=False, default=0)
    _blocked: Request | None = field(init=False, default=None)  # where admission stopped
    # When admission last served each client: round-robin across clients (policy.py).
    fair: FairShare = field(init=False, default_factory=FairShare)
    # Whether a long prefill chunk runs in slices (slicing.py): with the program policy,
    # one program's prompt work a step.
    preemptible: bool = False
    # Programs' attained service (the "program" policy: policy.py).
    programs: Programs = field(init=False)

    def __post_init__(self) -> None:
        self.ratio = self.opt.init_new_token_ratio
        self.programs = Programs(self.opt.program_starve_s, quantum=self.opt.program_quantum)

    @property
    def one_program(self) -> bool:
        """Whether a step's prompt work is one program's (the module's docstring)."""
        return self.opt.policy == "program" and self.preemptible

    # ------------------------------------------------------------------- ratio
    def update_ratio(self, decay: bool = False) -> None:
        """Raise the reserve ratio for every retraction since the last call; with
        `decay`, then lower it one step (once per scheduler step)."""
        opt = self.opt
        # (fair-share retractions say nothing about the pool's room: not counted)
        while self._retractions_seen < self.counters.retractions - self.counters.preemptions:
            self._retractions_seen += 1
            self.ratio = min(1.0, max(self.ratio, opt.init_new_token_ratio) + 0.1)
        if decay:
            self.ratio = max(opt.min_new_token_ratio, self.ratio - opt.new_token_ratio_decay)

    def future_need(self, r: Request) -> int:
        """Slots `r` will still want: the rest of its prompt plus an estimate of its
        remaining output (reserve for running requests when admitting new ones)."""
        prompt_left = max(0, r.num_tokens - r.alloc_len)
        if r.is_prefill_only:
            return prompt_left
        out_left = min(r.remaining_new_tokens, self.opt.reserve_clip)
        return prompt_left + math.ceil(out_left * self.ratio)

    # -------------------------------------------------------------- scheduling
    def schedule(self, plan: list[Scheduled], touched: list[Request]) -> None:
        """Add this step's prefill chunks to `plan`; `touched`: requests whose KV this
        changed (failed with the step if it fails)."""
        budget = self.opt.chunked_prefill
        # (a chunk computing in slices is not scheduled again: slicing.py)
        chunked = [r for r in self.table.running
                   if r.state is ReqState.PREFILLING and not r.slicing]
        admit = bool(self.table.waiting) and len(self.table.running) < self.opt.max_running
        if self.one_program:
            self._one_program(plan, touched, chunked, budget, admit)
        else:
            if admit:
                # Admission goes first, with half the budget while long prompts are
                # prefilled in chunks: a new request never waits for their last chunk
                # (what it leaves unused is theirs).
                budget -= self._admit(plan, budget // 2 if chunked else budget, touched)[0]
            self._continue(plan, chunked, budget)
        if self.opt.policy == "program":
            self.programs.charge(plan)  # (this step's decodes and prefill chunks)

    def _one_program(self, plan: list[Scheduled], touched: list[Request],
                     chunked: list[Request], budget: int, admit: bool) -> None:
        """This step's prompt work, one program's: the waiting requests of a program that
        outranks every program with prompt work in progress, else the best of those."""
        progs = self.programs
        ongoing = sorted([*chunked, *(r for r in self.table.running if r.slicing)],
                         key=progs.rank)
        program = None
        if admit:
            used, program = self._admit(plan, budget, touched,
                                        progs.rank(ongoing[0]) if ongoing else None)
            budget -= used
        if program is None and ongoing and not ongoing[0].slicing:
            program = progs.of(ongoing[0])  # (a slice is its program's prompt work)
        self._continue(plan, [r for r in chunked if progs.of(r) == program], budget)

    def _continue(self, plan: list[Scheduled], chunked: list[Request], budget: int) -> None:
        """The next chunks of prompts prefilled in chunks, sharing `budget`."""
        for r, grant in zip(chunked, self._shares(chunked, budget), strict=True):
            if grant <= 0:
                continue
            ext = self.chunk(r, grant)
            if self.kv.grow(r, r.kv_len + ext):
                plan.append(Scheduled(r, ext, self.logits_from(r, ext)))

    def yields(self, sliced: Request) -> bool:
        """Whether the slice of `sliced` waits for a decode step: with one program's
        prompt work a step, while a program ranked above its own is decoding."""
        if not self.one_program:
            return False
        mine = self.programs.rank(sliced)
        return any(r.state is ReqState.DECODING and self.programs.rank(r) < mine
                   for r in self.table.running)

    @staticmethod
    def _shares(chunked: list[Request], budget: int) -> list[int]:
        """Each unfinished prompt's tokens this step: an equal share of `budget` first (a
        short one is not held behind a long one), then what is left, oldest first."""
        if not chunked or budget <= 0:
            return [0] * len(chunked)
        want = [r.num_tokens - r.kv_len for r in chunked]
        equal = max(1, budget // len(chunked))
        grants = [min(w, equal) for w in want]
        left = budget - sum(grants)
        for i, w in enumerate(want):
            if left <= 0:
                break
            extra = min(w - grants[i], left)
            grants[i] += extra
            left -= extra
        return grants

    def share_slots(self) -> None:
        """Before the step is planned: retract other clients' newest requests while a
        waiting client is below its fair share of the running slots (policy.fair_victims),
        so that admission gives it their slots this step."""
        victims = fair_victims(self.table.running, self.table.waiting, self.opt.max_running)
        for r in victims:
            if self.endings.retract(r, "for another client's fair share of running slots",
                                    logging.DEBUG):
                self.counters.preemptions += 1

    def _admit(self, plan: list[Scheduled], budget: int, touched: list[Request],
               outrank: tuple[int, int, int] | None = None) -> tuple[int, str | None]:
        """Admit waiting requests (policy order) into `budget` prompt tokens; returns how
        many of them the admitted chunks use, and with one program's prompt work a step,
        the program admitted (None: none): the first request's, if its program ranks above
        `outrank` (the best program with prompt work in progress), and the requests of its
        program right after it."""
        opt, kv, table = self.opt, self.kv, self.table
        given = budget
        one, program = self.one_program, None
        self.update_ratio()
        matches: dict[int, tuple[MatchResult, int]] = {}

        def match(r: Request) -> tuple[TreeNode, int]:
            m = kv.match(r)
            matches[id(r)] = (m, kv.epoch)
            return m.node, m.length

        order = order_waiting(opt.policy, table.waiting, match, opt.max_matched_waiting,
                              self.fair, self.programs)
        running = table.running
        inflight = [r for r in running if r.state is ReqState.PREFILLING]
        reserve = sum(self.future_need(r) for r in running)
        self._blocked = None
        for r in order:
            if budget <= 0 or len(running) >= opt.max_running:
                break
            if one:
                p = self.programs.of(r)
                if program is None and outrank is not None and \
                        not self.programs.rank(r) < outrank:
                    break
                if program not in (None, p):
                    break
            cached = matches.get(id(r))
            m = cached[0] if cached is not None and cached[1] == kv.epoch else kv.match(r)
            if held_back(r, m.length, inflight, opt.dedup_min_tokens, kv.page_size):
                continue
            touched.append(r)
            self.fair.admitted(r.group.client)
            kv.attach(r, m)
            ext = self.chunk(r, budget)
            need = kv.pages(r.kv_len + ext) - r.alloc_len
            want = need + (reserve + self.future_need(r) - need if running else 0)
            if want > kv.available() and want > kv.make_room(want):
                kv.detach(r)
                self._blocked = r
                break
            restored = self._restore(r)
            if restored:
                ext = self.chunk(r, budget)
            if not kv.grow(r, r.kv_len + ext):
                kv.detach(r)
                self._blocked = r
                break
            table.move(r, ReqState.PREFILLING)  # (now the last of `running`)
            if r.cached_tokens < 0:  # first admission: usage and hit-rate figures
                if r.group.times is not None:
                    self.counters.latency.scheduled(r.group.times)
                r.cached_tokens = m.length + restored
                if r.index == 0:
                    self.sessions.on_admit(r, m.length, restored)
                self.counters.prompt_tokens += r.group.prompt_len
                self.counters.cached_tokens += r.cached_tokens
            plan.append(Scheduled(r, ext, self.logits_from(r, ext)))
            budget -= ext
            inflight.append(r)
            reserve += self.future_need(r)
            if one:
                program = p
        return given - budget, program

    def _restore(self, r: Request) -> int:
        """Copy back session history the host tier kept (demoted sessions): those tokens
        count as computed; returns how many."""
        slots = self.sessions.restore(r, r.kv_len)
        if slots is None or not len(slots):
            return 0
        return self.kv.place_restored(r, slots)

    def chunk(self, r: Request, budget: int) -> int:
        """Tokens to compute this step; a cut chunk ends on a page boundary if it can."""
        remaining = r.num_tokens - r.kv_len
        if remaining <= budget:
            return remaining
        end = r.kv_len + budget
        aligned = align_down(end, self.kv.page_size)
        return (aligned if aligned > r.kv_len else end) - r.kv_len

    @staticmethod
    def logits_from(r: Request, ext: int) -> int:
        """The first extend offset whose logits are needed (`Request.compute_from`: owed
        prompt logprobs, or only the last one, which samples the next token)."""
        return min(max(0, r.compute_from - r.kv_len), ext - 1)

    # ------------------------------------------------------------------ stalls
    def break_stall(self) -> None:
        """Nothing could be scheduled. When that cannot change by itself, fail the
        request in the way rather than spin: a waiting request that does not fit even
        with nothing running (pins and sessions hold the pool), or a lone chunked prefill
        that cannot grow."""
        running = self.table.running
        if running:
            stuck = [r for r in running if r.state is ReqState.PREFILLING]
            if len(stuck) == len(running):
                if len(stuck) > 1:
                    self.endings.retract(stuck[-1])
                else:
                    self.endings.fail_group(stuck[0].group, RequestError(
                        ErrorCode.CAPACITY, "the KV pool is full of retained sessions/pins"))
            return
        r = self._blocked
        if r is not None and r.state is ReqState.WAITING:
            self.endings.fail_group(r.group, RequestError(
                ErrorCode.CAPACITY,
                f"the request needs {r.num_tokens} KV slots but only {self.kv.available()} "
                f"can be freed: pins and sessions hold the rest of the pool",
            ))  # fmt: skip
