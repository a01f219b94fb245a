"""Meta info while a gen streams: what ``text_async_iter(name, return_meta_data=True)``
yields with each piece of text, as SGLang's streaming meta info.

Each piece comes with the meta of the tokens it covers: ``output_token_logprobs`` (and
``output_top_logprobs``) for the tokens since the previous piece only, and the running
totals ``completion_tokens`` and ``output_token_logprobs_length``. Tokens whose text the
engine is still holding back (part of a character, a possible stop string) ride with the
next piece that has text, so no token's logprob is lost or repeated however the reader
keeps up. Once the gen finished, the rest of its final meta info (usage, finish reason)
joins the last piece.
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.protocol import Chunk
from radixlm.sdk.results import logprob_triples, top_triples

__all__ = ["StreamLog"]


class StreamLog:
    """What one streaming gen received so far (written by its executor)."""

    __slots__ = ("id", "logprobs", "tokens", "top_logprobs")

    def __init__(self, rid: str) -> None:
        self.id = rid
        self.tokens: list[int] = []
        self.logprobs: list[tuple[Any, ...]] | None = None
        self.top_logprobs: list[list[tuple[Any, ...]]] | None = None

    def add(self, chunk: Chunk) -> None:
        if chunk.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += logprob_triples(chunk.logprobs, chunk.token_ids, chunk.token_texts)
        if chunk.top_logprobs is not None:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs += top_triples(chunk.top_logprobs, chunk.token_texts)
        self.tokens += chunk.token_ids

    def meta_since(self, token_cursor: int, final: dict[str, Any] | None) -> dict[str, Any]:
        """The meta of the tokens from `token_cursor` on (`final`: the gen's whole meta
        info, once it finished)."""
        meta: dict[str, Any] = {"id": self.id, "finish_reason": None} if final is None else {
            k: v for k, v in final.items()
            if k not in ("output_token_logprobs", "output_top_logprobs")}
        n = len(self.tokens)
        meta["completion_tokens"] = n
        if self.logprobs is not None:
            meta["output_token_logprobs"] = self.logprobs[token_cursor:]
            meta["output_token_logprobs_length"] = len(self.logprobs)
        if self.top_logprobs is not None:
            meta["output_top_logprobs"] = self.top_logprobs[token_cursor:]
        return meta
