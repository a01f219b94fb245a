"""One generation in a stored conversation: which engine session it runs in, and what is
stored after it.

- Responses (`continue_held`): the longest held history that the turn's messages start
  with is *forked* (it stays as it was: several continuations may run at once) and only
  the messages after it are appended; with none, a new soft-retained session gets the
  whole conversation; nothing stored and nothing held: no session at all.
- Chat sessions (`begin`): a new one opens a session; continuing one appends to it in
  place, or to a fork of it.
The engine renders only the appended messages, and the held history is a prefix-cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.http.context import HttpContext
from radixlm.runtime.http.errors import ApiError
from radixlm.runtime.http.history import Held
from radixlm.runtime.http.store import Stored
from radixlm.runtime.protocol import Done
from radixlm.runtime.transport.errors import NotFoundError


@dataclass
class Turn:
    session: str | None  # the engine session the Generate appends to
    in_place: Stored | None = None  # the stored entry this turn advances (chat, no fork)
    fresh: bool = False  # the session was opened or forked for this turn
    keep: bool = True  # store the result


def unknown(kind: str, id: str) -> ApiError:
    return ApiError(404, f"{kind} '{id}' not found (expired, deleted, or never stored)",
                    type="invalid_request_error", code="not_found")


async def _open_session(ctx: HttpContext) -> str:
    """A new engine session, held softly (the engine may demote it under pressure)."""
    return (await ctx.link.open_session(retention="soft")).session


async def _fork_session(ctx: HttpContext, session: str) -> str:
    return (await ctx.link.fork_session(session)).sessions[0]


async def begin(ctx: HttpContext, previous: str | None, *, fork: bool, keep: bool,
                kind: str) -> Turn:
    """The engine session for a turn continuing `previous` (None: a new conversation)."""
    if previous is None:
        if not keep:
            return Turn(None, keep=False)
        return Turn(await _open_session(ctx), fresh=True)
    entry = ctx.store.get(previous)
    if entry is None:
        raise unknown(kind, previous)
    if not fork:
        if entry.busy:
            raise ApiError(409, f"{kind} '{previous}' already has a turn running (fork it, "
                                "or wait)", type="conflict_error", code="busy")
        entry.busy = True
        return Turn(entry.session, in_place=entry)
    return Turn(await _fork_session(ctx, entry.session), fresh=True, keep=keep)


def _succeeded(done: Done | None) -> bool:
    return done is not None and done.finish_reason != "abort" and done.session is not None


def _kept(ctx: HttpContext, turn: Turn, done: Done | None) -> int | None:
    """The history length a new session of `turn` keeps; None when there is nothing to
    keep (no new session, failed, aborted, not stored) -- the session is closed then."""
    if turn.session is None or not turn.fresh:
        return None
    if not _succeeded(done) or not turn.keep:
        ctx.link.close_sessions_unawaited([turn.session])
        return None
    assert done is not None
    return done.session_length or 0


def finish(ctx: HttpContext, turn: Turn, done: Done | None, new_id: str) -> Stored | None:
    """Store the turn's result under `new_id` (or under the entry it advanced); on failure
    (`done` None, or aborted) close what was opened for it."""
    if turn.in_place is not None:
        turn.in_place.busy = False
        if _succeeded(done):
            assert done is not None and done.session_length is not None
            turn.in_place.length = done.session_length
        return turn.in_place
    length = _kept(ctx, turn, done)
    return None if length is None else ctx.store.put(new_id, turn.session or "", length)


async def continue_held(ctx: HttpContext, keys: list[bytes], n_messages: int, *,
                        keep: bool) -> tuple[Turn, int]:
    """The session for a turn over `n_messages` messages whose chain keys are `keys`,
    and how many of those messages it already holds (append the rest)."""
    found = ctx.store.index.find(keys, n_messages)
    if found is not None:
        k, held = found
        try:
            return Turn(await _fork_session(ctx, held.session), fresh=True, keep=keep), k
        except NotFoundError:  # closed meanwhile (expired): compute it afresh
            pass
    if not keep:
        return Turn(None, keep=False), 0
    return Turn(await _open_session(ctx), fresh=True), 0


def hold(ctx: HttpContext, turn: Turn, done: Done | None, key: bytes, chain: bytes) -> Held | None:
    """After a Responses turn: the held session now holding its history (one reference
    for the caller), or None -- failed, aborted, or nothing to keep (what the turn opened
    is closed then)."""
    length = _kept(ctx, turn, done)
    return None if length is None else ctx.store.index.hold(key, chain, turn.session or "",
                                                            length)
