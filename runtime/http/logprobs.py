"""The engine's per-token logprobs in OpenAI's two shapes (chat and completions).

Token texts are the engine's: routes ask for them (``Generate.logprob_texts``) and pass
each reply's `token_texts` here (the HTTP process has no tokenizer). An id missing from
them (an engine that sent none) is written ``token_id:N``, as vLLM writes a token it
cannot name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

from radixlm.runtime.protocol import TopLogprob

TokenTexts = Union[Mapping[int, str], None]


def _text(texts: TokenTexts, token_id: int) -> str:
    text = texts.get(token_id) if texts else None
    return f"token_id:{token_id}" if text is None else text


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_content(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                 top: Sequence[list[TopLogprob]] | None) -> list[dict[str, Any]]:
    """``choices[].logprobs.content``: one entry per generated token."""
    out = []
    for i, tid in enumerate(token_ids):
        item = _entry(_text(texts, tid), logprobs[i] if logprobs and i < len(logprobs) else 0.0)
        alts = top[i] if top and i < len(top) else []
        item["top_logprobs"] = [_entry(_text(texts, a.token_id), a.logprob) for a in alts]
        out.append(item)
    return out


def completion(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[float | None],
               top: Sequence[list[TopLogprob] | None], offset: int) -> dict[str, Any]:
    """A legacy completion's ``logprobs``: tokens, token_logprobs, top_logprobs and
    text_offset (character offsets into the returned text, from `offset`)."""
    tokens = [_text(texts, t) for t in token_ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    tops = [None if alts is None else {_text(texts, a.token_id): a.logprob for a in alts}
            for alts in top]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops,
            "text_offset": offsets}
