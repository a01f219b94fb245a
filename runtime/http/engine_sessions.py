"""The engine sessions behind one tenant's stored objects, kept across restarts.

When the store keeps its objects on disk (state.py), every session it opens is *durable*
(``OpenSession.durable``; forks of one are durable too): the engine keeps it when the HTTP
process's connection goes, and across a restart of the engine, in its own state folder.
After a restart of either, a session this connection does not hold is taken back by id
(``ResumeSession``) when it is next used. If the engine has not got it any more (its
state was lost: ``not_found``), or has a shorter history than the one stored (a crash
right after the turn, before the engine wrote it), the caller renders the stored
history again into a new session: recomputed, never an error to the user.

A session appended to in place (a chat session's turn) is asked for every time: an engine
that was started again meanwhile (`radixlm serve` supervises it) has it detached, or a
turn short. Without state nothing is durable, and every session here was opened by this
connection.
"""

from __future__ import annotations

from radixlm.runtime.http.engine_link import EngineLink
from radixlm.runtime.protocol import (
    CloseSession,
    ForkSession,
    OpenSession,
    ResumeSession,
    SessionOpened,
    SessionsForked,
)
from radixlm.runtime.transport.errors import NotFoundError


class EngineSessions:
    def __init__(self, link: EngineLink) -> None:
        self.link = link
        self.durable = False  # set when the store keeps its objects on disk
        self.attached: set[str] = set()  # sessions this connection holds
        self.kept: set[str] = set()  # those the engine said it keeps (durable)

    def _rid(self) -> str:
        return self.link.new_rid()

    async def open(self) -> str:
        """A new session, held softly (the engine may demote it under pressure)."""
        reply = await self.link.call(OpenSession(rid=self._rid(), retention="soft",
                                                 durable=self.durable), SessionOpened)
        self.attached.add(reply.session)
        if reply.durable:
            self.kept.add(reply.session)
        return reply.session

    async def take(self, session: str, length: int, *, check: bool = False) -> bool:
        """Whether this connection holds `session` with its `length` tokens of history,
        resuming it if need be; False: the engine has lost it (closed here if it has a
        different history). `check`: ask the engine even when this connection holds it
        (a turn appended in place: an engine started again since has it detached, or a
        turn short)."""
        if not self.durable or (session in self.attached
                                and not (check and session in self.kept)):
            return True
        try:
            reply = await self.link.call(ResumeSession(rid=self._rid(), session=session),
                                         SessionOpened)
        except NotFoundError:
            self.attached.discard(session)
            return False
        self.attached.add(session)
        self.kept.add(session)
        if reply.length != length:
            self.close([session])
            return False
        return True

    async def fork(self, session: str, length: int) -> str | None:
        """A new session with `session`'s history (`length` tokens); None: lost."""
        for _ in range(2):  # a second time after a resume, if it was not ours any more
            if not await self.take(session, length):
                return None
            try:
                reply = await self.link.call(ForkSession(rid=self._rid(), session=session),
                                             SessionsForked)
            except NotFoundError:
                if not self.durable or session not in self.attached:
                    return None
                self.attached.discard(session)  # the engine restarted under us
                continue
            self.attached.add(reply.sessions[0])
            if session in self.kept:  # (forks of a durable session are durable)
                self.kept.add(reply.sessions[0])
            return reply.sessions[0]
        return None

    def close(self, sessions: list[str]) -> None:
        """Close `sessions` without waiting (their KV stays as evictable cache); those
        this connection does not hold are resumed first (the engine handles a
        connection's requests in order)."""
        if not sessions or not self.link.alive:
            return
        send = self.link.conn.send_unawaited
        if self.durable:
            for session in sessions:
                if session not in self.attached:
                    send(ResumeSession(rid=self._rid(), session=session))
        self.attached.difference_update(sessions)
        self.kept.difference_update(sessions)
        send(CloseSession(rid=self._rid(), sessions=list(sessions)))
