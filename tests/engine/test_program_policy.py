"""The ``program`` schedule policy: Autellix's discretised program-level attained service,
its starvation bound, and one program's prompt work a step.

The rule (policy.py): priority first; then by the program's level (how many doublings of
`quantum` tokens of service it has had, capped; level 0 for a request that has waited
`starve_s`: promotion), then by the program's arrival (its first request's), then by the
request's arrival. Checked against a brute-force reference of that rule, step by step on
simulated queues (hypothesis), and on the cases it exists for: a short program passes a
long one across levels; within a level the program that came first goes first, however
much less service a later one has had.

The bound: once a request has waited `starve_s`, every admission until its own goes to a
request of a program that came no later than its own (an earlier request of the same
program, or an older program's). Checked on simulated queues (hypothesis), including an
adversary that keeps sending requests of fresh programs (level 0: under levels alone they
would overtake a served program's request forever), and in the scheduler: a session, its
forks and branches are one program, and a fresh program's request is admitted before a
served one's.

Where prefill is preemptible (slices: the CPU torch backend), a step's prompt work is one
program's, and a slice waits while a program ranked above its own decodes: checked step by
step in the scheduler, outputs against transformers' greedy tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import scheduler_harness as harness
from hypothesis import given, settings
from hypothesis import strategies as st
from radixlm.runtime.engine.batch import Scheduled
from radixlm.runtime.engine.policy import LEVELS, QUANTUM, FairShare, Programs, order_waiting
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


def simulate(arrivals: list[list[tuple[str, int]]], dt: float, starve_s: float,
             quantum: int = QUANTUM, levels: int = LEVELS, check: bool = False
             ) -> list[tuple[object, float, float]]:
    """One admission per step (the first of the policy's order), `dt` seconds a step; each
    admission charges its program its cost. With `check`, every step's whole order must be
    the reference's. Returns (request, first seen, admitted at)."""
    now = 0.0
    programs = Programs(starve_s, clock=lambda: now, quantum=quantum, levels=levels)
    waiting: list = []
    seen: dict[int, float] = {}
    service: dict[str, int] = {}
    first: dict[str, int] = {}  # program -> its first request's arrival
    admitted = []
    arrival = 0
    for step, step_arrivals in enumerate(arrivals + [[]] * 200):
        if step >= len(arrivals) and not waiting:
            break
        for program, cost in step_arrivals:
            r = request(arrival, program)
            r.cost = cost
            first.setdefault(program, arrival)
            arrival += 1
            waiting.append(r)
            seen[r.arrival] = now
        if waiting:
            order = order_waiting("program", waiting, None, fair=FairShare(), programs=programs)
            if check:
                want = reference_order(waiting, now, seen, service, first, quantum, levels,
                                       starve_s)
                assert [r.arrival for r in order] == [r.arrival for r in want]
            first_r = order[0]
            waiting.remove(first_r)
            admitted.append((first_r, seen[first_r.arrival], now))
            programs.charge([Scheduled(first_r, first_r.cost, 0)])
            p = first_r.group.program
            service[p] = service.get(p, 0) + first_r.cost
        now += dt
    return admitted


def reference_level(service: int, quantum: int, levels: int) -> int:
    """Brute force: count the thresholds quantum, 2 quantum, 4 quantum, ... passed."""
    level, threshold = 0, quantum
    while service >= threshold and level < levels - 1:
        level += 1
        threshold *= 2
    return level


def reference_order(waiting, now: float, seen: dict[int, float], service: dict[str, int],
                    first: dict[str, int], quantum: int, levels: int, starve_s: float) -> list:
    """The rule by selection: repeatedly take the request that no other one beats."""

    def beats(a, b) -> bool:  # a goes before b
        if a.group.priority != b.group.priority:
            return a.group.priority > b.group.priority
        pa, pb = a.group.program, b.group.program
        la = reference_level(service.get(pa, 0), quantum, levels)
        lb = reference_level(service.get(pb, 0), quantum, levels)
        la = 0 if now - seen[a.arrival] >= starve_s else la  # promotion
        lb = 0 if now - seen[b.arrival] >= starve_s else lb
        if la != lb:
            return la < lb
        if first[pa] != first[pb]:
            return first[pa] < first[pb]
        return a.arrival < b.arrival

    left, out = list(waiting), []
    while left:
        best = next(a for a in left if not any(beats(b, a) for b in left if b is not a))
        left.remove(best)
        out.append(best)
    return out


def check_bound(admitted, starve_s: float) -> int:
    """Every admission after a request had waited `starve_s`, before its own, went to a
    request of a program that came no later than its own (by first arrival; the same
    program: an earlier request). Returns how many requests did wait that long."""
    starved = 0
    first: dict[str, int] = {}
    for r, _, _ in sorted(admitted, key=lambda a: a[0].arrival):
        first.setdefault(r.group.program, r.arrival)
    for i, (r, seen, at) in enumerate(admitted):
        if at - seen < starve_s:
            continue
        starved += 1
        mine = (first[r.group.program], r.arrival)
        for other, _, other_at in admitted[:i]:
            if other_at - seen >= starve_s:  # (as the policy measures it)
                theirs = (first[other.group.program], other.arrival)
                assert theirs < mine, (r.arrival, other.arrival, seen, other_at)
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
    served = [[("heavy", 10 * QUANTUM)]]  # (levels above the fresh programs)
    stream = [[(f"fresh-{i}a", 1), (f"fresh-{i}b", 1)] for i in range(100)]
    stream[0].append(("heavy", 1))  # its next request, behind the stream's first
    admitted = simulate(served + stream, 0.5, STARVE)
    late = [(r, seen, at) for r, seen, at in admitted if r.group.program == "heavy"][1]
    assert late[2] - late[1] <= STARVE + 0.5 + 1e-9  # admitted at the first step past it
    assert check_bound(admitted, STARVE) >= 1
    never = simulate(served + stream, 0.5, float("inf"))  # without the rule
    late = [(r, seen, at) for r, seen, at in never if r.group.program == "heavy"][1]
    assert late[2] - late[1] > 50  # only once the stream ran dry


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from(["p0", "p1", "p2", "p3", "p4", "p5"]),
                                   st.integers(1, 300)), max_size=3), min_size=1, max_size=40),
       st.floats(0.1, 1.0), st.sampled_from([16, 64, 100]), st.integers(1, 5))
