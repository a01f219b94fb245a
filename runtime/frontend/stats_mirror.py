"""The engine's latest `stats_reply`, kept by the frontend so that a `stats` request is
answered within `wait_s` even while the engine is inside a long step (a big prefill
chunk): the engine answers control messages only between steps. Such an answer carries
``age_s``, how old its figures are; the engine's own answer, when it comes, is dropped.
"""

from __future__ import annotations

import msgspec
from radixlm.runtime.protocol import StatsReply

__all__ = ["StatsMirror"]


class StatsMirror:
    """Times are `time.monotonic()`; requests are (client identity, rid)."""

    def __init__(self, wait_s: float = 0.05) -> None:
        self.wait_s = wait_s
        self.latest: StatsReply | None = None
        self.latest_at = 0.0
        self._deadlines: dict[tuple[bytes, str], float] = {}

    def seen(self, reply: StatsReply, now: float) -> None:
        self.latest, self.latest_at = reply, now

    def wait(self, identity: bytes, rid: str, now: float) -> None:
        self._deadlines[(identity, rid)] = now + self.wait_s

    def answered(self, identity: bytes, rid: str) -> None:
        self._deadlines.pop((identity, rid), None)

    def next_deadline(self) -> float | None:
        """When `due` may next have work (None: never before the next request or copy)."""
        if self.latest is None or not self._deadlines:
            return None
        return min(self._deadlines.values())

    def due(self, now: float) -> list[tuple[bytes, str, StatsReply]]:
        """The requests to answer from the copy now (none while there is no copy)."""
        if self.latest is None or not self._deadlines:
            return []
        late = [k for k, t in self._deadlines.items() if t <= now]
        for k in late:
            del self._deadlines[k]
        age = now - self.latest_at
        return [(identity, rid, _aged(self.latest, rid, age)) for identity, rid in late]


def _aged(reply: StatsReply, rid: str, age_s: float) -> StatsReply:
    return msgspec.structs.replace(reply, rid=rid, age_s=round(age_s, 3))
