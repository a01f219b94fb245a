"""Messages held while a session turn finishes its tail.

An n == 1 session turn reports its Done as soon as it samples its last token; that
token's KV is computed by one more decode row (the *tail*) before the turn ends, so the
next turn hits the whole history. A client that answers the Done at once must not see
`busy` for that one step: messages naming the session (its next Generate, a fork, a
truncate, a close, and an abort of a held Generate) wait here and are replayed in arrival
order once the tail is done.
"""

from __future__ import annotations

from radixlm.runtime.engine.messages import EngineAbort, EngineCommand, EngineGenerate
from radixlm.runtime.protocol import CloseSession


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


class TailHold:
    def __init__(self) -> None:
        self._held: dict[str, list[object]] = {}  # session -> messages, arrival order
        self._ready: list[object] = []

    def hold(self, session: str) -> None:
        """`session`'s turn has reported; hold its messages until `release`."""
        self._held.setdefault(session, [])

    def defer(self, msg: object) -> bool:
        """Keep `msg` if it acts on a held session; False: handle it now."""
        if not self._held:
            return False
        if isinstance(msg, EngineAbort):
            for msgs in self._held.values():
                if any(isinstance(m, EngineGenerate) and m.key == msg.key for m in msgs):
                    msgs.append(msg)
                    return True
            return False
        for session in sessions_of(msg):  # replayed, it is checked again for the others
            held = self._held.get(session)
            if held is not None:
                held.append(msg)
                return True
        return False

    def release(self, session: str, replay: bool = True) -> None:
        """The tail is done: its messages become ready (or are dropped: client gone)."""
        msgs = self._held.pop(session, None)
        if msgs and replay:
            self._ready.extend(msgs)

    def take_ready(self) -> list[object]:
        """Released messages, in order (asked after every step and message: no copy when
        there are none)."""
        ready = self._ready
        if ready:
            self._ready = []
        return ready
