"""The stub's answers to session and pin messages: open, fork, truncate, close, list;
pin, unpin. Refusals raise `Refused` (the server turns them into `Error` replies)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from radixlm.runtime import protocol as p
from radixlm.testing.stub_state import Refused, StubSession, StubState

__all__ = ["SessionMessages"]

Send = Callable[[bytes, p.Struct], None]


class SessionMessages:
    """Session and pin messages, answered over `send` from the stub's `state`."""

    def __init__(self, state: StubState, send: Send) -> None:
        self._state = state
        self._send = send

    def handlers(self) -> dict[type, Callable[[bytes, Any], None]]:
        return {p.OpenSession: self.open, p.ForkSession: self.fork,
                p.TruncateSession: self.truncate, p.CloseSession: self.close,
                p.ListSessions: self.list, p.Pin: self.pin, p.Unpin: self.unpin}

    def open(self, client: bytes, msg: p.OpenSession) -> None:
        state = self._state
        start: list[int] = []
        if msg.pinned is not None:
            if msg.pinned not in state.pins:
                raise Refused(p.ErrorCode.NOT_FOUND, f"no pin {msg.pinned!r}")
            start = list(state.pins[msg.pinned])
        probe = StubSession(client, start)
        ids = start + (state.ids_of(msg.input, probe if start else None) if msg.input else [])
        cached = state.compute(ids) if ids else 0
        open_assistant = bool(msg.input and msg.input.messages is not None
                              and msg.input.add_generation_prompt)
        sid = state.new_session(client, ids, msg.namespace, open_assistant)
        self._send(client, p.SessionOpened(rid=msg.rid, session=sid, length=len(ids),
                                           cached_tokens=cached))

    def fork(self, client: bytes, msg: p.ForkSession) -> None:
        state = self._state
        s = state.idle(client, msg.session)
        if not 1 <= msg.n <= p.MAX_FORK:
            raise Refused(p.ErrorCode.INVALID_PARAMS,
                          f"n must be in [1, {p.MAX_FORK}], got {msg.n}")
        ids = [state.new_session(client, s.history, s.namespace, s.open_assistant)
               for _ in range(msg.n)]
        self._send(client, p.SessionsForked(rid=msg.rid, sessions=ids, length=len(s.history)))

    def truncate(self, client: bytes, msg: p.TruncateSession) -> None:
        s = self._state.idle(client, msg.session)
        if not 0 <= msg.length <= len(s.history):
            raise Refused(p.ErrorCode.INVALID_PARAMS, "length out of range")
        s.history = s.history[: msg.length]
        self._send(client, p.Ok(rid=msg.rid))

    def close(self, client: bytes, msg: p.CloseSession) -> None:
        ids = msg.ids()
        if not 1 <= len(ids) <= p.MAX_CLOSE:
            raise Refused(p.ErrorCode.INVALID_PARAMS,
                          f"close_session names 1 to {p.MAX_CLOSE} sessions, got {len(ids)}")
        state = self._state
        for session in ids:  # like the engine: close what can be, refuse with the first error
            state.idle(client, session)
            del state.sessions[session]
        self._send(client, p.Ok(rid=msg.rid))

    def list(self, client: bytes, msg: p.ListSessions) -> None:
        now = time.monotonic()
        infos = [p.SessionInfo(session=sid, length=len(s.history), idle_s=now - s.last_used,
                               retention="hard", busy=s.busy, namespace=s.namespace)
                 for sid, s in self._state.sessions.items() if s.owner == client]
        self._send(client, p.SessionList(rid=msg.rid, sessions=infos))

    def pin(self, client: bytes, msg: p.Pin) -> None:
        state = self._state
        if msg.name in state.pins:
            raise Refused(p.ErrorCode.DUPLICATE_ID, f"pin {msg.name!r} exists")
        ids = state.ids_of(msg.input, None)
        state.compute(ids)
        state.pins[msg.name] = ids
        self._send(client, p.Pinned(rid=msg.rid, name=msg.name, length=len(ids)))

    def unpin(self, client: bytes, msg: p.Unpin) -> None:
        if self._state.pins.pop(msg.name, None) is None:
            raise Refused(p.ErrorCode.NOT_FOUND, f"no pin {msg.name!r}")
        self._send(client, p.Ok(rid=msg.rid))
