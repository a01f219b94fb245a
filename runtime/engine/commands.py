"""Requests the engine answers directly, without running the model: session commands,
stats and cache flushes (`EngineCommand`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixlm.runtime.engine.errors import RequestError
from radixlm.runtime.engine.messages import EngineCommand
from radixlm.runtime.protocol import (
    CloseSession,
    Error,
    ErrorCode,
    FlushCache,
    ForkSession,
    GetStats,
    ListSessions,
    Ok,
    SessionList,
    SessionsForked,
    StatsReply,
    Struct,
    TruncateSession,
    Unpin,
)

if TYPE_CHECKING:
    from radixlm.runtime.engine.scheduler import Scheduler


def answer(sched: Scheduler, cmd: EngineCommand) -> Struct:
    """The reply to one command; refusals become `Error`s, never exceptions."""
    msg = cmd.msg
    try:
        if isinstance(msg, GetStats):
            return stats_reply(sched, msg.rid)
        if isinstance(msg, FlushCache):
            freed = sched.flush_cache()
            sched.log_flush(freed)
            return Ok(rid=msg.rid)
        m = sched.turns.manager()
        client = cmd.client
        if isinstance(msg, ForkSession):
            ids = sched.turns.call(m.fork, msg.session, client, msg.n)
            return SessionsForked(rid=msg.rid, sessions=ids)
        if isinstance(msg, TruncateSession):
            sched.turns.call(m.truncate, msg.session, client, msg.length)
            return Ok(rid=msg.rid)
        if isinstance(msg, CloseSession):
            return close_sessions(sched, m, msg, client)
        if isinstance(msg, Unpin):
            sched.turns.call(m.unpin, msg.name)
            return Ok(rid=msg.rid)
        if isinstance(msg, ListSessions):
            return SessionList(rid=msg.rid, sessions=m.list(client, everyone=msg.all))
    except RequestError as e:
        return Error(rid=msg.rid, code=e.code, message=e.message)
    return Error(
        rid=msg.rid,
        code=ErrorCode.UNKNOWN_TYPE,
        message=f"unknown engine command {type(msg).__name__}",
    )


def close_sessions(sched: Scheduler, m, msg: CloseSession, client: bytes) -> Struct:
    """Close every listed session of `m` (the SessionManager) that can be; `ok` if all
    were, else one `error` with the first refusal's code naming every id left open."""
    ids = msg.ids()
    if not ids:
        return Error(rid=msg.rid, code=ErrorCode.INVALID_PARAMS,
                     message="close_session: name a `session` or a list of `sessions`")
    failed: list[tuple[str, RequestError]] = []
    for session in ids:
        try:
            sched.turns.call(m.close, session, client)
        except RequestError as e:
            failed.append((session, e))
    if not failed:
        return Ok(rid=msg.rid)
    if len(ids) == 1:
        return Error(rid=msg.rid, code=failed[0][1].code, message=failed[0][1].message)
    detail = "; ".join(f"{sid}: {e.message}" for sid, e in failed)
    return Error(rid=msg.rid, code=failed[0][1].code,
                 message=f"{len(failed)} of {len(ids)} sessions not closed ({detail})")


def stats_reply(sched: Scheduler, rid: str) -> StatsReply:
    sizes = sched.cache.sizes()
    private = sched.private_tokens()
    m = sched.sessions
    retained = m.retained_tokens() if m is not None else {}
    c = sched.counters
    return StatsReply(
        rid=rid,
        capacity=sizes.capacity,
        free=sizes.free,
        evictable=sizes.evictable,
        protected=sizes.protected,
        private=private,
        retained_tokens={k: retained.get(k, 0) for k in ("pinned", "hard", "soft")},
        retained_cap=m.retained_cap if m is not None else 0,
        host_capacity=m.host_capacity if m is not None else 0,
        host_used=m.host_used if m is not None else 0,
        sessions=m.num_sessions if m is not None else 0,
        pins=m.num_pins if m is not None else 0,
        running=len(sched.running),
        waiting=len(sched.waiting),
        prompt_tokens_total=c.prompt_tokens,
        cached_tokens_total=c.cached_tokens,
        hit_rate=c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        invariant_ok=sizes.free + sizes.evictable + sizes.protected + private == sizes.capacity,
    )
