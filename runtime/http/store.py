"""Stored conversations: response ids and chat-session ids -> engine sessions, with a TTL.

A stored entry names the engine session that holds its full history token-exactly
(retention "soft": under memory pressure the engine demotes it to ordinary cache and
recomputes what was evicted when it is continued). After `ttl_s` without use an entry
expires: its engine session is closed and its id answers 404 from then on.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Stored:
    id: str
    session: str  # the engine session holding the history
    length: int  # history length in tokens
    expires_at: float
    body: dict[str, Any] | None = None  # the response object (Responses API only)
    busy: bool = False  # a turn is appending to this very session (chat sessions)
    created: float = field(default_factory=time.time)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ConversationStore:
    def __init__(self, ttl_s: float, close_sessions: Callable[[list[str]], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._close = close_sessions
        self._clock = clock
        self._entries: dict[str, Stored] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, id: str, session: str, length: int, body: dict[str, Any] | None = None) -> Stored:
        entry = Stored(id, session, length, self._clock() + self.ttl_s, body)
        self._entries[id] = entry
        return entry

    def get(self, id: str) -> Stored | None:
        """The live entry for `id` (its TTL restarts), or None if unknown or expired."""
        entry = self._entries.get(id)
        if entry is None:
            return None
        now = self._clock()
        if entry.expires_at <= now and not entry.busy:
            self.delete(id)
            return None
        entry.expires_at = now + self.ttl_s
        return entry

    def delete(self, id: str) -> bool:
        entry = self._entries.pop(id, None)
        if entry is None:
            return False
        self._close([entry.session])
        return True

    def sweep(self) -> int:
        """Expire every entry past its TTL (closing their sessions in one request)."""
        now = self._clock()
        dead = [e for e in self._entries.values() if e.expires_at <= now and not e.busy]
        for e in dead:
            del self._entries[e.id]
        self._close([e.session for e in dead])
        return len(dead)
