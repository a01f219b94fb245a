"""The engine's periodic throughput line divides by the time the engine spent in
scheduler steps, not by the wall time since the last line: after ten idle minutes and
two busy seconds that made 100 tokens, it says 50 tok/s (not 0.2)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from radixlm.runtime.engine import engine_main


def test_the_throughput_line_is_over_busy_time(caplog: pytest.LogCaptureFixture) -> None:
    counters = SimpleNamespace(generated_tokens=0, computed_tokens=0, prompt_tokens=0,
                               cached_tokens=0, retractions=0)
    sizes = SimpleNamespace(free=10, evictable=0, protected=0)
    sched = SimpleNamespace(counters=counters, running=[], waiting=[], has_work=lambda: False,
                            cache=SimpleNamespace(sizes=lambda: sizes), private_tokens=lambda: 0)
    loop = SimpleNamespace(busy_s=0.0)
    line = engine_main._ThroughputLog(sched, loop)  # type: ignore[arg-type]
    line.t -= 600.0  # ten minutes ago
    loop.busy_s += 2.0  # of which two seconds in steps ...
    counters.generated_tokens, counters.computed_tokens = 100, 400  # ... that made these
    with caplog.at_level(logging.INFO, logger="radixlm.engine"):
        line.maybe_log()
    assert "busy 2.0 of 600 s: decode 50.0 tok/s, prefill 200.0 tok/s" in caplog.text, caplog.text


def test_the_loop_counts_the_time_its_steps_take() -> None:
    from radixlm.runtime.engine.serve_loop import EngineLoop

    class Sched:
        gate = None
        steps = 0

        def has_work(self) -> bool:
            return self.steps < 3

        def step(self) -> bool:
            self.steps += 1
            time.sleep(0.05)
            return True

        def maybe_tick(self) -> None:
            pass

        def take_outbox(self) -> list[object]:
            return []

    import zmq

    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    sched = Sched()
    loop = EngineLoop(sched, inbox, outbox, SimpleNamespace(set=False))  # type: ignore[arg-type]

    def stop_when_done() -> None:
        if sched.steps >= 3:
            loop.stop.set = True

    loop.on_step = stop_when_done
    try:
        loop.run()
    finally:
        inbox.close(0)
        outbox.close(0)
        ctx.term()
    assert loop.busy_s >= 3 * 0.05  # every step's time, and only the steps that ran
