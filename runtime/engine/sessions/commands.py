"""Session commands the engine answers at once, without running the model: fork,
truncate, close, unpin, list, resume, and the hint that a tool's result is near."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.engine.sessions.manager import SessionManager
from radixlm.runtime.protocol import (
    CloseSession,
    Error,
    ForkSession,
    ListSessions,
    Ok,
    ResumeSession,
    SessionList,
    SessionOpened,
    SessionsForked,
    Struct,
    ToolDoneSoon,
    TruncateSession,
    Unpin,
)
from radixlm.runtime.rules import RequestError


def is_session_command(msg: object) -> bool:
    return isinstance(msg, (ForkSession, TruncateSession, CloseSession, Unpin, ListSessions,
                            ResumeSession, ToolDoneSoon))


def answer(m: SessionManager, msg: Any, client: bytes, tenant: str | None = None) -> Struct:
    """The reply to one session command of `client` (of `tenant`); refusals raise
    RequestError."""
    if isinstance(msg, ForkSession):
        forks = m.fork(msg.session, client, msg.n)
        return SessionsForked(rid=msg.rid, sessions=forks, length=m.get(msg.session, client).length)
    if isinstance(msg, TruncateSession):
        m.truncate(msg.session, client, msg.length)
        return Ok(rid=msg.rid)
    if isinstance(msg, CloseSession):
        return close_sessions(m, msg, client)
    if isinstance(msg, Unpin):
        m.pinned.unpin(msg.name)
        return Ok(rid=msg.rid)
    if isinstance(msg, ToolDoneSoon):
        m.waits.tool_done_soon(msg.session, client)
        return Ok(rid=msg.rid)
    if isinstance(msg, ResumeSession):
        s = m.durability.resume(msg.session, client, tenant)
        return SessionOpened(rid=msg.rid, session=s.id, length=s.length,
                             cached_tokens=s.held_len, durable=True)
    assert isinstance(msg, ListSessions)
    return SessionList(rid=msg.rid, sessions=m.list(client, everyone=msg.all, tenant=tenant))


def close_sessions(m: SessionManager, msg: CloseSession, client: bytes) -> Struct:
    """Close every listed session that can be; `ok` if all were, else one `error` with
    the first refusal's code naming every id left open."""
    ids = msg.ids()
    failed: list[tuple[str, RequestError]] = []
    for session in ids:
        try:
            m.close(session, client)
        except RequestError as e:
            failed.append((session, e))
    if not failed:
        return Ok(rid=msg.rid)
    first = failed[0][1]
    if len(ids) == 1:
        return Error(rid=msg.rid, code=first.code, message=first.message)
    detail = "; ".join(f"{sid}: {e.message}" for sid, e in failed)
    return Error(rid=msg.rid, code=first.code,
                 message=f"{len(failed)} of {len(ids)} sessions not closed ({detail})")
