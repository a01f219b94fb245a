"""`IncrementalDetokenizer`: streaming text from streaming token ids.

The prefix-offset window technique of vLLM and HF's ``TextStreamer``: each step decodes a
short window ``ids[prefix:]`` and emits what it adds beyond ``ids[prefix:read]``. Decoding
with a little left context keeps what depends on it right: sentencepiece's leading space
(``▁Hello`` decodes to ``Hello`` at the start of a text and to `` Hello`` after a word),
and byte-level BPE characters split over several tokens. While the window's text ends in
U+FFFD (an incomplete UTF-8 sequence) nothing is emitted: the next token may complete it.
`flush` releases whatever is held at the end, replacement characters included.

One decode per step in the common case. The window's emitted part,
``decode(ids[prefix:read])``, is after a one-token step that token's own text, which a
radixlm `Tokenizer` memoises (`Tokenizer.token_text`); only the window itself is decoded.
Decoding costs about a microsecond per call plus a third of one per token, so the window
stays as short as vLLM's rather than growing to save calls.

Invariant (tested): the concatenation of all deltas equals ``decode(all_ids)``; with
`prompt_ids` it equals ``decode(tail + all_ids)[len(decode(tail)):]`` where ``tail`` is the
last few prompt tokens (the context that gives the first output token its leading space).
If a tokenizer's decoder ever breaks the window's prefix property, that step falls back
to decoding everything, so the invariant still holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens kept as left context (vLLM's initial offset)


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turn token ids fed in chunks into text deltas (one instance per output stream)."""

    def __init__(
        self,
        tokenizer: _Decoder,
        skip_special_tokens: bool = True,
        *,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A radixlm Tokenizer: its backend's decode directly (Tokenizer.decode adds only a
        # type check) and its memoised one-token texts. Any other decoder: its decode.
        backend = getattr(tokenizer, "backend", None)
        self._decode_fn = backend.decode if backend is not None else tokenizer.decode
        self._token_text = getattr(tokenizer, "token_text", None)
        context = [int(t) for t in list(prompt_ids)[-_PROMPT_CONTEXT:]]
        self._ids: list[int] = context
        self._context_len = len(context)
        self._prefix = 0  # window start
        self._read = len(context)  # tokens whose text has been emitted
        # decode(ids[prefix:read]), or None until a step needs it.
        self._read_text: str | None = self._decode(context) if context else ""
        self._base_len = len(self._read_text)
        self._emitted_len = 0  # characters emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def output_ids(self) -> list[int]:
        """All ids fed so far."""
        return self._ids[self._context_len :]

    def feed(self, ids: Iterable[int]) -> str:
        """Add generated ids; return the new text they complete (possibly "")."""
        self._ids.extend(map(int, ids))
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end of the stream)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        ids = self._ids
        end = len(ids)
        read = self._read
        if read == end:
            return ""
        prefix = self._prefix
        read_text = self._read_text
        if read_text is None:
            read_text = self._decode(ids[prefix:read])
        new_text = self._decode(ids[prefix:])
        if not new_text.startswith(read_text):
            # The decoder is not local over this window: decode everything instead.
            full = self._decode(ids)
            if not final and full.endswith(_REPLACEMENT):
                self._read_text = read_text
                return ""
            delta = full[self._base_len + self._emitted_len :]
        else:
            if not final and new_text.endswith(_REPLACEMENT):
                self._read_text = read_text
                return ""
            delta = new_text[len(read_text) :]
        if delta or final:
            self._prefix = read
            self._read = end
            # The next window's emitted part: one token's text (memoised) or decoded then.
            token_text = self._token_text
            if end - read == 1 and token_text is not None:
                self._read_text = token_text(ids[read], self.skip_special_tokens)
            else:
                self._read_text = None
        else:
            self._read_text = read_text
        self._emitted_len += len(delta)
        return delta
