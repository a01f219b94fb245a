"""Fair share of running slots: a client that floods the engine cannot hold every slot
while another client waits. The newest of the flood's running requests is retracted (its
KV stays as cache) and the other client's request runs at once; everything still gives
the tokens transformers gives, and the pool invariant holds after every step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import scheduler_harness as harness
from radixlm.runtime.engine.policy import fair_victims
from radixlm.runtime.engine.state import ReqState
from scheduler_harness import hf_greedy, random_prompt

hf, make_harness, tiny_dir = harness.hf, harness.make_harness, harness.tiny_dir
one_thread, scheduler_pool_integrity = harness.one_thread, harness.scheduler_pool_integrity


def fake(client: bytes, i: int) -> SimpleNamespace:
    return SimpleNamespace(group=SimpleNamespace(client=client), arrival=i)


def test_fair_victims_takes_the_newest_beyond_the_share() -> None:
    a = [fake(b"a", i) for i in range(4)]
    b = [fake(b"b", 10)]
    assert fair_victims(a, b, 4) == [a[3]]  # share 2: b gets one slot, a's newest goes
    assert fair_victims(a[:3], b, 4) == []  # a slot is free: nothing to take
    assert fair_victims(a, [fake(b"a", 9)], 4) == []  # one client only: it keeps all
    many_b = [fake(b"b", 10 + i) for i in range(5)]
    assert fair_victims(a, many_b, 4) == [a[3], a[2]]  # b up to its share of 2, no more
    c = [fake(b"c", 20)]
    mixed = a[:2] + [fake(b"b", 30), fake(b"b", 31)]
    assert fair_victims(mixed, c, 4) == [mixed[3]]  # share 1: the biggest holder gives first
    assert fair_victims([*a[:2], fake(b"b", 30)], c, 3) == [a[1]]
    assert fair_victims([], b, 4) == []
    assert fair_victims([], [fake(b"a", 1), fake(b"b", 2)], 1) == []  # nothing to take
    assert fair_victims(a[:1], b, 1) == []  # one slot: nobody is above a share of 1


def test_a_flood_gives_up_a_slot_to_another_client(make_harness, hf) -> None:
    h = make_harness(max_running=4, policy="fcfs")
    rng = np.random.default_rng(11)
    flood = [random_prompt(rng, 12) for _ in range(8)]
    keys = [h.generate(p, max_tokens=24, client=b"flood") for p in flood]
    for _ in range(3):
        h.step()
    assert len(h.sched.running) == 4 and len(h.sched.waiting) == 4
    probe = random_prompt(rng, 10)
    key = h.generate(probe, max_tokens=6, client=b"probe")
    h.step()  # the very next step: the probe runs, a flood request was retracted for it
    running = {r.group.client for r in h.sched.running}
    assert b"probe" in running and len(h.sched.running) == 4
    assert h.sched.counters.preemptions == 1
    retracted = [r for r in h.sched.waiting if r.output]  # resumes with its output kept
    assert len(retracted) == 1 and retracted[0].state is ReqState.WAITING
    steps_before = h.steps
    while (key, 0) not in h.final:
        h.step()
    assert h.steps - steps_before <= 7  # one step a token: it never waited for a slot
    h.run()
    assert h.output(key) == hf_greedy(hf, probe, 6)
    for k, p in zip(keys, flood, strict=True):  # the retracted one too: same tokens
        assert h.output(k) == hf_greedy(hf, p, 24)


def test_clients_within_their_share_are_left_alone(make_harness) -> None:
    h = make_harness(max_running=4, policy="fcfs")
    rng = np.random.default_rng(12)
    for _ in range(2):
        h.generate(random_prompt(rng, 8), max_tokens=16, client=b"a")
    for _ in range(4):
        h.generate(random_prompt(rng, 8), max_tokens=16, client=b"b")
    h.run()
    # b's extra requests waited for a's to end or for free slots; a held only its share
    assert h.sched.counters.preemptions == 0
    assert h.sched.counters.retractions == 0


def test_step_budget_caps_by_measured_step_times() -> None:
    from radixlm.runtime.engine.step_budget import StepBudget

    b = StepBudget(2.5, 64)
    assert b.cap(64) == 64  # no one-row step timed yet: nothing to hold
    b.record(1, 0.010)
    b.record(64, 0.200)  # interpolated in between: 10 ms + 3.02 ms a row
    assert b.cap(64) == 5  # 5 rows: 22.1 ms; 6: 25.1 ms > 2.5 one-row steps
    b.record(6, 0.040)  # measured slower than interpolated: the cap tightens
    assert b.cap(64) == 3  # now 10 + 6 ms a row up to 6: 3 rows 22 ms, 4 rows 28 ms
    b.record(4, 0.020)
    assert b.cap(64) == 4  # 4 rows measured 20 ms; 5 rows between 20 and 40: 30 ms
    b.record(1, 0.030)  # averages: one sample moves a quarter of the way (10 -> 15 ms)
    assert abs(b.times[1] - 0.015) < 1e-12
    assert StepBudget(0, 64).cap(64) == 64  # off


def test_step_budget_shares_rows_round_robin_across_clients() -> None:
    from radixlm.runtime.engine.step_budget import StepBudget

    def req(client: bytes, i: int, tail: bool = False) -> SimpleNamespace:
        return SimpleNamespace(group=SimpleNamespace(client=client), arrival=i,
                               pending_end=("stop", None) if tail else None)

    now = [0.0]
    b = StepBudget(2.5, 64, clock=lambda: now[0])
    b.times[1], b.times[4], b.times[5] = 0.010, 0.024, 0.030  # cap 4
    flood = [req(b"a", i) for i in range(10)]
    light = req(b"b", 100)
    rows = [*flood, light]
    seen = []
    for _ in range(5):
        chosen = b.select(rows)
        assert len(chosen) == 4 and light in chosen
        seen.extend(r for r in chosen if r is not light)
    assert {id(r) for r in seen} == {id(r) for r in flood}  # all of the flood took turns
    assert len(b.select(flood)) == 4  # b is still active for a while after its request left
    now[0] += 2.5
    assert b.select(flood) == flood  # one client: the whole batch
    tail = req(b"a", 50, tail=True)
    assert tail in b.select([*flood, tail, light])  # a finishing turn's tail row goes first


def test_capped_steps_keep_every_request_exact(make_harness, hf) -> None:
    """With the budget holding steps to 3 rows while two clients decode, the light
    client's request is in every step, the flood's take turns, and every output is still
    transformers' greedy continuation."""
    h = make_harness(max_running=8, policy="fcfs")
    budget = h.sched.budget
    budget.times[1], budget.times[3], budget.times[4] = 0.01, 0.02, 0.03  # cap 3 (limit 25 ms)
    budget.record = lambda rows, seconds: None  # keep those figures: the tiny model is fast
    rng = np.random.default_rng(13)
    flood = [random_prompt(rng, 9) for _ in range(5)]
    keys = [h.generate(p, max_tokens=10, client=b"flood") for p in flood]
    h.step()
    probe = random_prompt(rng, 7)
    key = h.generate(probe, max_tokens=6, client=b"probe")
    rows: list[int] = []
    original = h.sched.decode.schedule

    def counted(plan) -> None:
        original(plan)
        rows.append(len(plan))

    h.sched.decode.schedule = counted  # type: ignore[method-assign]
    first = h.steps
    while (key, 0) not in h.final:
        h.step()
    assert h.steps - first <= 7  # prefill + 6 tokens: a row in every step
    assert max(rows) <= 3 and budget.capped_steps > 0
    h.run()
    assert h.output(key) == hf_greedy(hf, probe, 6)
    for k, p in zip(keys, flood, strict=True):
        assert h.output(k) == hf_greedy(hf, p, 10)
