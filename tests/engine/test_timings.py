"""The engine's per-request timings (engine/timings.py) against references the tests
take themselves:

- in-process, on a clock that moves one second per scheduler step: the step at which
  each request's first and last outputs came out of the scheduler (the harness sees
  them), so every histogram's sum is known exactly;
- on a real server, every protocol: the time.monotonic() stamps a client takes around
  its requests (and at a stream's first chunk) bound the engine's figures.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import scheduler_harness as harness
from radixlm.runtime.engine.wire import EngineAbort, EngineCommand
from radixlm.runtime.protocol import GetStats, Histogram, SamplingParams, StatsReply
from scheduler_harness import random_prompt

make_harness, tiny_dir = harness.make_harness, harness.tiny_dir
one_thread, scheduler_pool_integrity = harness.one_thread, harness.scheduler_pool_integrity

NAMES = ("request_queue_time", "time_to_first_token", "e2e_request_latency",
         "request_prefill_time", "request_decode_time", "request_time_per_output_token")


class StepClock:
    """The scheduler's clock: the number of the step running (0 before the first)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _stats(h) -> StatsReply:  # noqa: ANN001
    h.send(EngineCommand(client=b"c", msg=GetStats(rid="s")))
    reply = h.replies.pop()
    assert isinstance(reply, StatsReply)
    return reply


