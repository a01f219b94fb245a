"""The order idle sessions are demoted in under pressure, against a brute-force reference
(hypothesis, small traces; no model: a `SessionManager` over a `PrefixCache`).

The reference knows nothing of the code's incremental state: it refits each tool's
round trips from the raw list of observed durations, computes a wait's expected remaining
time by numerical integration of the fitted lognormal's survival function, sorts the idle
soft sessions by the documented rule (overdue first, most overdue first; then those
nothing is expected of, least recently used first; then the expected ones, longest
remaining first) and counts the tokens a demotion makes evictable as the distinct
prefixes no remaining holder keeps. `make_room(n)` must demote exactly a greedy prefix of
that order: in it (ties aside), and stopping at the first that frees `n`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixlm.cache import PrefixCache
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.sessions import SessionManager
from radixlm.runtime.engine.sessions.records import Residency

C = b"client"
TOOLS = ("a", "b", "c")
ALPHA = 0.2  # the documented weight of a new round trip
TOL = 1e-3  # relative: keys closer than this are ties


# -------------------------------------------------------------------- the reference
def fit(samples: list[float]) -> tuple[float, float]:
    """(mu, sigma) of the running lognormal fit, from the raw durations."""
    mean, dev = math.log(samples[0]), 0.0
    for x in samples[1:]:
        lx = math.log(x)
        dev += ALPHA * (abs(lx - mean) - dev)
        mean += ALPHA * (lx - mean)
    sigma = math.sqrt(math.pi / 2) * dev if len(samples) >= 3 else 1.0
    return mean, sigma


def survival(mu: float, sigma: float, t: float) -> float:
    if t <= 0:
        return 1.0
    return 0.5 * math.erfc((math.log(t) - mu) / (sigma * math.sqrt(2)))


def remaining(mu: float, sigma: float, elapsed: float) -> float:
    """E[T - e | T > e] = integral of the survival function from e, over its value at e,
    by the trapezoid rule on a log grid (dense enough for the tolerance)."""
    if sigma < 1e-6:
        return max(math.exp(mu) - elapsed, 0.0)
    lo = max(elapsed, 1e-6)
    hi = math.exp(mu + 12 * sigma) + 10 * lo
    ts = np.geomspace(lo, hi, 20001)
    s = np.array([survival(mu, sigma, t) for t in ts])
    area = float(np.sum((s[1:] + s[:-1]) / 2 * np.diff(ts)))
    if elapsed <= 0:  # the part from 0 to lo (the survival is ~1 there)
        area += lo
    return area / survival(mu, sigma, elapsed)


def reference_key(waits: dict[str, tuple[tuple[str, ...], float]], last_used: dict[str, float],
                  trips: dict[str, list[float]], now: float, sid: str) -> tuple[int, float]:
    wait = waits.get(sid)
    if wait is None or any(not trips.get(t) for t in wait[0]):
        return (1, last_used[sid])
    fits = [fit(trips[t]) for t in wait[0]]
    mu, sigma = max(fits, key=lambda f: f[0] + 2 * f[1])  # the latest "late" of its tools
    elapsed = now - wait[1]
    late = math.exp(mu + 2 * sigma)
    if elapsed > late:
        return (0, -elapsed / late)
    return (2, -remaining(mu, sigma, elapsed))


def held_prefixes(paths: list[tuple[int, ...]]) -> set[tuple[int, ...]]:
    return {p[:i] for p in paths for i in range(1, len(p) + 1)}


def made_evictable(held: dict[str, tuple[int, ...]], demoted: list[str]) -> int:
    before = held_prefixes(list(held.values()))
    after = held_prefixes([p for s, p in held.items() if s not in demoted])
    return len(before) - len(after)


def close(a: tuple[int, float], b: tuple[int, float]) -> bool:
    return a[0] == b[0] and abs(a[1] - b[1]) <= TOL * max(1.0, abs(a[1]), abs(b[1]))


def before_or_tie(a: tuple[int, float], b: tuple[int, float]) -> bool:
    return a < b or close(a, b)


# ------------------------------------------------------------------------ the traces
@st.composite
def traces(draw):
    n = draw(st.integers(2, 6))
    roots = [draw(st.lists(st.integers(1, 5), min_size=0, max_size=6)) for _ in range(2)]
    sessions = []
    for _ in range(n):
        root = draw(st.sampled_from(roots))
        tail = draw(st.lists(st.integers(1, 9), min_size=1, max_size=10))
        waiting = draw(st.one_of(st.none(), st.lists(st.sampled_from(TOOLS), min_size=1,
                                                     max_size=2, unique=True)))
        sessions.append(dict(tokens=[*root, *tail], soft=draw(st.booleans()) or n < 3,
                             idle=draw(st.floats(0.0, 20.0)), waiting=waiting,
                             elapsed=draw(st.floats(0.0, 60.0))))
    trips = {t: draw(st.lists(st.floats(0.05, 30.0), max_size=5)) for t in TOOLS}
    demand = draw(st.integers(1, 40))
    return sessions, trips, demand


def build(trace, clock: Callable[[], float]) -> tuple[SessionManager, PrefixCache, list[str]]:
    sessions, trips, _ = trace
    cache = PrefixCache(1024, 1, policy="priority", clock=clock)
    m = SessionManager(cache, EngineConfig(retained_cap=1024), clock=clock)
    for tool, xs in trips.items():
        for x in xs:
            m.tools.trips.observe("", tool, x)
    ids = []
    for spec in sessions:
        s = m.open(C, retention="soft" if spec["soft"] else "hard")
        prompt = m.begin_turn(s.id, C, spec["tokens"])
        hit = cache.match(prompt)
        slots = np.concatenate([hit.slots, cache.alloc(len(prompt) - hit.length)])
        cache.insert(prompt, slots)
        m.end_turn(s.id, prompt)
        ids.append(s.id)
    return m, cache, ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.booleans())
def test_make_room_demotes_a_greedy_prefix_of_the_reference_order(trace, aware: bool) -> None:
    sessions, trips, demand = trace
    now = 1000.0
    m, cache, ids = build(trace, lambda: now)
    m.tools.enabled = aware
    waits: dict[str, tuple[tuple[str, ...], float]] = {}
    last_used: dict[str, float] = {}
    for sid, spec in zip(ids, sessions, strict=True):
        s = m.records.sessions[sid]
        s.last_used = last_used[sid] = now - spec["idle"]
        if spec["waiting"]:
            m.tools.mark(s, spec["waiting"], now - spec["elapsed"], "")
            waits[sid] = (tuple(dict.fromkeys(spec["waiting"])), now - spec["elapsed"])
    held = {sid: tuple(spec["tokens"]) for sid, spec in zip(ids, sessions, strict=True)}
    soft = [sid for sid, spec in zip(ids, sessions, strict=True) if spec["soft"]]

    def key(sid: str) -> tuple[int, float]:
        if not aware:
            return (1, last_used[sid])
        return reference_key(waits, last_used, trips, now, sid)

    order: list[str] = []
    demote = m.retention.demote
    m.retention.demote = lambda s, reason: (order.append(s.id), demote(s, reason))[1]
    before = cache.evictable_size
    made = m.make_room(demand)
    cache.check_integrity()

    # Only soft sessions, each once, in the reference order (ties aside).
    assert set(order) <= set(soft) and len(set(order)) == len(order)
    for a, b in itertools.pairwise(order):
        assert before_or_tie(key(a), key(b)), (a, b, key(a), key(b))
    # Greedy: every soft session it left held goes after the last one it demoted.
    if order:
        for sid in set(soft) - set(order):
            assert before_or_tie(key(order[-1]), key(sid))
    # It stopped at the first that freed `demand` (or ran out), counted as the reference
    # counts the distinct tokens no remaining holder keeps.
    assert made == cache.evictable_size - before == made_evictable(held, order)
    assert made >= demand or set(order) == set(soft)
    if order:
        assert made_evictable(held, order[:-1]) < demand
    for sid in ids:
        demoted = m.records.sessions[sid].residency is Residency.DEMOTED
        assert demoted == (sid in order)


def test_the_estimate_against_its_definition() -> None:
    """`Estimate.remaining` (closed form) against the reference's numerical integral."""
    m = SessionManager(PrefixCache(64, 1, policy="priority"), EngineConfig())
    samples = [0.5, 2.0, 1.0, 7.0, 1.5]
    for x in samples:
        m.tools.trips.observe("", "t", x)
    e = m.tools.trips.get("", "t")
    assert e is not None
    mu, sigma = fit(samples)
    assert math.isclose(e.mean, mu, rel_tol=1e-9) and math.isclose(e.sigma, sigma, rel_tol=1e-9)
    for elapsed in (0.0, 0.3, 1.0, 3.0, 10.0, 40.0):
        assert math.isclose(e.remaining(elapsed), remaining(mu, sigma, elapsed), rel_tol=2e-3)
    # A heavy tail: the longer a tool has been out, the longer it is expected to stay out.
    assert e.remaining(10.0) > e.remaining(1.0)
