"""What the stub holds, shared by its message handlers: the sessions and pins of every
client, the prefix trie that stands in for the radix cache (``usage.cached_tokens``), the
prompt counters of its stats, and how a protocol `Input` becomes toy tokens.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime import protocol as p
from radixlm.testing.toy_model import IM_END, encode_text, render_chatml

__all__ = ["PrefixTrie", "Refused", "StubSession", "StubState"]


class Refused(Exception):
    """A request the stub answers with an `Error` of this code (the engine's)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class PrefixTrie:
    """Prefix trie of computed sequences: the stub's 'radix cache'."""

    def __init__(self) -> None:
        self.root: dict[int, Any] = {}

    def match(self, seq: list[int]) -> int:
        node, n = self.root, 0
        for t in seq:
            node = node.get(t)
            if node is None:
                break
            n += 1
        return n

    def insert(self, seq: list[int]) -> None:
        node = self.root
        for t in seq:
            node = node.setdefault(t, {})


@dataclass
class StubSession:
    owner: bytes
    history: list[int]
    namespace: str | None = None
    open_assistant: bool = False  # its history ends inside an assistant turn
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)


class StubState:
    """Sessions, pins, the prefix trie and the prompt counters (one per stub)."""

    def __init__(self) -> None:
        self.sessions: dict[str, StubSession] = {}
        self.pins: dict[str, list[int]] = {}
        self.trie = PrefixTrie()
        self._ids = itertools.count(1)
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0

    def ids_of(self, inp: p.Input, session: StubSession | None) -> list[int]:
        """The toy tokens `inp` appends to `session`'s history (None: a fresh prompt);
        messages appended after an open assistant turn close it first, as the engine's
        template delta does."""
        given = [x for x in (inp.text, inp.input_ids, inp.messages) if x is not None]
        if len(given) != 1:
            raise Refused(p.ErrorCode.INVALID_PARAMS, "input needs exactly one of text, "
                                                      "input_ids, messages")
        if inp.input_ids is not None:
            return list(inp.input_ids)
        if inp.text is not None:
            return encode_text(inp.text)
        assert inp.messages is not None
        text = render_chatml(inp.messages, inp.add_generation_prompt)
        if session is not None and session.open_assistant and session.history:
            text = f"{IM_END}\n" + text
        return encode_text(text)

    def owned(self, client: bytes, sid: str) -> StubSession:
        """`client`'s session `sid` (another client's is not found, as in the engine)."""
        s = self.sessions.get(sid)
        if s is None or s.owner != client:
            raise Refused(p.ErrorCode.NOT_FOUND, f"no session {sid!r}")
        return s

    def idle(self, client: bytes, sid: str) -> StubSession:
        """`client`'s session `sid`, refused while a generation runs on it."""
        s = self.owned(client, sid)
        if s.busy:
            raise Refused(p.ErrorCode.BUSY, f"session {sid!r} is busy")
        return s

    def new_session(self, client: bytes, history: list[int], namespace: str | None,
                    open_assistant: bool = False) -> str:
        sid = f"s{next(self._ids)}"
        self.sessions[sid] = StubSession(client, list(history), namespace, open_assistant)
        return sid

    def compute(self, seq: list[int]) -> int:
        """'Prefill' `seq`: how much was cached; the sequence joins the trie."""
        cached = self.trie.match(seq)
        self.trie.insert(seq)
        self.prompt_tokens_total += len(seq)
        self.cached_tokens_total += cached
        return cached
