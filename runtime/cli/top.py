"""``radixlm top``: a live view of a running server.

Every ``--interval`` seconds it asks the server for its stats and its session listing
(the operator's view: every client's sessions, others' ids shortened) and redraws, in
place on a terminal (the alternate screen, as top does): requests running and waiting,
sessions and pins, decode and prefill tokens/s and the cache hit rate over the last
interval, the KV pool by state, retained tokens by class, sessions waiting on tools (by
where their history is, the engine's estimate of each tool's round trip, prefetch hits
and misses), and the sessions. ``--once`` prints one snapshot (rates over one interval)
for scripts and tests.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from radixlm.runtime.protocol import ListSessions, SessionInfo, SessionList, StatsReply, Welcome
from radixlm.runtime.transport.raw_client import RawClient

__all__ = ["Sample", "render", "run_top", "sample", "session_table"]

BAR_WIDTH = 40
MAX_SESSION_ROWS = 20
_ENTER, _LEAVE, _HOME_CLEAR = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l", "\x1b[H\x1b[2J"


@dataclass(frozen=True)
class Sample:
    """What the server said at one moment."""

    at: float  # time.monotonic()
    stats: StatsReply
    sessions: list[SessionInfo]


def sample(client: RawClient) -> Sample:
    stats = client.stats()
    listing = client.call(ListSessions(rid=client.new_rid("ls"), all=True), SessionList)
    return Sample(time.monotonic(), stats, listing.sessions)


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _pool_bar(s: StatsReply) -> str:
    """The pool by state: '#' protected, '+' private (running requests), '=' evictable
    cache, '.' free."""
    cells = []
    for count, mark in ((s.protected, "#"), (s.private, "+"), (s.evictable, "=")):
        cells.append(mark * round(BAR_WIDTH * count / s.capacity) if s.capacity else "")
    used = "".join(cells)[:BAR_WIDTH]
    return "[" + used + "." * (BAR_WIDTH - len(used)) + "]"


def render(welcome: Welcome, endpoint: str, now: Sample, before: Sample | None) -> list[str]:
    """The lines of one view; rates need the sample `before` (None: no rates yet)."""
    s = now.stats
    lines = [f"radixlm {welcome.server_version}  {welcome.model}  at {endpoint}  "
             f"(context {welcome.context_length}, page {welcome.page_size})",
             f"requests   running {s.running}  waiting {s.waiting}  |  sessions {s.sessions}  "
             f"pins {s.pins}  |  retractions {s.retractions}"]
    if before is not None and now.at > before.at:
        b, dt = before.stats, now.at - before.at
        gen = s.generated_tokens_total - b.generated_tokens_total
        prompt = s.prompt_tokens_total - b.prompt_tokens_total
        cached = s.cached_tokens_total - b.cached_tokens_total
        lines.append(f"throughput decode {gen / dt:.1f} tok/s  prefill {(prompt - cached) / dt:.1f}"
                     f" tok/s  |  cache hit {_pct(cached, prompt)} of {prompt} prompt tokens  "
                     f"(last {dt:.1f} s)")
    lines.append(f"cache      hit rate {_pct(s.cached_tokens_total, s.prompt_tokens_total)} "
                 f"({s.cached_tokens_total}/{s.prompt_tokens_total} prompt tokens since start)"
                 f"  |  generated {s.generated_tokens_total} tokens")
    lines.append(f"KV pool    {_pool_bar(s)} {s.capacity} tokens")
    lines.append(f"           protected(#) {s.protected}  private(+) {s.private}  "
                 f"evictable(=) {s.evictable}  free(.) {s.free} ({_pct(s.free, s.capacity)})"
                 + ("" if s.invariant_ok else "  POOL INVARIANT BROKEN"))
    retained = "  ".join(f"{k} {v}" for k, v in sorted(s.retained_tokens.items())) or "none"
    host = f"  |  host tier {s.host_used}/{s.host_capacity}" if s.host_capacity else ""
    lines.append(f"retained   {retained}  (cap {s.retained_cap}){host}")
    lines += tool_lines(s)
    lines.append("")
    busy_first = sorted(now.sessions, key=lambda x: (not x.busy, x.idle_s))
    lines += session_table(busy_first, MAX_SESSION_ROWS)
    return lines


MAX_TOOLS_SHOWN = 6


def tool_lines(s: StatsReply) -> list[str]:
    """Sessions waiting on tools by tier, prefetches, and the tools' round trips (none
    when no session ever waited on one)."""
    if not (s.tool_waits or s.tool_round_trip_s or s.prefetch):
        return []
    waits = sum(s.tool_waits.values())
    tiers = "  ".join(f"{k} {v}" for k, v in sorted(s.tool_waits.items()))
    p = s.prefetch
    hits, misses = p.get("hits", 0), p.get("misses", 0)
    out = [f"tool waits {waits}" + (f" ({tiers})" if tiers else "")
           + f"  |  prefetch hits {hits} misses {misses} ({_pct(hits, hits + misses)})  "
           f"started {p.get('started', 0)}  hinted {p.get('hinted', 0)}"]
    trips = sorted(s.tool_round_trip_s.items())
    if trips:
        shown = "  ".join(f"{name} {t:.2f}s" for name, t in trips[:MAX_TOOLS_SHOWN])
        more = f"  (+{len(trips) - MAX_TOOLS_SHOWN} more)" if len(trips) > MAX_TOOLS_SHOWN else ""
        out.append(f"tool trips {shown}{more}")
    return out


def session_table(sessions: Sequence[SessionInfo], limit: int | None = None) -> list[str]:
    """Sessions as aligned rows under a header (`radixlm sessions` prints the same); a
    session waiting on tools names them and where its history is (TOOLS: name@tier)."""
    rows = [("SESSION", "LENGTH", "IDLE", "RETENTION", "BUSY", "NAMESPACE", "TOOLS")]
    for x in sessions[:limit]:
        tools = f"{','.join(x.tools)}@{x.tier or '-'}" if x.tools else "-"
        rows.append((x.session[:12], str(x.length), f"{x.idle_s:.1f}s", x.retention,
                     "yes" if x.busy else "no", x.namespace or "-", tools))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if not sessions:
        out.append("(no sessions)")
    elif limit is not None and len(sessions) > limit:
        out.append(f"... and {len(sessions) - limit} more")
    return out


def run_top(endpoint: str, *, options: dict[int, Any] | None = None, timeout_s: float = 10.0,
            interval_s: float = 1.0, once: bool = False, out: TextIO | None = None) -> int:
    """Show the server at `endpoint` until Ctrl-C (or one snapshot with `once`)."""
    out = out if out is not None else sys.stdout
    with RawClient(endpoint, name="radixlm-top", timeout_s=timeout_s, options=options) as client:
        assert client.welcome is not None
        welcome = client.welcome
        before = sample(client)
        if once:
            time.sleep(interval_s)
            out.write("\n".join(render(welcome, endpoint, sample(client), before)) + "\n")
            return 0
        live = out.isatty()
        if live:
            out.write(_ENTER)
        try:
            while True:
                time.sleep(interval_s)
                now = sample(client)
                text = "\n".join(render(welcome, endpoint, now, before))
                out.write((_HOME_CLEAR + text) if live else text + "\n\n")
                out.flush()
                before = now
        except KeyboardInterrupt:
            return 0
        finally:
            if live:
                out.write(_LEAVE)
                out.flush()