def test_the_order_is_the_rule(arrivals, dt: float, quantum: int, levels: int) -> None:
    """Every step's whole order, against the brute-force reference (small quanta: the
    programs cross several levels and reach the cap)."""
    admitted = simulate(arrivals, dt, STARVE, quantum, levels, check=True)
    assert len(admitted) == sum(len(s) for s in arrivals)


def test_levels_double_from_the_quantum_and_are_capped() -> None:
    programs = Programs(STARVE, clock=lambda: 0.0, quantum=100, levels=4)
    seen = []
    for service in (0, 99, 100, 199, 200, 399, 400, 10**9):
        r = request(service, f"p{service}")
        programs.charge([Scheduled(r, service, 0)] if service else [])
        seen.append(programs.level(f"p{service}"))
    assert seen == [0, 0, 1, 1, 2, 2, 3, 3]
    for bad in ({"quantum": 0}, {"levels": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            Programs(**bad)


def test_a_short_program_passes_a_long_one_across_levels() -> None:
    """The long program came first, but it has had a level's more service."""
    programs = Programs(STARVE, clock=lambda: 0.0, quantum=100)
    long_first = request(0, "long")
    programs.charge([Scheduled(long_first, 250, 0)])  # level 2
    short = request(1, "short")
    programs.charge([Scheduled(short, 150, 0)])  # level 1
    nxt_long, nxt_short, new = request(2, "long"), request(3, "short"), request(4, "new")
    order = order_waiting("program", [nxt_long, nxt_short, new], None, programs=programs)
    assert order == [new, nxt_short, nxt_long]


def test_first_come_first_served_by_program_within_a_level() -> None:
    """Two programs on one level: the one that came first goes first although it has had
    more service (least attained service alone would put the other first), and so does
    its every later request on that level, even one that arrives after the other's."""
    now = 0.0
    programs = Programs(STARVE, clock=lambda: now, quantum=100)
    a0, b0 = request(0, "A"), request(1, "B")
    programs.charge([Scheduled(a0, 190, 0), Scheduled(b0, 110, 0)])  # both level 1
    b1 = request(2, "B")
    a1 = request(3, "A")  # A's next request, after B's
    assert order_waiting("program", [b1, a1], None, programs=programs) == [a1, b1]
    c = request(4, "C", priority=1)
    assert order_waiting("program", [b1, a1, c], None, programs=programs) == [c, a1, b1]
    programs.charge([Scheduled(a1, 20, 0)])  # A crosses into level 2: B first now
    a2 = request(5, "A")
    assert order_waiting("program", [a2, b1], None, programs=programs) == [b1, a2]
    now = STARVE  # both have waited the bound: promoted to level 0, still A's first
    fresh = request(6, "D")
    assert order_waiting("program", [fresh, a2, b1], None, programs=programs) == [a2, b1, fresh]


def test_a_waiting_program_arrived_with_its_oldest_request() -> None:
    """Programs not served yet are ordered by their oldest waiting request."""
    programs = Programs(STARVE, clock=lambda: 0.0)
    x1, y, x0 = request(5, "X"), request(3, "Y"), request(1, "X")
    assert order_waiting("program", [x1, y, x0], None, programs=programs) == [x0, x1, y]


def test_a_session_and_its_forks_are_one_program(make_harness, hf) -> None:
    """With one running slot: the forks of a session that has been served (a level up)
    wait behind a fresh session's turn, which arrived after them; outputs stay
    transformers'."""
    rng = np.random.default_rng(5)
    h = make_harness(sessions=True, policy="program", max_running=1)
    # (a quantum below the served session's ~60 tokens: it is a level above the fresh one)
    h.sched.prefill.programs.quantum = 16
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
