"""Sessions waiting on tools, as their turns, forks, rewinds and closes change them.

A turn that ends in tool calls leaves its session waiting (`wait_on_tools`); the wait ends
when its next turn begins (`returned`: one round trip of each tool observed, a prefetch
hit or miss counted), moves to the forks of the session (`inherit`, then `stop` on the
parent), and ends with nothing observed when the history is rewound or the session closed
(`stop`). The client may say the result is near (`tool_done_soon`).

Apart from manager.py because none of it changes what a session holds: it joins the
estimates of tool_waits.py and the prefetches of prefetch.py to the sessions' records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from radixlm.runtime.engine.sessions.prefetch import Prefetcher
from radixlm.runtime.engine.sessions.records import Records, Session
from radixlm.runtime.engine.sessions.retention import tenant_of
from radixlm.runtime.engine.sessions.tool_waits import ToolWaits


class SessionWaits:
    """The tool waits of one `SessionManager`'s sessions (the manager's `waits`)."""

    def __init__(self, records: Records, tools: ToolWaits, prefetch: Prefetcher,
                 multi_tenant: bool, clock: Callable[[], float]) -> None:
        self.records = records
        self.tools = tools
        self.prefetch = prefetch
        self.multi_tenant = multi_tenant
        self.clock = clock

    def wait_on_tools(self, session_id: str, tools: Sequence[str]) -> None:
        """The turn that just ended called `tools` (none: it waits on nothing): the
        session waits for their results (tool_waits.py)."""
        s = self.records.sessions.get(session_id)
        if s is not None:
            self.tools.mark(s, tools, self.clock(), tenant_of(s.namespace, self.multi_tenant))

    def tool_done_soon(self, session_id: str, client: bytes) -> None:
        """The client says the result its session waits for is near: bring the history
        back now (at the loop's next pass: `Prefetcher.poll`). A session that waits on
        nothing, or is busy, is left as it is; another client's is NOT_FOUND."""
        s = self.records.get(session_id, client)
        if not s.busy:
            self.prefetch.hint(s)

    def returned(self, s: Session, now: float) -> None:
        """`s`'s next turn began at `now`: the result of its calls (or whatever comes
        next) ends its wait."""
        if s.tool_wait is not None:
            self.prefetch.forget(s)
            self.tools.returned(s, now, self.prefetch.on_device(s))

    @staticmethod
    def inherit(fork: Session, parent: Session) -> None:
        """`fork` of a waiting `parent` waits on the same tools (the result goes on in
        the forks; the caller then `stop`s the parent's wait)."""
        if parent.tool_wait is not None:
            fork.tool_wait = dataclasses.replace(parent.tool_wait, load=None)

    def stop(self, s: Session) -> None:
        """`s` waits on nothing any more (rewound, forked or closed): no round trip is
        observed, and a prefetch's read of it is dropped."""
        self.prefetch.forget(s)
        self.prefetch.drop(s.id)
        s.tool_wait = None

    def stats(self, tenant: str | None = None) -> dict[str, dict]:
        """The StatsReply fields about tool waits (`tenant`: its own tools only)."""
        tiers: dict[str, int] = {}
        for s in self.records.sessions.values():
            if s.tool_wait is not None and (tenant is None or s.tool_wait.tenant == tenant):
                tier = self.prefetch.tier(s)
                tiers[tier] = tiers.get(tier, 0) + 1
        return {"tool_waits": tiers, "tool_round_trip_s": self.tools.round_trips(tenant),
                "prefetch": dict(self.tools.counts)}
