"""Sessions waiting on tools: which tools, how long tools take, and what that says about
the order to let idle histories go and when to bring one back.

A session turn that ends in tool calls (read from its output by the one call parser:
`calls.CallNames`) leaves its session *waiting* (`ToolWait`) until its next turn begins,
which is the tool's result being appended. Each wait that ends is one observed round trip
(turn end -> next turn's start) of each tool it named, per tenant and tool name, and
`RoundTrips` keeps a running estimate of them: tool times are heavy-tailed, so it fits a
lognormal -- an exponentially weighted mean of the log durations and of their absolute
deviation (sigma = sqrt(pi/2) x that deviation; `PRIOR_SIGMA` until `MIN_SAMPLES` trips
were seen). From it, for one wait (on the slowest of its tools: calls answered together
come back together):

- `typical` = exp(mean): the median round trip;
- `late` = exp(mean + LATE_SIGMAS x sigma): past it the tool is *overdue*;
- `remaining(elapsed)`: the expected time until the result, given it has not come in
  `elapsed` (the lognormal's mean residual life). With a heavy tail it grows as the wait
  goes on: a tool that is late is likely to stay out the longest.

Which idle sessions to demote first under pressure (`demotion_key`, smallest first),
cheapest to bring back first -- the furthest next use first, so the host and disk tiers
have the most time to give it back:

1. overdue tool waits, the most overdue (elapsed / late) first;
2. idle sessions the engine expects nothing of: no tool wait (their client, or a person,
   decides when they return), or a wait on tools never seen return -- least recently used
   first, as before tool awareness;
3. tool waits whose result is expected, the longest expected `remaining` first.

A demoted wait is brought back (prefetch.py) when its median round trip is
`PREFETCH_LEAD` of itself away (`due_for_prefetch`), when its client says the result is
near (`tool_done_soon`), and at the latest when the result is appended. `counts` are what
the stats reply shows.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixlm.runtime.engine.sessions.disk_backup import DiskLoad
    from radixlm.runtime.engine.sessions.records import Session

ALPHA = 0.2  # weight of a new round trip in the running estimate
LATE_SIGMAS = 2.0  # `late` = typical x exp(this many sigmas): ~ the 98th percentile
PRIOR_SIGMA = 1.0  # the log spread assumed until MIN_SAMPLES round trips were seen
MIN_SAMPLES = 3
MAD_TO_SIGMA = math.sqrt(math.pi / 2)  # a normal's sigma / its mean absolute deviation
PREFETCH_LEAD = 0.25  # bring a demoted wait back when this share of its typical time is left
MIN_LEAD_S = 0.05  # ... and never later than this before it is expected
MAX_ESTIMATES = 4096  # (tenant, tool) estimates kept, least recently updated dropped first


@dataclass
class Estimate:
    """A running estimate of one tool's round trip (log seconds)."""

    mean: float
    deviation: float
    samples: int = 1

    @property
    def sigma(self) -> float:
        return MAD_TO_SIGMA * self.deviation if self.samples >= MIN_SAMPLES else PRIOR_SIGMA

    @property
    def typical(self) -> float:
        return math.exp(self.mean)

    @property
    def late(self) -> float:
        return math.exp(self.mean + LATE_SIGMAS * self.sigma)

    def remaining(self, elapsed: float) -> float:
        """E[T - elapsed | T > elapsed] for T lognormal(mean, sigma): the expected wait
        left (the typical time left when sigma is ~0)."""
        mu, sigma = self.mean, self.sigma
        if sigma < 1e-6:
            return max(self.typical - elapsed, 0.0)
        if elapsed <= 0:
            return math.exp(mu + sigma * sigma / 2)
        z = (math.log(elapsed) - mu) / sigma
        tail = _upper(z)  # P(T > elapsed)
        if tail < 1e-12:  # far past every trip seen: the residual of the far tail
            return elapsed * sigma / max(z, 1.0)
        return math.exp(mu + sigma * sigma / 2) * _upper(z - sigma) / tail - elapsed


def _upper(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2))


