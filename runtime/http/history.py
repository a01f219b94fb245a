"""Held histories: engine sessions found by the conversation they hold.

Every stored response leaves an engine session whose history is, token-exactly, its
conversation: the system prompt its ``instructions`` and tools made, then its messages
(input and output). That session is registered here under a *chain key*: a hash of the
root (instructions + tools: what the start of the prompt depends on) and of each message
in turn. A new request -- whatever way its history arrives: ``previous_response_id``, a
``conversation``, or the whole history sent again as ``input`` (openai-agents' sessions,
any stateless client) -- computes the chain keys of its own messages and continues the
longest one held: it forks that session and appends only the messages after it. Nothing
is re-rendered, re-tokenized or recomputed; a different root (changed instructions or
tools) finds nothing, and the turn is rendered in full -- correct, if less cached.

A `Held` session is shared by every stored object that reaches it (responses with the
same history, conversations) and closed when the last one lets go. Held sessions only
ever get forked, never appended to, so they are never busy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from radixlm.runtime.http.state import HeldRow, TenantRows
from radixlm.runtime.protocol import Message, Tool

_enc = msgspec.msgpack.Encoder()


@dataclass(eq=False)
class Held:
    session: str  # the engine session holding the history
    length: int  # its tokens
    key: bytes  # chain key of (root, messages)
    chain: bytes  # chain key of the messages alone (for conversations)
    refs: int = 0
    lost: bool = False  # the engine has not got it any more: found by nobody


def root_key(instructions: str | None, tools: Sequence[Tool] | None) -> bytes:
    """What the prompt's start depends on besides the messages."""
    tool_part = [(t.name, t.description, t.parameters) for t in tools or ()]
    return hashlib.sha256(_enc.encode(["root", instructions, tool_part])).digest()


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _canonical(m: Message) -> bytes:
    calls = [(c.id, c.name, _arguments(c.arguments)) for c in m.tool_calls or ()]
    return _enc.encode([m.role, m.content, calls, m.tool_call_id, m.name])


def chain_keys(root: bytes, messages: Sequence[Message]) -> list[bytes]:
    """``keys[k]``: the key of the first `k` messages under `root` (k = 0..len)."""
    keys = [root]
    for m in messages:
        keys.append(hashlib.sha256(keys[-1] + _canonical(m)).digest())
    return keys


MESSAGES_ONLY = hashlib.sha256(b"messages").digest()


class HistoryIndex:
    """One tenant's held sessions by chain key; `close` closes engine sessions.

    With `rows` (the store keeps its objects on disk), each held session is a row too,
    and one made before a restart is read back when a lookup misses memory; its
    references are then the stored objects that name it (their rows), so an object read
    back later adopts it without counting again (`held_of`)."""

    def __init__(self, close: Callable[[list[str]], None]) -> None:
        self._close = close
        self._by_key: dict[bytes, Held] = {}
        self._by_chain: dict[bytes, Held] = {}
        self._by_session: dict[str, Held] = {}
        self.rows: TenantRows | None = None

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def _cold(self) -> bool:
        return self.rows is not None and self.rows.cold

    def find(self, keys: list[bytes], below: int) -> tuple[int, Held] | None:
        """The longest held prefix of fewer than `below` messages: (its length, the Held)."""
        top = min(below, len(keys))
        for k in range(top - 1, 0, -1):
            held = self._by_key.get(keys[k])
            if held is not None:
                break
        else:
            k, held = 0, None
        if self._cold and k + 1 < top:  # a longer one made before a restart?
            assert self.rows is not None
            on_disk = {row.key: row for row in self.rows.held_by_keys(keys[k + 1:top])}
            for j in range(top - 1, k, -1):
                row = on_disk.get(keys[j])
                found = None if row is None else self._live(row)
                if found is not None:
                    return j, found
        return None if held is None else (k, held)

    def by_chain(self, chain: bytes) -> Held | None:
        held = self._by_chain.get(chain)
        if held is None and self._cold:
            assert self.rows is not None
            row = self.rows.held_by_chain(chain)
            held = None if row is None else self._live(row)
        return held

    def held_of(self, session: str) -> Held:
        """The Held of `session`, named by a stored object read back from disk (one the
        engine has lost if its row is missing)."""
        held = self._by_session.get(session)
        if held is not None:
            return held
        row = self.rows.held_by_session(session) if self.rows is not None else None
        if row is None:
            row = HeldRow(session, 0, b"", b"", True)
        return self._adopt_row(row)

    def _live(self, row: HeldRow) -> Held | None:
        """The Held of a row found by key or chain, unless it is lost (in memory already,
        its row not yet saying so)."""
        held = self._adopt_row(row)
        return None if held.lost else held

    def _adopt_row(self, row: HeldRow) -> Held:
        held = self._by_session.get(row.session)
        if held is not None:
            return held
        assert self.rows is not None
        held = Held(row.session, row.length, row.key, row.chain,
                    refs=self.rows.held_refs(row.session), lost=row.lost)
        self._by_session[held.session] = held
        if not held.lost:
            self._by_key.setdefault(held.key, held)
            self._by_chain.setdefault(held.chain, held)
        return held

    def hold(self, key: bytes, chain: bytes, session: str, length: int) -> Held:
        """Register `session` as holding `key`'s history, with one reference. If that
        history is held already, the existing session is shared and `session` closed."""
        held = self._by_key.get(key)
        if held is None and self._cold:
            assert self.rows is not None
            rows = self.rows.held_by_keys([key])
            held = self._live(rows[0]) if rows else None
        if held is not None:
            self._close([session])
        else:
            held = self._by_key[key] = Held(session, length, key, chain)
            self._by_session[session] = held
            if self.rows is not None:
                self.rows.save_held(session, length, key, chain)
        self._by_chain[chain] = held
        held.refs += 1
        return held

    def ref(self, held: Held) -> Held:
        held.refs += 1
        return held

    def lose(self, held: Held) -> None:
        """The engine has not got `held`'s session any more: nobody finds it again (what
        holds it lets go of it as before)."""
        held.lost = True
        self._unmap(held)
        if self.rows is not None:
            self.rows.lose_held(held.session)

    def _unmap(self, held: Held) -> None:
        if self._by_key.get(held.key) is held:
            del self._by_key[held.key]
        if self._by_chain.get(held.chain) is held:
            del self._by_chain[held.chain]

    def let_go_orphans(self, sessions: list[str]) -> None:
        """Held sessions no stored object names (a crash between two writes left their
        rows), unless memory holds them: their rows deleted, their sessions closed."""
        assert self.rows is not None
        for session in sessions:
            if session not in self._by_session:
                self.rows.delete_held(session)
                self._close([session])

    def release(self, held: Held | None) -> None:
        if held is None:
            return
        held.refs -= 1
        if held.refs > 0:
            return
        self._unmap(held)
        self._by_session.pop(held.session, None)
        if self.rows is not None:
            self.rows.delete_held(held.session)
        if not held.lost:
            self._close([held.session])
