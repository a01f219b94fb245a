"""Messages held while a session turn runs its tail.

An n == 1 session turn reports its Done as soon as it samples its last token; that
token's KV is computed by one more decode row (the *tail*) before the turn ends, so the
next turn hits the whole history. A client that answers the Done at once must not see
`busy` for that one step (nor an old length): messages naming the session (its next
Generate, a fork, a truncate, a close, and an abort of a held Generate) and the client's
session listings wait here and are replayed in arrival order once the tail is done
(dropped if the turn did not finish: its client is gone).
"""

from __future__ import annotations

from radixlm.runtime.engine_wire import EngineAbort, EngineCommand, EngineGenerate
from radixlm.runtime.protocol import CloseSession, GetStats, ListSessions


def sessions_of(msg: object) -> list[str]:
    """The sessions a message acts on (a close may name several)."""
    if isinstance(msg, EngineGenerate):
        return [msg.session] if msg.session is not None else []
    if isinstance(msg, EngineCommand):
        if isinstance(msg.msg, CloseSession):
            return msg.msg.ids()
        session = getattr(msg.msg, "session", None)  # ForkSession/TruncateSession
        return [session] if session is not None else []
    return []


class HeldMessages:
    """Per session in its tail, the messages that wait for it."""

    def __init__(self) -> None:
        self._held: dict[str, list[object]] = {}  # session in its tail -> messages held
        self._held_by: dict[str, bytes] = {}  # session in its tail -> its client
        self._ready: list[object] = []

    def hold(self, session: str, client: bytes) -> None:
        """`session`'s turn has reported and runs its tail: its messages wait."""
        self._held.setdefault(session, [])
        self._held_by[session] = client

    def defer(self, msg: object) -> bool:
        """Keep `msg` if it acts on a session whose turn runs its tail; False: handle it
        now."""
        if not self._held:
            return False
        if isinstance(msg, EngineAbort):
            for msgs in self._held.values():
                if any(isinstance(m, EngineGenerate) and m.key == msg.key for m in msgs):
                    msgs.append(msg)
                    return True
            return False
        if isinstance(msg, EngineCommand) and isinstance(msg.msg, (ListSessions, GetStats)):
            # A listing (or stats) shows every turn its client was told is done and every
            # command it sent before: it waits for that client's tails and held messages
            # (replayed, it is checked again).
            for session, client in self._held_by.items():
                if client == msg.client:
                    self._held[session].append(msg)
                    return True
            return False
        for session in sessions_of(msg):  # replayed, it is checked again for the others
            held = self._held.get(session)
            if held is not None:
                held.append(msg)
                return True
        return False

    def release(self, session: str, finished: bool) -> None:
        """The tail is done: the held messages become ready (dropped if the turn did not
        finish)."""
        msgs = self._held.pop(session, None)
        self._held_by.pop(session, None)
        if msgs and finished:
            self._ready.extend(msgs)

    def take_ready(self) -> list[object]:
        """Messages released by finished tails, in arrival order (asked after every step
        and message: no copy when there are none)."""
        ready = self._ready
        if ready:
            self._ready = []
        return ready
