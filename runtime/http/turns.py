"""One generation in a stored conversation: which engine session it runs in, and what is
stored after it.

- Responses (`continue_held`): the longest held history that the turn's messages start
  with is *forked* (it stays as it was: several continuations may run at once) and only
  the messages after it are appended; with none, a new soft-retained session gets the
  whole conversation; nothing stored and nothing held: no session at all.
- Chat sessions (`begin`): a new one opens a session; continuing one appends to it in
  place, or to a fork of it.
The engine renders only the appended messages, and the held history is a prefix-cache hit.
A session made before a restart is resumed first (engine_sessions.py); one the engine has
lost is never an error: a response's turn renders its whole conversation afresh, a chat
session's turn sends its stored messages again (`Turn.replay`) into a new session.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.runtime.http.context import HttpContext
from radixlm.runtime.http.engine_sessions import EngineSessions
from radixlm.runtime.http.errors import ApiError
from radixlm.runtime.http.history import Held
from radixlm.runtime.http.store import Stored
from radixlm.runtime.protocol import Done, Message


@dataclass
class Turn:
    session: str | None  # the engine session the Generate appends to
    in_place: Stored | None = None  # the stored entry this turn advances (chat, no fork)
    fresh: bool = False  # the session was opened or forked for this turn
    keep: bool = True  # store the result
    # Chat sessions: the messages before this turn's (stored), then this turn's own.
    before: list[Message] = field(default_factory=list)
    added: list[Message] = field(default_factory=list)
    # Messages to send before this turn's own: the stored ones, when the engine lost the
    # session they were in (a new one is computed from them).
    replay: list[Message] = field(default_factory=list)


def _sessions(ctx: HttpContext) -> EngineSessions:
    sessions = ctx.store.sessions
    assert sessions is not None
    return sessions


def unknown(kind: str, id: str) -> ApiError:
    return ApiError(404, f"{kind} '{id}' not found (expired, deleted, or never stored)",
                    type="invalid_request_error", code="not_found")


async def begin(ctx: HttpContext, previous: str | None, *, fork: bool, keep: bool,
                kind: str, messages: list[Message] | None = None) -> Turn:
    """The engine session for a turn continuing `previous` (None: a new conversation)
    with `messages`."""
    added = list(messages or [])
    sessions = _sessions(ctx)
    if previous is None:
        if not keep:
            return Turn(None, keep=False)
        return Turn(await sessions.open(), fresh=True, added=added)
    entry = ctx.store.get(previous)
    if entry is None:
        raise unknown(kind, previous)
    before = list(entry.history)
    if not fork:
        if entry.busy:
            raise ApiError(409, f"{kind} '{previous}' already has a turn running (fork it, "
                                "or wait)", type="conflict_error", code="busy")
        entry.busy = True
        try:
            if await sessions.take(entry.session, entry.length, check=True):
                return Turn(entry.session, in_place=entry, before=before, added=added)
            return Turn(await sessions.open(), in_place=entry, before=before, added=added,
                        replay=before)
        except BaseException:
            entry.busy = False
            raise
    forked = await sessions.fork(entry.session, entry.length)
    if forked is not None:
        return Turn(forked, fresh=True, keep=keep, before=before, added=added)
    return Turn(await sessions.open(), fresh=True, keep=keep, before=before, added=added,
                replay=before)


def _succeeded(done: Done | None) -> bool:
    return done is not None and done.finish_reason != "abort" and done.session is not None


def _kept(ctx: HttpContext, turn: Turn, done: Done | None) -> int | None:
    """The history length a new session of `turn` keeps; None when there is nothing to
    keep (no new session, failed, aborted, not stored) -- the session is closed then."""
    if turn.session is None or not turn.fresh:
        return None
    if not _succeeded(done) or not turn.keep:
        _sessions(ctx).close([turn.session])
        return None
    assert done is not None
    return done.session_length or 0


def finish(ctx: HttpContext, turn: Turn, done: Done | None, new_id: str) -> Stored | None:
    """Store the turn's result under `new_id` (or under the entry it advanced); on failure
    (`done` None, or aborted) close what was opened for it."""
    entry = turn.in_place
    if entry is not None:
        entry.busy = False
        if _succeeded(done):
            assert done is not None and done.session_length is not None
            ctx.store.advance(entry, turn.session or "", done.session_length, _history(turn, done))
        elif turn.replay and turn.session is not None:  # the new session holds nothing kept
            _sessions(ctx).close([turn.session])
        return entry
    length = _kept(ctx, turn, done)
    if length is None:
        return None
    assert done is not None
    return ctx.store.put(new_id, turn.session or "", length, _history(turn, done))


def _history(turn: Turn, done: Done) -> list[Message]:
    """A chat session's messages after `turn`: those before, its own, the reply."""
    calls = done.tool_calls or None  # (its text is then the calls' raw markup)
    reply = Message(role="assistant", content=None if calls else done.text, tool_calls=calls)
    return [*turn.before, *turn.added, reply]


async def continue_held(ctx: HttpContext, keys: list[bytes], n_messages: int, *,
                        keep: bool) -> tuple[Turn, int]:
    """The session for a turn over `n_messages` messages whose chain keys are `keys`,
    and how many of those messages it already holds (append the rest)."""
    sessions = _sessions(ctx)
    while (found := ctx.store.index.find(keys, n_messages)) is not None:
        k, held = found
        forked = await sessions.fork(held.session, held.length)
        if forked is not None:
            return Turn(forked, fresh=True, keep=keep), k
        ctx.store.index.lose(held)  # closed meanwhile, or lost by the engine: a shorter one?
    if not keep:
        return Turn(None, keep=False), 0
    return Turn(await sessions.open(), fresh=True), 0


def hold(ctx: HttpContext, turn: Turn, done: Done | None, key: bytes, chain: bytes) -> Held | None:
    """After a Responses turn: the held session now holding its history (one reference
    for the caller), or None -- failed, aborted, or nothing to keep (what the turn opened
    is closed then)."""
    length = _kept(ctx, turn, done)
    return None if length is None else ctx.store.index.hold(key, chain, turn.session or "",
                                                            length)
