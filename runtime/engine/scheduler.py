"""The scheduler: the request lifecycle over the prefix cache, one step at a time.

Each `step()`:
0. requests whose grammar finished compiling join the waiting queue (grammar_wait.py);
   a client below its fair share of running slots gets other clients' newest requests
   retracted for it (policy.fair_victims);
1. **decode** (decode.py): every running decode gets the slot of its next token (while
   several clients decode, those the step budget takes: step_budget.py), retracting the
   newest request when the pool is exhausted;
2. **prefill** (prefill.py) under the chunked-prefill token budget: unfinished chunked
   prompts, then admission of waiting requests in policy order (match, dedup, lock,
   allocate only the uncached suffix);
3. one forward over decodes and prefill chunks together (continuous batching) -- except
   a long prefill chunk, which runs in time slices, a step for the other work between
   them (slicing.py; under the program policy, the steps of decoding programs ranked
   above the slice's own all go before it: prefill.py);
4. **outputs** (outputs.py): insert what was computed, sample, emit tokens; finished
   branches end through lifecycle.py (insert prompt, then prompt + output; unlock; free
   what never joined the tree).

Inbound messages go through intake.py; sessions, pins and their retention through the
session controller's hooks; the cache through cache_manager.py (`PrefixCache` only).

Invariant (asserted after every step with `check_invariants`):
free + evictable + protected + private == capacity.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Protocol

import torch
from radixlm.cache import PrefixCache
from radixlm.runtime.engine.batch import Scheduled, build_batch
from radixlm.runtime.engine.cache_manager import CacheManager
from radixlm.runtime.engine.decode import DecodeManager
from radixlm.runtime.engine.grammar_wait import release_compiled
from radixlm.runtime.engine.intake import MessageHandler
from radixlm.runtime.engine.lifecycle import Endings
from radixlm.runtime.engine.options import SchedulerOptions
from radixlm.runtime.engine.outbox import Outbox
from radixlm.runtime.engine.outputs import OutputProcessor
from radixlm.runtime.engine.prefill import PrefillManager
from radixlm.runtime.engine.request import Request
from radixlm.runtime.engine.sampling import Sampler
from radixlm.runtime.engine.sessions import SessionManager
from radixlm.runtime.engine.sessions.calls import CallNames
from radixlm.runtime.engine.sessions.controller import Committed, SessionController
from radixlm.runtime.engine.slicing import Slicer
from radixlm.runtime.engine.state import ReqState
from radixlm.runtime.engine.stats import stats_reply
from radixlm.runtime.engine.step_budget import StepBudget
from radixlm.runtime.engine.table import Counters, RequestTable
from radixlm.runtime.engine.timings import Latencies
from radixlm.runtime.engine.wire import (
    ClientGone,
    EngineAbort,
    EngineCommand,
    EngineReady,
    FrontendHello,
    ToFrontend,
)
from radixlm.runtime.grammar.runtime import Grammars
from radixlm.runtime.model.batch import ForwardBatch
from radixlm.runtime.protocol import Error, ErrorCode, FlushCache, GetStats, Ok, Struct
from radixlm.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class ForwardModel(Protocol):
    """What the scheduler needs of `ModelRunner`."""

    device: torch.device

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


class ForwardGate(Protocol):
    """Entered around every model forward (serve_loop.StateGate: other threads may
    answer control requests meanwhile)."""

    def forward(self) -> contextlib.AbstractContextManager[None]: ...


class _NoGate:
    def forward(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


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
        sessions: SessionManager | None = None,  # None: sessions and pins refused
        clock: Callable[[], float] = time.monotonic,
        grammars: Grammars | None = None,  # None: constrained requests refused
        tokenizer: Tokenizer | None = None,  # None: stop strings refused
    ) -> None:
        self.cache = cache
        self.model = model
        self.opt = options
        self.clock = clock
        self.device = torch.device(model.device)
        self.table = RequestTable()
        self.counters = Counters(latency=Latencies(clock))
        self.outbox = Outbox()
        self.sessions = SessionController(sessions, self.outbox.reply, CallNames(tokenizer))
        self.kv = CacheManager(cache, self.sessions.make_room)
        self.endings = Endings(self.table, self.kv, self.sessions, self.outbox, self.counters)
        self.intake = MessageHandler(
            table=self.table, endings=self.endings, sessions=self.sessions, outbox=self.outbox,
            opt=options, capacity=cache.capacity, page_size=cache.page_size,
            vocab_size=sampler.vocab_size, eos_token_ids=frozenset(int(t) for t in eos_token_ids),
            device=self.device,
            engine_command=self._engine_command, grammars=grammars, tokenizer=tokenizer,
        )  # fmt: skip
        self.slicer = Slicer(model, options)
        self.prefill = PrefillManager(self.table, self.kv, self.sessions, self.endings, options,
                                      self.counters, preemptible=self.slicer.enabled)
        self.prefill.programs.clock = clock  # (a request's wait is on the scheduler's clock)
        self.budget = StepBudget(options.fair_step_factor, options.max_running)
        self.decode = DecodeManager(self.table, self.kv, self.endings, self.budget)
        self.outputs = OutputProcessor(self.table, self.kv, sampler, self.sessions, self.endings,
                                       self.outbox, self.counters, grammars)
        self.grammars = grammars
        self._last_tick = -math.inf
        self.gate: ForwardGate = _NoGate()  # the serving loop installs its StateGate
        self.ready: EngineReady | None = None  # what a (re)started frontend is told

    # ================================================================== messages
    def handle(self, msg: object) -> None:
        """One message from the frontend (Shutdown is the loop's business). Messages for
        a session whose turn is finishing its tail wait for it (sessions/controller.py, HeldMessages)."""
        if isinstance(msg, Committed):  # a durable write settled: its reply goes now
            self.sessions.answer_committed(msg)
            return
        if isinstance(msg, FrontendHello):
            self._frontend_restarted(msg)
            return
        if self.sessions.defer(msg):
            return
        self.intake.handle(msg)
        self._replay_held()

    def _frontend_restarted(self, msg: FrontendHello) -> None:
        """A frontend (re)started: every client the engine knows is gone with the old one
        (requests aborted, sessions closed, durable ones detached); it gets our
        `EngineReady` again."""
        clients = {g.client for g in self.table.groups.values()} | self.sessions.clients()
        clients.discard(b"")  # the engine's own requests (pins restored at start)
        for client in clients:
            self.intake.handle(ClientGone(client=client))
        if clients:
            log.warning("frontend %s (re)started: %d client(s) of the previous one gone",
                        msg.boot, len(clients))
        if self.ready is not None:
            self.outbox.send(self.ready)

    def can_answer_now(self, msg: object) -> bool:
        """Whether `msg` may be handled while a forward runs (called with the state gate
        held): engine commands touch sessions, pins and unlocked cache, never a running
        request; an abort only if none of its request's branches is running."""
        if isinstance(msg, EngineCommand):
            return True
        if isinstance(msg, EngineAbort):
            g = self.table.groups.get(msg.key)
            return g is not None and not any(r in self.table.running for r in g.branches)
        return False

    def _replay_held(self) -> None:
        for msg in self.sessions.take_ready():  # (what these release is replayed by `handle`)
            self.handle(msg)

    def _engine_command(self, cmd: EngineCommand) -> Struct:
        msg = cmd.msg
        if isinstance(msg, GetStats):
            return stats_reply(msg.rid, self.cache.sizes(), self.table, self.counters,
                               self.sessions, self.budget.capped_steps, cmd.tenant)  # fmt: skip
        if isinstance(msg, FlushCache):
            if cmd.tenant is None:
                log.info("cache flushed: %d tokens evicted, %s", self.flush_cache(), self.cache)
            else:
                freed = self.flush_cache(tenant_namespaces(cmd.tenant))
                log.info("cache flushed for one tenant: %d tokens evicted", freed)
            return Ok(rid=msg.rid)
        return Error(rid=msg.rid, code=ErrorCode.UNKNOWN_TYPE,
                     message=f"unknown engine command {type(msg).__name__}")

    def take_outbox(self) -> list[ToFrontend]:
        """Replies so far, then one StepOutputs with every new token since the last call."""
        return self.outbox.take()

    # ====================================================================== loop
    def has_work(self) -> bool:
        return bool(self.table.running or self.table.waiting or self.table.compiling)

    def maybe_tick(self, now: float | None = None) -> None:
        """Let the session controller demote idle sessions, at most every
        `tick_interval_s` (and bring back, at every pass, tool-paused histories whose
        clients said the result is near)."""
        now = self.clock() if now is None else now
        if now - self._last_tick >= self.opt.tick_interval_s:
            self._last_tick = now
            self.sessions.tick(now)
        self.sessions.poll(now)

    def step(self) -> bool:
        """One scheduling step and forward; returns whether a forward ran. A failure in
        the step fails that step's requests (INTERNAL) and leaves the engine serving."""
        plan: list[Scheduled] = []
        touched: list[Request] = []
        slicer = self.slicer
        try:
            release_compiled(self.table, self.endings, self.sessions.loading)
            self.prefill.share_slots()
            slicer.check()
            current = slicer.current
            if slicer.due() and current is not None and not self.prefill.yields(current.entry.req):
                self._slice(touched)
            else:
                self.decode.schedule(plan)
                self.prefill.schedule(plan, touched)
                slicer.check()
                slicer.take(plan)
                if plan:
                    slicer.slice_next = slicer.current is not None
                    self._forward(plan)
                elif slicer.current is not None:
                    self._slice(touched)
                else:
                    self.prefill.break_stall()
                    return False
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
            log.exception("scheduler step failed; failing its requests")
            self.endings.fail(set(s.req for s in plan) | set(touched), exc)
        finally:
            self.counters.steps += 1
            self.prefill.update_ratio(decay=True)
        self._replay_held()
        if self.opt.check_invariants:
            self.check_integrity()
        return True

    def _forward(self, plan: list[Scheduled]) -> None:
        """One forward over `plan`, then its outputs."""
        batch = build_batch(plan, self.device)
        decode_only = all(s.req.state is ReqState.DECODING for s in plan)
        t0 = time.perf_counter()
        with self.gate.forward():
            logits = self.model.forward(batch)
        dt = time.perf_counter() - t0
        self.counters.forward_s += dt
        if decode_only:
            self.budget.record(len(plan), dt)
        self.outputs.after_forward(plan, logits)

    def _slice(self, touched: list[Request]) -> None:
        """One slice of the long prefill chunk in progress; its outputs once complete."""
        slicer = self.slicer
        assert slicer.current is not None
        touched.append(slicer.current.entry.req)  # (failed with the step if it fails)
        t0 = time.perf_counter()
        try:
            with self.gate.forward():
                done = slicer.advance()
        except BaseException:
            slicer.current = None
            raise
        self.counters.forward_s += time.perf_counter() - t0
        if done is not None:
            entry, logits = done
            self.outputs.after_forward([entry], logits)

    # ===================================================================== state
    @property
    def running(self) -> Sequence[Request]:
        return self.table.running

    @property
    def waiting(self) -> Sequence[Request]:
        return self.table.waiting

    def private_tokens(self) -> int:
        return self.table.private_tokens()

    def check_integrity(self) -> None:
        """The pool invariant plus the cache's own structural checks (debug/tests)."""
        self.cache.check_integrity(self.private_tokens())
        for r in [*self.table.waiting, *self.table.compiling]:
            assert r.alloc_len == 0 and r.locked is None, f"waiting request holds KV: {r}"

    def flush_cache(self, namespaces: Callable[[Hashable], bool] | None = None) -> int:
        """Evict everything evictable (locked content stays), or what lies in the
        namespaces `namespaces` accepts; returns tokens freed."""
        return self.cache.flush(namespaces)


def tenant_namespaces(tenant: str) -> Callable[[Hashable], bool]:
    """The engine-side namespaces of `tenant`: its own name (no namespace) and names under
    it (``TENANT/NAMESPACE``, runtime/frontend/tenants.py)."""
    prefix = tenant + "/"
    return lambda ns: ns == tenant or (isinstance(ns, str) and ns.startswith(prefix))
