"""The ``program`` schedule policy: programs by least attained service, and its bound.

The bound (policy.py): a request that has waited `starve_s` goes before every request
that has not, oldest first -- so once it has waited `starve_s`, every admission until its
own goes to a request that arrived before it. Checked on simulated queues (hypothesis),
including an adversary that keeps sending requests of fresh programs (no service: under
least attained service alone they would overtake a served program's request forever),
and in the scheduler: a session, its forks and branches are one program, and a fresh
program's request is admitted before a served one's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import scheduler_harness as harness
from hypothesis import given, settings
from hypothesis import strategies as st
from radixlm.runtime.engine.batch import Scheduled
from radixlm.runtime.engine.policy import FairShare, Programs, order_waiting
from radixlm.runtime.engine.wire import EngineCommand
from radixlm.runtime.protocol import ForkSession, SessionsForked
from scheduler_harness import hf_greedy, random_prompt

from tests.engine.test_sessions_in_scheduler import C, open_session

hf, make_harness, tiny_dir = harness.hf, harness.make_harness, harness.tiny_dir
one_thread, scheduler_pool_integrity = harness.one_thread, harness.scheduler_pool_integrity

STARVE = 3.0


def request(arrival: int, program: str, client: bytes = b"c", priority: int = 0):
    group = SimpleNamespace(program=program, key=arrival, priority=priority, client=client)
    return SimpleNamespace(group=group, arrival=arrival)


def simulate(arrivals: list[list[tuple[str, int]]], dt: float, starve_s: float
             ) -> list[tuple[object, float, float]]:
    """One admission per step (the first of the policy's order), `dt` seconds a step; each
    admission charges its program its cost. Returns (request, first seen, admitted at)."""
    now = 0.0
    programs = Programs(starve_s, clock=lambda: now)
    waiting: list = []
    seen: dict[int, float] = {}
    admitted = []
    arrival = 0
    for step, step_arrivals in enumerate(arrivals + [[]] * 200):
        if step >= len(arrivals) and not waiting:
            break
        for program, cost in step_arrivals:
            r = request(arrival, program)
            r.cost = cost
            arrival += 1
            waiting.append(r)
            seen[r.arrival] = now
        if waiting:
            first = order_waiting("program", waiting, None, fair=FairShare(), programs=programs)[0]
            waiting.remove(first)
            admitted.append((first, seen[first.arrival], now))
            programs.charge([Scheduled(first, first.cost, 0)])
        now += dt
    return admitted


def check_bound(admitted, starve_s: float) -> int:
    """Every admission after a request had waited `starve_s`, before its own, went to an
    earlier arrival. Returns how many requests did wait that long."""
    starved = 0
    for i, (r, seen, at) in enumerate(admitted):
        if at - seen < starve_s:
            continue
        starved += 1
        for other, _, other_at in admitted[:i]:
            if other_at - seen >= starve_s:  # (as the policy measures it)
                assert other.arrival < r.arrival, (r.arrival, other.arrival, seen, other_at)
    return starved


programs_st = st.sampled_from(["heavy", "p1", "p2", "p3"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.one_of(programs_st, st.just("fresh")),
                                   st.integers(1, 500)), max_size=3), min_size=1, max_size=60),
       st.floats(0.1, 1.0))
def test_no_request_waits_past_the_bound(arrivals, dt: float) -> None:
    # "fresh": a program never seen before (no service): the adversary's requests.
    counter = iter(range(10**9))
    arrivals = [[(f"fresh-{next(counter)}" if p == "fresh" else p, c) for p, c in step]
                for step in arrivals]
    admitted = simulate(arrivals, dt, STARVE)
    assert len(admitted) == sum(len(s) for s in arrivals)
    check_bound(admitted, STARVE)


def test_an_adversary_of_fresh_programs_cannot_starve_a_served_one() -> None:
    """Two fresh programs' requests arrive every step (one is admitted a step): under
    least attained service alone the served program's request would never be admitted."""
    served = [[("heavy", 10_000)]]
    stream = [[(f"fresh-{i}a", 1), (f"fresh-{i}b", 1)] for i in range(100)]
    stream[0].append(("heavy", 1))  # its next request, behind the stream's first
    admitted = simulate(served + stream, 0.5, STARVE)
    late = [(r, seen, at) for r, seen, at in admitted if r.group.program == "heavy"][1]
    assert late[2] - late[1] <= STARVE + 0.5 + 1e-9  # admitted at the first step past it
    assert check_bound(admitted, STARVE) >= 1
    never = simulate(served + stream, 0.5, float("inf"))  # without the rule
    late = [(r, seen, at) for r, seen, at in never if r.group.program == "heavy"][1]
    assert late[2] - late[1] > 50  # only once the stream ran dry


def test_least_attained_service_first_then_arrival() -> None:
    now = 0.0
    programs = Programs(STARVE, clock=lambda: now)
    a, b, c = request(0, "A"), request(1, "B"), request(2, "C", priority=1)
    programs.charge([Scheduled(a, 100, 0), Scheduled(b, 10, 0)])
    assert order_waiting("program", [a, b], None, programs=programs) == [b, a]
    assert order_waiting("program", [a, b, c], None, programs=programs) == [c, b, a]
    fresh = request(3, "D")
    assert order_waiting("program", [a, b, fresh], None, programs=programs) == [fresh, b, a]
    now = STARVE  # all of them have waited the bound: first come, first served
    assert order_waiting("program", [b, fresh, a], None, programs=programs) == [a, b, fresh]


def test_a_session_and_its_forks_are_one_program(make_harness, hf) -> None:
    """With one running slot: the forks of a session that has been served wait behind a
    fresh session's turn, which arrived after them; outputs stay transformers'."""
    rng = np.random.default_rng(5)
    h = make_harness(sessions=True, policy="program", max_running=1)
    served = open_session(h, random_prompt(rng, 40)).session
    key = h.generate(random_prompt(rng, 8), max_tokens=12, client=C, session=served)
    h.run()
    h.send(EngineCommand(client=C, msg=ForkSession(rid="f", session=served, n=2)))
    forked = h.replies.pop()
    assert isinstance(forked, SessionsForked)
    fresh = open_session(h, random_prompt(rng, 4)).session
    programs = h.sched.prefill.programs
    s = h.sched.sessions.manager.records.sessions
    assert s[forked.sessions[0]].program == s[forked.sessions[1]].program == s[served].program
    assert s[fresh].program != s[served].program
    assert programs.attained(s[served].program) > programs.attained(s[fresh].program)

    blocker = h.generate(random_prompt(rng, 6), max_tokens=4, client=C)  # holds the slot
    h.step()
    history = {sid: s[sid].history.tolist() for sid in (*forked.sessions, fresh)}
    appended = {sid: random_prompt(rng, 5) for sid in history}
    keys = {sid: h.generate(appended[sid], max_tokens=3, client=C, session=sid)
            for sid in history}  # the forks first, then the fresh session
    order = []
    while len(order) < 3:
        h.step()
        for r in h.sched.running:
            if r.group.key in keys.values() and r.group.key not in order:
                order.append(r.group.key)
    assert order[0] == keys[fresh]
    h.run()
    for sid, k in keys.items():
        assert h.output(k) == hf_greedy(hf, history[sid] + appended[sid], 3)
    assert h.output(blocker) and h.output(key)
