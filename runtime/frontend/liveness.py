"""The frontend's watch on the engine process.

Any message from the engine shows it alive. When it has been quiet for `interval_s`, the
frontend sends it a probe (a `GetStats` under an identity no client has), which the
engine answers between two scheduler steps; a busy engine answers within a step, a
stopped or stuck one never. Quiet for `timeout_s`: the engine is declared unavailable
(the frontend fails every request in flight with ``engine_unavailable`` and refuses new
ones); its next message declares it back.
"""

from __future__ import annotations

import enum

# The ROUTER identity probe replies are addressed to: ZeroMQ makes client identities
# start with a zero byte and five bytes in all, so this one is never a client's.
PROBE_CLIENT = b"radixlm-probe"
PROBE_RID_PREFIX = "radixlm-internal:probe:"


class Change(enum.Enum):
    DOWN = "down"
    UP = "up"


class EngineWatch:
    """When to probe the engine, and when it is down. Times are `time.monotonic()`."""

    def __init__(self, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self.interval_s = min(1.0, timeout_s / 4)
        self.heard = now
        self.probe_sent: float | None = None
        self.down = False
        self.probes = 0

    def on_message(self, now: float) -> Change | None:
        """The engine sent something."""
        self.heard = now
        self.probe_sent = None
        if self.down:
            self.down = False
            return Change.UP
        return None

    def probe_due(self, now: float) -> str | None:
        """The rid of a probe to send now, if one is due."""
        if self.probe_sent is not None or now - self.heard < self.interval_s:
            return None
        self.probe_sent = now
        self.probes += 1
        return f"{PROBE_RID_PREFIX}{self.probes}"

    def check(self, now: float) -> Change | None:
        if not self.down and now - self.heard > self.timeout_s:
            self.down = True
            return Change.DOWN
        return None

    def silent_for(self, now: float) -> float:
        return now - self.heard
