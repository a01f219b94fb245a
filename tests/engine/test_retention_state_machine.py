"""Retention accounting as a state machine over a tiny pool: open (with input, run at
once or left pending as a pipelined open), turn, fork, close, pin, flush. After every
step, besides the session manager's own checks (FakeEngine.check: pool integrity, every
held path cached, retained tokens equal to a brute-force count of distinct held pages,
at most the cap): what is held plus what pending opens reserved stays within the cap
(brute force), and `list` shows each session's true class ("demoted" exactly when it
holds none of a non-empty cached history)."""

from __future__ import annotations

import contextlib
import os
import random

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from radixlm.cache import OutOfSlots
from radixlm.runtime.engine.sessions import Residency
from radixlm.runtime.rules import RequestError

from tests.engine.test_session_manager import ALICE, FakeEngine

CAP, POOL, PAGE = 24, 64, 2


def distinct_pages(paths: list[tuple[object, np.ndarray]]) -> int:
    seen = {(ns, tuple(p[:end].tolist())) for ns, p in paths for end in range(PAGE, len(p) + 1, PAGE)}
    return len(seen) * PAGE


class Retention(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.e = FakeEngine(POOL, page_size=PAGE, retained_cap=CAP)
        self.pending: dict[str, np.ndarray] = {}  # opened with input, turn not run yet
        self.pins = 0

    def idle(self) -> list[str]:
        """Sessions with no pending open, in creation order (ids are random: never sort
        by them, or replays would draw differently)."""
        return [s.id for s in self.e.sm.sessions() if s.id not in self.pending]

    def pick(self, data: st.DataObject, ids: list[str]) -> str:
        return ids[data.draw(st.integers(0, len(ids) - 1))]

    @rule(n=st.integers(1, 10), seed=st.integers(0, 3), soft=st.booleans(), now=st.booleans())
    def open(self, n: int, seed: int, soft: bool, now: bool) -> None:
        tokens = np.asarray(random.Random(seed).choices(range(3, 9), k=n), dtype=np.int64)
        try:
            s = self.e.sm.open(ALICE, None, "soft" if soft else "hard", None, None, tokens)
        except RequestError:
            return  # capacity: the cap refused it up front
        self.pending[s.id] = tokens
        if now:
            self.finish(s.id)

    def finish(self, sid: str) -> None:
        tokens = self.pending.pop(sid)
        try:
            self.e.turn(sid, tokens)
        except OutOfSlots:
            self.e.sm.abort_turn(sid)
            self.e.sm.close(sid, ALICE)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def finish_pending(self, data: st.DataObject) -> None:
        self.finish(self.pick(data, list(self.pending)))

    @precondition(lambda self: self.idle())
    @rule(data=st.data(), n=st.integers(1, 8), seed=st.integers(0, 3))
    def turn(self, data: st.DataObject, n: int, seed: int) -> None:
        sid = self.pick(data, self.idle())
        tokens = random.Random(seed).choices(range(3, 9), k=n)
        try:
            self.e.turn(sid, tokens, output=[7])
        except OutOfSlots:
            self.e.sm.abort_turn(sid)

    @precondition(lambda self: self.idle())
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork(self, data: st.DataObject, n: int) -> None:
        with contextlib.suppress(RequestError):
            self.e.sm.fork(self.pick(data, self.idle()), ALICE, n)

    @precondition(lambda self: self.e.sm.num_sessions)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        sid = self.pick(data, [s.id for s in self.e.sm.sessions()])
        self.pending.pop(sid, None)
        self.e.sm.close(sid, ALICE)

    @rule(n=st.integers(2, 8), seed=st.integers(0, 3))
    def pin(self, n: int, seed: int) -> None:
        tokens = np.asarray(random.Random(seed).choices(range(3, 9), k=n), dtype=np.int64)
        self.pins += 1
        with contextlib.suppress(RequestError, OutOfSlots):
            self.e.pin(f"p{self.pins}", tokens)

    @rule()
    def flush(self) -> None:
        self.e.cache.flush()

    @invariant()
    def accounting(self) -> None:
        self.e.check()
        sm = self.e.sm
        held = [(p.namespace, p.ids[: p.held_len]) for p in sm.pins()]
        held += [(s.namespace, s.history[: s.held_len]) for s in sm.sessions()
                 if s.residency is Residency.HELD]
        reserved = [(s.reserved.namespace, s.reserved.tokens) for s in sm.sessions()
                    if s.reserved is not None]
        assert distinct_pages(held + reserved) <= CAP
        by_id = {s.id: s for s in sm.sessions()}
        for info in sm.list(ALICE):
            s = by_id[info.session]
            if info.retention == "demoted":  # it holds nothing
                assert s.residency is not Residency.HELD or s.held_len == 0, (info, s)
            else:  # "hard"/"soft": it holds its cached history (or has none)
                assert s.residency is Residency.HELD and (s.held_len or not s.kv_len), (info, s)


Retention.TestCase.settings = settings(max_examples=int(os.environ.get("RADIXLM_MACHINE_EXAMPLES", "60")), stateful_step_count=25, deadline=None,
                                       database=None)
TestRetention = Retention.TestCase
