"""Replies of several replicas to one fanned-out request, merged into the one reply the
client gets: stats summed (the hit rate recomputed from the sums), session listings
joined, and the first error when any replica refused."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
from radixlm.runtime.protocol import (
    Error,
    ErrorCode,
    Histogram,
    Ok,
    ServerMessage,
    SessionInfo,
    SessionList,
    StatsReply,
)

__all__ = ["merge_replies"]

# Counts by name: summed name by name.
_MAPS = ("retained_tokens", "finish_reasons", "tool_waits", "prefetch")
_SUMMED = [f for f in StatsReply.__struct_fields__
           if f not in ("rid", "hit_rate", "invariant_ok", "latency", "tool_round_trip_s", *_MAPS)]


def _histograms(replies: Sequence[StatsReply]) -> dict[str, Histogram]:
    """Latency histograms bucket by bucket (replicas of one build share the bounds)."""
    out: dict[str, Histogram] = {}
    for r in replies:
        for name, h in r.latency.items():
            if name not in out:
                out[name] = Histogram(bounds=list(h.bounds), counts=list(h.counts),
                                      sum=h.sum, count=h.count)
            elif out[name].bounds == h.bounds:
                m = out[name]
                m.counts = [a + b for a, b in zip(m.counts, h.counts, strict=True)]
                m.sum += h.sum
                m.count += h.count
    return out


def merge_stats(rid: str, replies: Sequence[StatsReply]) -> StatsReply:
    totals = {f: sum(getattr(r, f) for r in replies) for f in _SUMMED}
    maps: dict[str, dict[str, int]] = {f: {} for f in _MAPS}
    for r in replies:
        for f, merged in maps.items():
            for k, v in getattr(r, f).items():
                merged[k] = merged.get(k, 0) + v
    prompt = totals["prompt_tokens_total"]
    trips: dict[str, float] = {}  # a tool's round trip: the longest any replica estimates
    for r in replies:
        for k, v in r.tool_round_trip_s.items():
            trips[k] = max(trips.get(k, 0.0), v)
    return StatsReply(rid=rid, latency=_histograms(replies), **maps, tool_round_trip_s=trips,
                      hit_rate=totals["cached_tokens_total"] / prompt if prompt else 0.0,
                      invariant_ok=all(r.invariant_ok for r in replies), **totals)


def merge_replies(rid: str, replies: Sequence[ServerMessage],
                  session_view: Callable[[int, SessionInfo], SessionInfo | None],
                  origins: Sequence[int]) -> ServerMessage:
    """One reply for `rid` from each replica's (`origins[i]` sent `replies[i]`);
    `session_view` puts a listed session in the client's terms (None: leave it out)."""
    errors = [r for r in replies if isinstance(r, Error)]
    if errors:
        return msgspec.structs.replace(errors[0], rid=rid)
    if not replies:
        return Error(rid=rid, code=ErrorCode.ENGINE_UNAVAILABLE, message="no replica is up")
    first = replies[0]
    if isinstance(first, StatsReply):
        return merge_stats(rid, [r for r in replies if isinstance(r, StatsReply)])
    if isinstance(first, SessionList):
        listed: list[SessionInfo] = []
        for origin, reply in zip(origins, replies, strict=True):
            if isinstance(reply, SessionList):
                listed.extend(v for s in reply.sessions
                              if (v := session_view(origin, s)) is not None)
        return SessionList(rid=rid, sessions=listed)
    return Ok(rid=rid) if isinstance(first, Ok) else msgspec.structs.replace(first, rid=rid)
