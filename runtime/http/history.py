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
from radixlm.runtime.protocol import Message, Tool

_enc = msgspec.msgpack.Encoder()


@dataclass(eq=False)
class Held:
    session: str  # the engine session holding the history
    length: int  # its tokens
    key: bytes  # chain key of (root, messages)
    chain: bytes  # chain key of the messages alone (for conversations)
    refs: int = 0


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
    """One tenant's held sessions by chain key; `close` closes engine sessions."""

    def __init__(self, close: Callable[[list[str]], None]) -> None:
        self._close = close
        self._by_key: dict[bytes, Held] = {}
        self._by_chain: dict[bytes, Held] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def find(self, keys: list[bytes], below: int) -> tuple[int, Held] | None:
        """The longest held prefix of fewer than `below` messages: (its length, the Held)."""
        for k in range(min(below, len(keys)) - 1, 0, -1):
            held = self._by_key.get(keys[k])
            if held is not None:
                return k, held
        return None

    def by_chain(self, chain: bytes) -> Held | None:
        return self._by_chain.get(chain)

    def hold(self, key: bytes, chain: bytes, session: str, length: int) -> Held:
        """Register `session` as holding `key`'s history, with one reference. If that
        history is held already, the existing session is shared and `session` closed."""
        held = self._by_key.get(key)
        if held is not None:
            self._close([session])
        else:
            held = self._by_key[key] = Held(session, length, key, chain)
        self._by_chain[chain] = held
        held.refs += 1
        return held

    def ref(self, held: Held) -> Held:
        held.refs += 1
        return held

    def release(self, held: Held | None) -> None:
        if held is None:
            return
        held.refs -= 1
        if held.refs > 0:
            return
        if self._by_key.get(held.key) is held:
            del self._by_key[held.key]
        if self._by_chain.get(held.chain) is held:
            del self._by_chain[held.chain]
        self._close([held.session])