def _run(h, clock: StepClock, keys: list[int], n: int = 1) -> tuple[dict, dict]:  # noqa: ANN001
    """Step to the end; the step of each request's first output token and of its last
    branch's last output."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    while h.sched.has_work():
        clock.t += 1
        h.step()
        for k in keys:
            if k not in first and any(h.tokens[(k, i)] for i in range(n)):
                first[k] = clock.t
            if k not in last and all((k, i) in h.final for i in range(n)):
                last[k] = clock.t
    return first, last


def _sums(s: StatsReply) -> dict[str, float]:
    return {name: s.latency[name].sum for name in NAMES}


def _check_buckets(h: Histogram) -> None:
    assert len(h.counts) == len(h.bounds) + 1 and sum(h.counts) == h.count
    assert list(h.bounds) == sorted(h.bounds)


def test_timings_are_the_steps_the_outputs_show(make_harness) -> None:  # noqa: ANN001
    """Two requests, one running slot: the second waits for the first to end."""
    clock = StepClock()
    h = make_harness(max_running=1, clock=clock)
    rng = np.random.default_rng(3)
    lengths = {}
    keys = []
    for n_out in (6, 4):
        keys.append(h.generate(random_prompt(rng, 12), max_tokens=n_out))  # queued at 0
        lengths[keys[-1]] = n_out
    first, last = _run(h, clock, keys)
    a, b = keys
    assert first[b] > last[a]  # it did wait
    s = _stats(h)
    for name in NAMES:
        _check_buckets(s.latency[name])
        assert s.latency[name].count == 2, name
    # One prefill step each: admitted at the step that sampled the first token.
    expect = {
        "request_queue_time": first[a] + first[b],
        "time_to_first_token": first[a] + first[b],
        "request_prefill_time": 0.0,
        "e2e_request_latency": last[a] + last[b],
        "request_decode_time": (last[a] - first[a]) + (last[b] - first[b]),
        "request_time_per_output_token": sum((last[k] - first[k]) / (lengths[k] - 1)
                                             for k in keys),
    }
    assert _sums(s) == pytest.approx(expect)
    # Each observation sits in the bucket whose bounds hold it.
    queue = s.latency["request_queue_time"]
    for value in (first[a], first[b]):
        i = next(i for i, bound in enumerate([*queue.bounds, float("inf")]) if value <= bound)
        assert queue.counts[i] >= 1
    assert s.finish_reasons == {"length": 2}


def test_the_frontends_arrival_starts_the_clock(make_harness) -> None:  # noqa: ANN001
    """`arrived` (the frontend's stamp) starts TTFT and e2e; queue time starts at intake;
    a stamp from the future counts as now."""
    clock = StepClock()
    clock.t = 10.0
    h = make_harness(clock=clock)
    rng = np.random.default_rng(4)
    early = h.generate(random_prompt(rng, 8), max_tokens=3, arrived=7.5)
    late = h.generate(random_prompt(rng, 8), max_tokens=3, arrived=99.0)
    first, last = _run(h, clock, [early, late])
    s = _stats(h)
    assert s.latency["time_to_first_token"].sum == pytest.approx(
        (first[early] - 7.5) + (first[late] - 10.0))
    assert s.latency["e2e_request_latency"].sum == pytest.approx(
        (last[early] - 7.5) + (last[late] - 10.0))
    assert s.latency["request_queue_time"].sum == pytest.approx(
        (first[early] - 10.0) + (first[late] - 10.0))


def test_branches_and_aborts(make_harness) -> None:  # noqa: ANN001
    """n branches are one request (one observation, ended with its last branch) and n
    finish reasons; an aborted request is timed to its abort."""
    clock = StepClock()
    h = make_harness(clock=clock)
    rng = np.random.default_rng(5)
    key = h.generate(random_prompt(rng, 10), key=50,
                     sampling=SamplingParams(max_tokens=5, temperature=1.0, seed=1,
                                             ignore_eos=True), n=3)
    first, last = _run(h, clock, [key], n=3)
    s = _stats(h)
    assert s.latency["e2e_request_latency"].count == 1
    assert s.latency["e2e_request_latency"].sum == pytest.approx(last[key])
    assert s.latency["time_to_first_token"].sum == pytest.approx(first[key])
    assert s.finish_reasons == {"length": 3}
    queued = clock.t
    gone = h.generate(random_prompt(rng, 10), max_tokens=50)
    clock.t += 1
    h.step()
    clock.t += 1
    h.step()
    h.send(EngineAbort(key=gone))
    h.run()
    s = _stats(h)
    assert s.finish_reasons == {"length": 3, "abort": 1}
    assert s.latency["e2e_request_latency"].count == 2
    assert s.latency["e2e_request_latency"].sum == pytest.approx(last[key] + (clock.t - queued))


# -- a real server: the client's own clock bounds the engine's figures --------------------


def _grown(before: StatsReply, after: StatsReply) -> dict[str, tuple[int, float]]:
    return {n: (after.latency[n].count - before.latency[n].count,
                after.latency[n].sum - before.latency[n].sum) for n in NAMES}


def _stats_of(raw) -> StatsReply:  # noqa: ANN001
    reply = raw.call(GetStats(rid=f"stats-{uuid.uuid4().hex[:6]}"))
    assert isinstance(reply, StatsReply)
    return reply


@pytest.mark.parametrize("stream", [False, True])
def test_a_served_request_is_timed_inside_its_clients_window(raw_client, pool_integrity,
                                                             stream: bool) -> None:  # noqa: ANN001
    before = _stats_of(raw_client)
    chunks: list[float] = []
    t0 = time.monotonic()
    done = raw_client.generate(f"Timed {uuid.uuid4().hex[:8]}", max_tokens=6, temperature=0,
                               ignore_eos=True, stream=stream,
                               on_chunk=lambda c: chunks.append(time.monotonic()))
    window = time.monotonic() - t0
    grown = _grown(before, _stats_of(raw_client))
    assert {n: c for n, (c, _) in grown.items()} == dict.fromkeys(NAMES, 1)
    t = {n: v for n, (_, v) in grown.items()}
    assert 0 < t["time_to_first_token"] <= t["e2e_request_latency"] <= window
    assert 0 <= t["request_queue_time"] <= t["time_to_first_token"]
    assert t["request_prefill_time"] <= t["time_to_first_token"]
    assert t["request_decode_time"] == pytest.approx(
        t["e2e_request_latency"] - t["time_to_first_token"], abs=1e-6)
    assert t["request_time_per_output_token"] == pytest.approx(
        t["request_decode_time"] / (len(done.token_ids) - 1), rel=1e-6)
    if stream:  # the first chunk came after the engine sampled its token
        assert t["time_to_first_token"] <= chunks[0] - t0
