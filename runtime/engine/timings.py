"""Per-request timings, measured in the engine for every generation (every protocol,
streamed or not), kept as histograms for stats and /metrics.

The moments of a request (a group: all its branches), as vLLM names them:

- *arrived*: the frontend received it (`EngineGenerate.arrived`, before tokenization;
  the engine's own receipt when the message has none);
- *queued*: the engine took it in; *scheduled*: a branch was first admitted (a
  retracted branch's second admission does not move it);
- *first token*: the first output token was sampled; *finished*: the last output of
  its last branch went out (a session turn's Done goes before its tail row runs).

From them: queue time (queued → scheduled), time to first token (arrived → first
token), end-to-end latency (arrived → finished), prefill time (scheduled → first
token), decode time (first token → finished) and time per output token (decode time
over the output tokens after the first, of the longest branch). A request that fails
with an error is not observed past the moments it reached. All times are
`time.monotonic()` seconds: one system-wide clock, so the frontend's stamp compares with
the engine's.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from radixlm.runtime.protocol import Histogram

__all__ = ["GroupTimes", "Latencies", "LatencyHistogram"]

# vLLM's buckets for each figure (so dashboards made for it read these the same way).
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class LatencyHistogram:
    """Counts of observations per bucket (`bounds` are the upper bounds, inclusive)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def wire(self) -> Histogram:
        return Histogram(bounds=list(self.bounds), counts=list(self.counts), sum=self.total,
                         count=sum(self.counts))


@dataclass(slots=True)
class GroupTimes:
    """The moments one request has reached (None: not yet), and its branches' ends."""

    arrived: float
    queued: float
    scheduled: float | None = None
    first_token: float | None = None
    ended: int = 0  # branches whose last output went out
    longest: int = 0  # output tokens of the longest of those


class Latencies:
    """The engine's latency histograms, and its Generate branches by finish reason.
    `clock` is the scheduler's (tests drive it by hand)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.histograms = {
            "request_queue_time": LatencyHistogram(_REQUEST_BUCKETS),
            "time_to_first_token": LatencyHistogram(_TTFT_BUCKETS),
            "e2e_request_latency": LatencyHistogram(_REQUEST_BUCKETS),
            "request_prefill_time": LatencyHistogram(_REQUEST_BUCKETS),
            "request_decode_time": LatencyHistogram(_REQUEST_BUCKETS),
            "request_time_per_output_token": LatencyHistogram(_TPOT_BUCKETS),
        }
        self.finish_reasons: Counter[str] = Counter()

    def start(self, arrived: float | None) -> GroupTimes:
        """A request taken in now; `arrived`: when the frontend received it (never later
        than now)."""
        now = self.clock()
        return GroupTimes(arrived=now if arrived is None else min(arrived, now), queued=now)

    def scheduled(self, t: GroupTimes) -> None:
        if t.scheduled is None:
            t.scheduled = now = self.clock()
            self.histograms["request_queue_time"].observe(now - t.queued)

    def first_token(self, t: GroupTimes) -> None:
        if t.first_token is None:
            t.first_token = now = self.clock()
            self.histograms["time_to_first_token"].observe(now - t.arrived)
            if t.scheduled is not None:
                self.histograms["request_prefill_time"].observe(now - t.scheduled)

    def branch_ended(self, t: GroupTimes, n: int, reason: str, output_tokens: int) -> None:
        """A branch's last output goes out (not an error); the request ends with its
        `n`-th."""
        self.finish_reasons[reason] += 1
        t.ended += 1
        t.longest = max(t.longest, output_tokens)
        if t.ended < n:
            return
        now = self.clock()
        h = self.histograms
        h["e2e_request_latency"].observe(now - t.arrived)
        if t.first_token is not None:
            decode = now - t.first_token
            h["request_decode_time"].observe(decode)
            if t.longest > 1:
                h["request_time_per_output_token"].observe(decode / (t.longest - 1))

    def wire(self) -> dict[str, Histogram]:
        return {name: h.wire() for name, h in self.histograms.items()}