class RoundTrips:
    """Per (tenant, tool name), the running estimate of the tool's round trip."""

    def __init__(self, limit: int = MAX_ESTIMATES) -> None:
        self._by_tool: OrderedDict[tuple[str, str], Estimate] = OrderedDict()
        self._limit = limit

    def observe(self, tenant: str, tool: str, seconds: float) -> None:
        x = math.log(max(seconds, 1e-3))
        key = (tenant, tool)
        e = self._by_tool.get(key)
        if e is None:
            self._by_tool[key] = Estimate(x, 0.0)
            if len(self._by_tool) > self._limit:
                self._by_tool.popitem(last=False)
            return
        e.deviation += ALPHA * (abs(x - e.mean) - e.deviation)
        e.mean += ALPHA * (x - e.mean)
        e.samples += 1
        self._by_tool.move_to_end(key)

    def get(self, tenant: str, tool: str) -> Estimate | None:
        return self._by_tool.get((tenant, tool))

    def of_wait(self, tenant: str, tools: Sequence[str]) -> Estimate | None:
        """The estimate for a wait on all of `tools` (the slowest's); None when one of
        them was never seen return."""
        found = [self._by_tool.get((tenant, t)) for t in tools]
        if not found or any(e is None for e in found):
            return None
        return max(found, key=lambda e: e.late)  # type: ignore[return-value, arg-type]

    def items(self, tenant: str | None = None) -> list[tuple[str, Estimate]]:
        """(tool name, estimate), of one tenant's tools, or of all ("tenant/name" for a
        named tenant's)."""
        out = []
        for (who, tool), e in self._by_tool.items():
            if tenant is None:
                out.append((f"{who}/{tool}" if who else tool, e))
            elif who == tenant:
                out.append((tool, e))
        return out


@dataclass(eq=False)
class ToolWait:
    """A session's wait for the results of the calls its last turn ended in."""

    tools: tuple[str, ...]
    since: float  # when the turn ended (the engine's clock)
    tenant: str  # whose estimates it reads and feeds
    demoted: bool = False  # its history was let go during the wait
    hinted: bool = False  # its client said the result is near (tool_done_soon)
    prefetched: bool = False  # a prefetch brought (or is bringing) it back
    load: DiskLoad | None = field(default=None, repr=False)  # a prefetch's disk read


class ToolWaits:
    """What the engine knows of tools: estimates, each wait's expected return, and the
    counts of what it did about them."""

    def __init__(self, enabled: bool = True) -> None:
        # Off: sessions are still marked and estimates kept (stats), but demotion is LRU
        # and nothing is fetched before the result comes (the engine before this module).
        self.enabled = enabled
        self.trips = RoundTrips()
        self.counts = {"started": 0, "hinted": 0, "hits": 0, "misses": 0}

    # ------------------------------------------------------------------ waits
    @staticmethod
    def mark(s: Session, tools: Iterable[str], now: float, tenant: str) -> None:
        """`s`'s turn ended in calls of `tools` (none: it waits on nothing)."""
        names = tuple(dict.fromkeys(tools))
        s.tool_wait = ToolWait(names, now, tenant) if names else None

    def returned(self, s: Session, now: float, on_device: bool) -> None:
        """The result was appended (`s`'s next turn began): one round trip of each tool,
        and a prefetch hit or miss if the history had been let go (`on_device`: all of it
        is in the KV pool now)."""
        wait, s.tool_wait = s.tool_wait, None
        if wait is None:
            return
        for tool in wait.tools:
            self.trips.observe(wait.tenant, tool, now - wait.since)
        if wait.demoted:
            self.counts["hits" if on_device else "misses"] += 1

    def estimate(self, wait: ToolWait) -> Estimate | None:
        return self.trips.of_wait(wait.tenant, wait.tools)

    # ------------------------------------------------------------------ order
    def demotion_key(self, s: Session, now: float) -> tuple[int, float]:
        """Sort key of idle sessions under pressure: smallest demoted first (module doc)."""
        wait = s.tool_wait
        e = self.estimate(wait) if wait is not None and self.enabled else None
        if wait is None or e is None:
            return (1, s.last_used)
        elapsed = now - wait.since
        if elapsed > e.late:
            return (0, -elapsed / e.late)
        return (2, -e.remaining(elapsed))

    def expected_back(self, s: Session, now: float) -> bool:
        """Whether `s` waits on tools whose result is expected (not overdue)."""
        wait = s.tool_wait
        e = self.estimate(wait) if wait is not None and self.enabled else None
        return e is not None and now - wait.since <= e.late  # type: ignore[union-attr]

    def due_for_prefetch(self, s: Session, now: float) -> bool:
        """Whether a demoted wait's result is near enough to bring its history back."""
        wait = s.tool_wait
        if wait is None or not self.enabled or wait.prefetched:
            return False
        if wait.hinted:
            return True
        e = self.estimate(wait)
        if e is None:
            return False
        lead = max(PREFETCH_LEAD * e.typical, MIN_LEAD_S)
        return now >= wait.since + e.typical - lead

    def round_trips(self, tenant: str | None = None) -> dict[str, float]:
        """Each tool's typical round trip in seconds (stats), rounded to milliseconds."""
        return {name: round(e.typical, 3) for name, e in self.trips.items(tenant)}
