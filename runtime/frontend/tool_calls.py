"""A branch's tool calls, read as its text is detokenized: the one place a call is parsed
for clients and given its id.

`CallReader.read(text)` feeds the branch's new text to the call parser
(`radixlm.tokenizer.call_parser`) and returns it as a chunk carries it (docs/protocol.md,
`chunk`): the text outside calls (`content`) and the pieces of calls (`CallDelta`s, each
placed in that content by its `at`; the pieces of one call within one read merged into
one). Each call gets its id when its name is known, so the first piece that names it
carries it, and `calls` lists the complete calls with the same ids for the branch's Done.
A call the output ended inside is streamed as it stood but is not listed.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from radixlm.runtime.protocol import CallDelta, Tool, ToolCall
from radixlm.tokenizer.call_formats import ToolFormat
from radixlm.tokenizer.call_parser import ArgsDelta, CallBegin, CallEnd, CallParser, TextDelta

__all__ = ["CallReader", "new_call_id"]


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class CallReader:
    """See the module docstring; ``parallel`` false keeps the first call only."""

    __slots__ = ("_parser", "_calls", "_id", "_name")

    def __init__(self, fmt: ToolFormat, tools: Sequence[Tool], parallel: bool) -> None:
        self._parser = CallParser(fmt, [t.name for t in tools], one_call=not parallel)
        self._calls: list[ToolCall] = []
        self._id = self._name = ""  # the open call's

    @property
    def calls(self) -> list[ToolCall] | None:
        return self._calls or None

    def read(self, text: str, final: bool = False) -> tuple[str, list[CallDelta] | None]:
        """`text` (the branch's next text; `final`: its last) as (content, call pieces)."""
        parser = self._parser
        events = parser.feed(text) if text else []
        if final:
            events += parser.finish()
        content: list[str] = []
        at = 0
        pieces: list[CallDelta] = []
        for e in events:
            if isinstance(e, TextDelta):
                content.append(e.text)
                at += len(e.text)
            elif isinstance(e, CallBegin):
                self._id, self._name = new_call_id(), e.name
                pieces.append(CallDelta(index=e.index, at=at, id=self._id, name=e.name))
            elif isinstance(e, ArgsDelta):
                self._piece(pieces, e.index, at).arguments += e.text
            elif isinstance(e, CallEnd) and e.complete:
                self._piece(pieces, e.index, at).done = True
                self._calls.append(ToolCall(id=self._id, name=self._name, arguments=e.arguments))
        return "".join(content), pieces or None

    @staticmethod
    def _piece(pieces: list[CallDelta], index: int, at: int) -> CallDelta:
        """The piece of call `index` at `at` in this read (made if none)."""
        last = pieces[-1] if pieces else None
        if last is None or last.index != index or last.at != at:
            last = CallDelta(index=index, at=at)
            pieces.append(last)
        return last
