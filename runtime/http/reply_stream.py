"""A streamed reply read as it comes: text deltas, and tool calls -- each call's name
first, then its argument fragments -- for the chat and Responses streams.

One `CallStream` (radixlm.tokenizer.tool_stream) per branch, in the model's call format
(`Welcome.tool_format`), when the request can have calls; otherwise text passes through.
Each call gets its id when its name is known, so the chunk that names it carries it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from radixlm.runtime.protocol import Tool, ToolCall
from radixlm.tokenizer.tool_stream import (
    ArgsDelta,
    CallBegin,
    CallEnd,
    CallStream,
    Event,
    TextDelta,
)

__all__ = ["ArgsDelta", "CallBegin", "CallEnd", "Event", "ReplyParser", "TextDelta", "call_id"]


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ReplyParser:
    """Per branch: `feed(index, text)` / `finish(index)` -> events; `calls(index)` the
    branch's finished calls (ids included), `text(index)` its text outside calls."""

    def __init__(self, fmt: str, tools: Sequence[Tool] | None, parse: bool, n: int = 1,
                 parallel: bool = True) -> None:
        names = [t.name for t in tools or ()]
        self.parsing = parse and bool(names)
        self._streams = [CallStream(fmt, names) if self.parsing else None  # type: ignore[arg-type]
                         for _ in range(n)]
        self._ids: list[list[str]] = [[] for _ in range(n)]
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._parallel = parallel
        self._cut = [False] * n  # one call only, and it has ended: the rest is dropped

    def feed(self, index: int, text: str) -> list[Event]:
        stream = self._streams[index]
        if self._cut[index]:
            return []
        if stream is None:
            if not text:
                return []
            self._texts[index].append(text)
            return [TextDelta(text)]
        return self._note(index, stream.feed(text))

    def finish(self, index: int) -> list[Event]:
        stream = self._streams[index]
        if stream is None or self._cut[index]:
            return []
        return self._note(index, stream.finish())

    def _note(self, index: int, events: list[Event]) -> list[Event]:
        out = []
        for e in events:
            if isinstance(e, CallBegin):
                if not self._parallel and e.index > 0:
                    self._cut[index] = True
                    break
                self._ids[index].append(call_id())
            elif isinstance(e, TextDelta):
                self._texts[index].append(e.text)
            out.append(e)
        return out

    def call_id(self, index: int, call: int) -> str:
        return self._ids[index][call]

    def calls(self, index: int) -> list[ToolCall]:
        stream = self._streams[index]
        found = stream.calls if stream is not None else []
        if not self._parallel:
            found = found[:1]
        return [ToolCall(id=i, name=name, arguments=args)
                for i, (name, args) in zip(self._ids[index], found, strict=False)]

    def text(self, index: int) -> str:
        return "".join(self._texts[index])
