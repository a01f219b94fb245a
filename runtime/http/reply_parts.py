"""A streamed chunk read as the frontend read it: its text outside tool calls and the
pieces of calls, in the order the model wrote them (docs/protocol.md, `chunk`). The
routes render these parts; nothing here parses the output again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Union

from radixlm.runtime.protocol import CallDelta, Chunk

__all__ = ["Part", "parts"]

Part = Union[str, CallDelta]  # content text, or a piece of a call


def parts(chunk: Chunk) -> Iterator[Part]:
    """`chunk.content` cut where its call pieces sit (each at its `at`), in order. A chunk
    whose calls are not read (no `content`) is its text."""
    content = chunk.content
    if content is None:
        if chunk.text:
            yield chunk.text
        return
    pos = 0
    for piece in chunk.tool_calls or ():
        if piece.at > pos:
            yield content[pos:piece.at]
            pos = piece.at
        yield piece
    if pos < len(content):
        yield content[pos:]
