"""A reply as Anthropic content blocks, built from the parts the frontend read (text, and
pieces of tool calls: `generation.parts`), with the stream events that build them.

Blocks come in the order the model wrote them: a ``thinking`` block (a reasoning model's
``<think>`` block, `thinking.py`), ``text``, and a ``tool_use`` block per call, whose
``input`` streams as ``input_json_delta`` fragments as it is generated. A stream and the
non-streamed reply of the same output hold the same blocks: the non-streamed one is the
stream's blocks put together (a call the output ended inside is left out of it, as its
input is not a whole object).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec
from radixlm.runtime.http.anthropic.thinking import TEXT, THINKING, ThinkingSplitter
from radixlm.runtime.http.generation import parts
from radixlm.runtime.protocol import CallDelta, Chunk, Done

_json = msgspec.json.Encoder()
_DELTA_KIND = {TEXT: "text_delta", THINKING: "thinking_delta"}
_DELTA_FIELD = {TEXT: "text", THINKING: "thinking"}


def event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode({"type": kind, **obj}) + b"\n\n"


def tool_use_id(call_id: str | None) -> str:
    """Anthropic's id shape for a call id the frontend gave (``call_<hex>``)."""
    return "toolu_" + (call_id or "").removeprefix("call_")


def signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text (clients send it back)."""
    return "rlm1" + hashlib.blake2b(thinking.encode(), digest_size=16).hexdigest()


class BlockWriter:
    """`feed` each Chunk (or the whole text, non-streamed), then `finish`; `blocks` is the
    content. With `events`, both return the SSE events of what they added."""

    def __init__(self, *, forced_thinking: bool = False, show_thinking: bool = True,
                 events: bool = True) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._events = events
        self._show = show_thinking
        self._split = ThinkingSplitter(forced_thinking)
        self._open: dict[str, Any] | None = None
        self._kind = ""  # of the open block: TEXT, THINKING or "tool_use"
        self._texts: list[str] = []  # of the open text/thinking block
        self._args: dict[str, list[str]] = {}  # tool_use id -> argument fragments
        self._text_prefix = b""  # the open text block's delta event, up to its text

    # -- blocks ---------------------------------------------------------------------------

    def _start(self, block: dict[str, Any], kind: str, out: list[bytes]) -> None:
        self._close(out)
        self._open, self._kind = block, kind
        index = len(self.blocks)
        self.blocks.append(block)
        if self._events:
            out.append(event("content_block_start", {"index": index, "content_block": block}))
            if kind == TEXT:
                self._text_prefix = (b'event: content_block_delta\ndata: {"type":"content_block_'
                                     b'delta","index":' + str(index).encode()
                                     + b',"delta":{"type":"text_delta","text":')

    def _close(self, out: list[bytes]) -> None:
        block = self._open
        if block is None:
            return
        index = len(self.blocks) - 1
        if self._kind in (TEXT, THINKING):
            text = "".join(self._texts)
            self._texts = []
            if self._kind == TEXT:
                block["text"] = text
            else:
                block["thinking"] = text if self._show else ""
                block["signature"] = signature(text)
                if self._events:
                    out.append(event("content_block_delta", {"index": index, "delta": {
                        "type": "signature_delta", "signature": block["signature"]}}))
        if self._events:
            out.append(event("content_block_stop", {"index": index}))
        self._open, self._kind = None, ""

    def _piece(self, kind: str, text: str, out: list[bytes]) -> None:
        if not text:
            return
        if self._kind != kind:
            block: dict[str, Any] = ({"type": "text", "text": ""} if kind == TEXT else
                                     {"type": "thinking", "thinking": "", "signature": ""})
            self._start(block, kind, out)
        self._texts.append(text)
        if not self._events:
            return
        if kind == TEXT:
            out.append(self._text_prefix + _json.encode(text) + b"}}\n\n")
        elif self._show:
            out.append(event("content_block_delta", {"index": len(self.blocks) - 1, "delta": {
                "type": _DELTA_KIND[kind], _DELTA_FIELD[kind]: text}}))

    def _call(self, part: CallDelta, out: list[bytes]) -> None:
        if part.name is not None:
            for kind, text in self._split.finish():  # no thinking after a call
                self._piece(kind, text, out)
            call_id = tool_use_id(part.id)
            self._args[call_id] = []
            self._start({"type": "tool_use", "id": call_id, "name": part.name, "input": {}},
                        "tool_use", out)
        if self._kind != "tool_use" or self._open is None:
            return
        if part.arguments:
            self._args[self._open["id"]].append(part.arguments)
            if self._events:
                out.append(event("content_block_delta", {"index": len(self.blocks) - 1, "delta": {
                    "type": "input_json_delta", "partial_json": part.arguments}}))
        if part.done:
            self._close(out)

    # -- input ----------------------------------------------------------------------------

    def feed(self, chunk: Chunk) -> list[bytes]:
        out: list[bytes] = []
        if chunk.content is None and self._kind == TEXT and self._split.passing:
            if chunk.text:  # the common case: more of the open text block
                self._texts.append(chunk.text)
                if self._events:
                    out.append(self._text_prefix + _json.encode(chunk.text) + b"}}\n\n")
            return out
        for part in parts(chunk):
            if type(part) is str:
                if self._kind == "tool_use":
                    self._close(out)
                for kind, text in self._split.feed(part):
                    self._piece(kind, text, out)
            else:
                self._call(part, out)  # type: ignore[arg-type]
        return out

    def feed_text(self, text: str) -> list[bytes]:
        """A whole output that has no calls (a non-streamed reply without tools)."""
        out: list[bytes] = []
        for kind, piece in self._split.feed(text):
            self._piece(kind, piece, out)
        return out

    def finish(self, done: Done) -> list[bytes]:
        """Close what is open; tool_use inputs become the complete calls' arguments."""
        out: list[bytes] = []
        for kind, text in self._split.finish():
            self._piece(kind, text, out)
        self._close(out)
        complete = {tool_use_id(c.id): c.arguments for c in done.tool_calls or ()}
        kept = []
        for block in self.blocks:
            if block["type"] == "tool_use":
                arguments = complete.get(block["id"])
                if arguments is None:
                    continue  # the output ended inside it
                block["input"] = _object(arguments)
            kept.append(block)
        self.blocks = kept
        return out


def _object(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(done: Done, stops: list[str], max_tokens: int) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``: the output limit (``max_tokens``,
    or ``model_context_window_exceeded`` when the context ended it first), complete calls
    (``tool_use``), one of the request's stop sequences (``stop_sequence``, naming it), or
    the model's end of turn (``end_turn``)."""
    if done.finish_reason == "length":
        if done.usage.completion_tokens < max_tokens:
            return "model_context_window_exceeded", None
        return "max_tokens", None
    if done.tool_calls:
        return "tool_use", None
    matched = done.matched_stop
    if isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None
