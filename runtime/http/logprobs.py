"""The engine's per-token logprobs in OpenAI's two shapes (chat and completions)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from radixlm.runtime.protocol import TopLogprob

TokenText = Callable[[int], str]


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_content(tokens: TokenText, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                 top: Sequence[list[TopLogprob]] | None) -> list[dict[str, Any]]:
    """``choices[].logprobs.content``: one entry per generated token."""
    out = []
    for i, tid in enumerate(token_ids):
        item = _entry(tokens(tid), logprobs[i] if logprobs and i < len(logprobs) else 0.0)
        alts = top[i] if top and i < len(top) else []
        item["top_logprobs"] = [_entry(tokens(a.token_id), a.logprob) for a in alts]
        out.append(item)
    return out


def completion(tokens: TokenText, token_ids: Sequence[int], logprobs: Sequence[float | None],
               top: Sequence[list[TopLogprob] | None], offset: int) -> dict[str, Any]:
    """A legacy completion's ``logprobs``: tokens, token_logprobs, top_logprobs and
    text_offset (character offsets into the returned text, from `offset`)."""
    texts = [tokens(t) for t in token_ids]
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    tops = [None if alts is None else {tokens(a.token_id): a.logprob for a in alts}
            for alts in top]
    return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": tops,
            "text_offset": offsets}
