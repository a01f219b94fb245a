"""One tenant's stored objects: responses, chat sessions and conversations, with a TTL.

- A stored response holds its conversation (messages, for continuations whatever their
  instructions) and a reference to the `Held` engine session with that history
  (`history.py`): retention "soft", so under memory pressure the engine demotes it to
  ordinary cache and recomputes what was evicted when it is continued.
- A chat session (radixlm's ``session`` extension) is an engine session of its own that
  each turn appends to in place; it keeps its messages too (to render them again if the
  engine has lost the session).
- A conversation is a list of items; it keeps a reference to the held session of its
  latest turn, so that session lives as long as the conversation does.

After `ttl_s` without use an object expires: its id answers 404 from then on and what it
held is let go (sessions are closed when nothing else holds them).

With a state directory (`attach`), every object is also a row of ``http.sqlite``
(state.py), written as it changes: the routes await `flush` before they answer, so what
a reply acknowledges is on disk. Memory stays the cache: after a restart an object is
read back by its id when it is first asked for, its engine session resumed when it is
next used (engine_sessions.py). Expiry uses the wall clock and applies to rows too; a
row's expiry is rewritten when a use has moved it by `TOUCH` of the TTL, so an object
read back after a restart lives at most that much longer than its TTL says.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.http.engine_sessions import EngineSessions
from radixlm.runtime.http.history import MESSAGES_ONLY, Held, HistoryIndex, chain_keys
from radixlm.runtime.http.items import items_of, to_messages
from radixlm.runtime.http.state import TenantRows
from radixlm.runtime.protocol import Message

TOUCH = 0.05  # a row's expiry is rewritten when a use moved it by this share of the TTL
SWEEP_ROWS = 256  # expired rows let go per sweep (each is read back first)


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
    history: list[Message] = field(default_factory=list)  # input + output so far
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this response's own
    saved_expiry: float = 0.0  # what its row says


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, str]
    expires_at: float
    items: list[dict[str, Any]] = field(default_factory=list)
    held: Held | None = None  # the session of its latest turn, when one holds its items
    busy: bool = False
    next_seq: int = 0  # the order of its next item's row
    saved_expiry: float = 0.0

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": self.metadata}

    def messages(self) -> list[Message]:
        return to_messages(items_of(self.items), "conversation")


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


class ConversationStore:
    def __init__(self, ttl_s: float, close_sessions: Callable[[list[str]], None],
                 clock: Callable[[], float] = time.time,
                 sessions: EngineSessions | None = None) -> None:
        self.ttl_s = ttl_s
        self._close = close_sessions
        self._clock = clock
        self.sessions = sessions  # the engine sessions behind the objects (turns.py)
        self._entries: dict[str, Stored] = {}
        self._conversations: dict[str, Conversation] = {}
        self.index = HistoryIndex(close_sessions)
        self.rows: TenantRows | None = None

    def __len__(self) -> int:
        return len(self._entries) + len(self._conversations)

    def attach(self, rows: TenantRows) -> None:
        """Keep every object in `rows` from now on, and read back those kept there before."""
        self.rows = self.index.rows = rows
        if self.sessions is not None:
            self.sessions.durable = True

    async def flush(self) -> None:
        """Return once every change made so far is on disk (at once without state; a
        failed write was said in the log, and the object stays in memory)."""
        if self.rows is not None:
            await self.rows.committed()

    # -- responses and chat sessions -------------------------------------------------------

    def put(self, id: str, session: str, length: int,
            history: list[Message] | None = None) -> Stored:
        """Store a chat session (its own engine session, its messages so far)."""
        entry = Stored(id, session, length, self._clock() + self.ttl_s, history=history or [])
        self._entries[id] = entry
        self._save(entry)
        return entry

    def put_response(self, id: str, held: Held, history: list[Message], body: dict[str, Any],
                     input_items: list[dict[str, Any]]) -> Stored:
        """Store a response that holds a reference to `held` (taken by the caller)."""
        entry = Stored(id, held.session, held.length, self._clock() + self.ttl_s, body,
                       held=held, history=history, input_items=input_items)
        self._entries[id] = entry
        self._save(entry)
        return entry

    def _save(self, e: Stored) -> None:
        e.saved_expiry = e.expires_at
        if self.rows is not None:
            self.rows.save_stored(e.id, e.session, e.held is not None, e.length, e.body,
                                  e.history, e.input_items, e.created, e.expires_at)

    def advance(self, entry: Stored, session: str, length: int, history: list[Message]) -> None:
        """A chat session's turn ended: its session (a new one if the old was lost), its
        length and its messages."""
        entry.session, entry.length, entry.history = session, length, history
        entry.saved_expiry = entry.expires_at
        if self.rows is not None:
            self.rows.advance_stored(entry.id, session, length, history, entry.expires_at)

    def get(self, id: str) -> Stored | None:
        """The live entry for `id` (its TTL restarts), or None if unknown or expired."""
        entry = self._entries.get(id)
        if entry is None:
            entry = self._read_entry(id)
        return self._live(entry, self.delete)

    def _read_entry(self, id: str) -> Stored | None:
        row = self.rows.stored(id) if self.rows is not None else None
        if row is None:
            return None
        held = self.index.held_of(row.session) if row.shared else None
        entry = Stored(row.id, row.session, row.length, row.expires_at + TOUCH * self.ttl_s,
                       row.body, created=row.created, held=held, history=row.history,
                       input_items=row.input_items, saved_expiry=row.expires_at)
        self._entries[id] = entry
        return entry

    def _live(self, obj: Any, delete: Callable[[str], bool]) -> Any:
        if obj is None:
            return None
        now = self._clock()
        if obj.expires_at <= now and not obj.busy:
            delete(obj.id)
            return None
        obj.expires_at = now + self.ttl_s
        if self.rows is not None and obj.expires_at - obj.saved_expiry >= TOUCH * self.ttl_s:
            obj.saved_expiry = obj.expires_at
            if isinstance(obj, Stored):
                self.rows.touch_stored(obj.id, obj.expires_at)
            else:
                self.rows.update_conversation(obj.id, expires_at=obj.expires_at)
        return obj

    def delete(self, id: str) -> bool:
        entry = self._entries.pop(id, None)
        if entry is None and self._read_entry(id) is not None:
            entry = self._entries.pop(id)
        if entry is None:
            return False
        if self.rows is not None:
            self.rows.delete_stored(id)
        self._let_go(entry)
        return True

    def _let_go(self, entry: Stored) -> None:
        if entry.held is not None:
            self.index.release(entry.held)
        else:
            self._close([entry.session])

    # -- conversations ---------------------------------------------------------------------

    def new_conversation(self, metadata: dict[str, str], items: list[dict[str, Any]]) -> Conversation:
        now = self._clock()
        conv = Conversation(new_id("conv"), int(time.time()), metadata, now + self.ttl_s, items,
                            next_seq=len(items), saved_expiry=now + self.ttl_s)
        self._conversations[conv.id] = conv
        if self.rows is not None:
            self.rows.save_conversation(conv.id, conv.created_at, metadata, None,
                                        conv.expires_at, items)
        self.adopt(conv)
        return conv

    def conversation(self, id: str) -> Conversation | None:
        """The live conversation `id` (its TTL restarts), or None."""
        conv = self._conversations.get(id)
        if conv is None:
            conv = self._read_conversation(id)
        return self._live(conv, self.delete_conversation)

    def _read_conversation(self, id: str) -> Conversation | None:
        row = self.rows.conversation(id) if self.rows is not None else None
        if row is None:
            return None
        conv = Conversation(row.id, row.created_at, row.metadata,
                            row.expires_at + TOUCH * self.ttl_s, row.items,
                            held=None if row.held is None else self.index.held_of(row.held),
                            next_seq=row.next_seq, saved_expiry=row.expires_at)
        self._conversations[id] = conv
        return conv

    def delete_conversation(self, id: str) -> bool:
        conv = self._conversations.pop(id, None)
        if conv is None and self._read_conversation(id) is not None:
            conv = self._conversations.pop(id)
        if conv is None:
            return False
        if self.rows is not None:
            self.rows.delete_conversation(id)
        self.index.release(conv.held)
        return True

    def set_metadata(self, conv: Conversation, metadata: dict[str, str]) -> None:
        conv.metadata = metadata
        if self.rows is not None:
            self.rows.update_conversation(conv.id, metadata=metadata)

    def add_items(self, conv: Conversation, items: list[dict[str, Any]],
                  held: Held | None = None) -> None:
        """Append `items`; then hold `held` (a response's turn on the conversation: the
        session of its whole history), or the session that holds exactly the items."""
        conv.items += items
        if self.rows is not None:
            self.rows.add_items(conv.id, conv.next_seq, items)
        conv.next_seq += len(items)
        if held is None:
            self.adopt(conv)
        else:
            self._hold(conv, self.index.ref(held))

    def delete_item(self, conv: Conversation, index: int) -> None:
        item = conv.items.pop(index)
        if self.rows is not None:
            self.rows.delete_item(conv.id, item["id"])
        self.adopt(conv)

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
        self._hold(conv, held)

    def _hold(self, conv: Conversation, held: Held | None) -> None:
        """`conv` holds `held` (its reference taken) instead of what it held."""
        self.index.release(conv.held)
        conv.held = held
        if self.rows is not None:
            self.rows.update_conversation(conv.id, held=held.session if held else "")

    # -- expiry ----------------------------------------------------------------------------

    def sweep(self) -> int:
        """Expire every object past its TTL (in memory, and rows past theirs)."""
        now = self._clock()
        dead = [e for e in self._entries.values() if e.expires_at <= now and not e.busy]
        for e in dead:
            del self._entries[e.id]
            if self.rows is not None:
                self.rows.delete_stored(e.id)
        closing = [e.session for e in dead if e.held is None]
        for e in dead:
            if e.held is not None:
                self.index.release(e.held)
        gone = [c for c in self._conversations.values() if c.expires_at <= now and not c.busy]
        for c in gone:
            self.delete_conversation(c.id)
        self._close(closing)
        if self.rows is None:
            return len(dead) + len(gone)
        stored, conversations = self.rows.expired(now - TOUCH * self.ttl_s, SWEEP_ROWS)
        more = [self.delete(i) for i in stored if i not in self._entries]
        more += [self.delete_conversation(i) for i in conversations
                 if i not in self._conversations]
        self.index.let_go_orphans(self.rows.orphans(SWEEP_ROWS))
        return len(dead) + len(gone) + sum(more)
