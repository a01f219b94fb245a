"""One tenant's stored objects: responses, chat sessions and conversations, with a TTL.

- A stored response holds its conversation (messages, for continuations whatever their
  instructions) and a reference to the `Held` engine session with that history
  (`history.py`): retention "soft", so under memory pressure the engine demotes it to
  ordinary cache and recomputes what was evicted when it is continued.
- A chat session (radixlm's ``session`` extension) is an engine session of its own that
  each turn appends to in place.
- A conversation is a list of items; it keeps a reference to the held session of its
  latest turn, so that session lives as long as the conversation does.

After `ttl_s` without use an object expires: its id answers 404 from then on and what it
held is let go (sessions are closed when nothing else holds them).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.http.history import MESSAGES_ONLY, Held, HistoryIndex, chain_keys
from radixlm.runtime.http.items import items_of, to_messages
from radixlm.runtime.protocol import Message


@dataclass
class Stored:
    id: str
    session: str  # the engine session holding the history
    length: int  # history length in tokens
    expires_at: float
    body: dict[str, Any] | None = None  # the response object (Responses API only)
    busy: bool = False  # a turn is appending to this very session (chat sessions)
    created: float = field(default_factory=time.time)
    held: Held | None = None  # responses: the shared session (`session` is its id)
    history: list[Message] = field(default_factory=list)  # responses: input + output so far
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this response's own


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    expires_at: float
    items: list[dict[str, Any]] = field(default_factory=list)
    held: Held | None = None  # the session of its latest turn, when one holds its items
    busy: bool = False

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}

    def messages(self) -> list[Message]:
        return to_messages(items_of(self.items), "conversation")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ConversationStore:
    def __init__(self, ttl_s: float, close_sessions: Callable[[list[str]], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._close = close_sessions
        self._clock = clock
        self._entries: dict[str, Stored] = {}
        self._conversations: dict[str, Conversation] = {}
        self.index = HistoryIndex(close_sessions)

    def __len__(self) -> int:
        return len(self._entries) + len(self._conversations)

    # -- responses and chat sessions -------------------------------------------------------

    def put(self, id: str, session: str, length: int, body: dict[str, Any] | None = None) -> Stored:
        entry = Stored(id, session, length, self._clock() + self.ttl_s, body)
        self._entries[id] = entry
        return entry

    def put_response(self, id: str, held: Held, history: list[Message], body: dict[str, Any],
                     input_items: list[dict[str, Any]]) -> Stored:
        """Store a response that holds a reference to `held` (taken by the caller)."""
        entry = Stored(id, held.session, held.length, self._clock() + self.ttl_s, body,
                       held=held, history=history, input_items=input_items)
        self._entries[id] = entry
        return entry

    def get(self, id: str) -> Stored | None:
        """The live entry for `id` (its TTL restarts), or None if unknown or expired."""
        return self._live(self._entries.get(id), self.delete)

    def _live(self, obj: Any, delete: Callable[[str], bool]) -> Any:
        if obj is None:
            return None
        now = self._clock()
        if obj.expires_at <= now and not obj.busy:
            delete(obj.id)
            return None
        obj.expires_at = now + self.ttl_s
        return obj

    def delete(self, id: str) -> bool:
        entry = self._entries.pop(id, None)
        if entry is None:
            return False
        self._let_go(entry)
        return True

    def _let_go(self, entry: Stored) -> None:
        if entry.held is not None:
            self.index.release(entry.held)
        else:
            self._close([entry.session])

    # -- conversations ---------------------------------------------------------------------

    def new_conversation(self, metadata: dict[str, str], items: list[dict[str, Any]]) -> Conversation:
        conv = Conversation(new_id("conv"), int(time.time()), metadata,
                            self._clock() + self.ttl_s, items)
        self._conversations[conv.id] = conv
        self.adopt(conv)
        return conv

    def conversation(self, id: str) -> Conversation | None:
        """The live conversation `id` (its TTL restarts), or None."""
        return self._live(self._conversations.get(id), self.delete_conversation)

    def delete_conversation(self, id: str) -> bool:
        conv = self._conversations.pop(id, None)
        if conv is None:
            return False
        self.index.release(conv.held)
        return True

    def adopt(self, conv: Conversation) -> None:
        """After its items changed: hold the session that holds exactly them, if any."""
        try:
            chain = chain_keys(MESSAGES_ONLY, conv.messages())[-1]
        except Exception:  # noqa: BLE001 - items that do not make messages hold nothing
            chain = b""
        held = self.index.by_chain(chain)
        if held is conv.held:
            return
        if held is not None:
            self.index.ref(held)
        self.index.release(conv.held)
        conv.held = held

    # -- expiry ----------------------------------------------------------------------------

    def sweep(self) -> int:
        """Expire every object past its TTL."""
        now = self._clock()
        dead = [e for e in self._entries.values() if e.expires_at <= now and not e.busy]
        for e in dead:
            del self._entries[e.id]
        closing = [e.session for e in dead if e.held is None]
        for e in dead:
            if e.held is not None:
                self.index.release(e.held)
        gone = [c for c in self._conversations.values() if c.expires_at <= now and not c.busy]
        for c in gone:
            self.delete_conversation(c.id)
        self._close(closing)
        return len(dead) + len(gone)

    def close_all(self) -> None:
        for id in list(self._entries):
            self.delete(id)
        for id in list(self._conversations):
            self.delete_conversation(id)
