"""What calls return: `GenerateResult` (a finished generation), `StreamDelta` (a streamed
piece), and the SGLang-style ``meta_info`` dict built from a ``Done``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixlm.runtime.protocol import Done, Message, ToolCall, TopLogprob
from radixlm.sdk.structured import to_tool_calls

__all__ = ["GenerateResult", "StreamDelta", "logprob_triples", "meta_info", "to_messages",
           "top_triples"]


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """One finished generation (one branch when ``n > 1``).

    ``meta_info`` has SGLang's keys: ``prompt_tokens``, ``cached_tokens``,
    ``completion_tokens``, ``finish_reason`` (``{"type": "stop", "matched": ...}``,
    ``{"type": "length", "length": n}`` or ``{"type": "abort"}``), plus ``id``,
    ``e2e_latency``, ``output_ids``, ``session_length``, ``recomputed_tokens`` and
    ``restored_tokens``.
    """

    text: str
    token_ids: list[int]  # output ids only
    meta_info: dict[str, Any]
    session: str | None = None  # the session this branch's history lives in
    index: int = 0  # branch index when n > 1
    logprobs: list[float] | None = None  # of each output token, when asked for
    prompt_logprobs: list[float] | None = None
    tool_calls: list[ToolCall] | None = None  # calls parsed from the output (with tools=)

    @property
    def finish_reason(self) -> str:
        """Why it ended: ``stop``, ``length`` or ``abort``."""
        return self.meta_info["finish_reason"]["type"]


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """A streamed piece of output: new text and the ids it came from."""

    text: str
    token_ids: list[int]
    index: int = 0
    logprobs: list[float] | None = None


def _finish_reason(done: Done) -> dict[str, Any]:
    if done.finish_reason == "stop":
        return {"type": "stop", "matched": done.matched_stop}
    if done.finish_reason == "length":
        return {"type": "length", "length": done.usage.completion_tokens}
    return {"type": done.finish_reason}


def logprob_triples(values: list[float], ids: list[int] | None,
                    texts: dict[int, str] | None = None) -> list[tuple[float, int | None, Any]]:
    """SGLang's ``(logprob, token_id, text)`` form; the text is None unless the request
    asked for texts (``logprob_texts``, SGLang's ``return_text_in_logprobs``)."""
    if ids is None:
        return [(v, None, None) for v in values]
    if texts is None:
        return [(v, t, None) for v, t in zip(values, ids, strict=False)]
    return [(v, t, texts.get(t)) for v, t in zip(values, ids, strict=False)]


def top_triples(rows: list[list[TopLogprob]], texts: dict[int, str] | None = None
                ) -> list[list[tuple[float, int, Any]]]:
    if texts is None:
        return [[(alt.logprob, alt.token_id, None) for alt in row] for row in rows]
    return [[(alt.logprob, alt.token_id, texts.get(alt.token_id)) for alt in row] for row in rows]


def meta_info(done: Done, latency_s: float) -> dict[str, Any]:
    """SGLang-compatible meta info for one ``Done``."""
    u = done.usage
    info: dict[str, Any] = {
        "id": done.rid,
        "prompt_tokens": u.prompt_tokens,
        "cached_tokens": u.cached_tokens,
        "completion_tokens": u.completion_tokens,
        "finish_reason": _finish_reason(done),
        "recomputed_tokens": u.recomputed_tokens,
        "restored_tokens": u.restored_tokens,
        "session_length": done.session_length,
        "e2e_latency": latency_s,
        "output_ids": done.token_ids,
    }
    texts = done.token_texts
    if done.logprobs is not None:
        info["output_token_logprobs"] = logprob_triples(done.logprobs, done.token_ids, texts)
        info["output_token_logprobs_length"] = len(done.logprobs)
    if done.top_logprobs is not None:
        info["output_top_logprobs"] = top_triples(done.top_logprobs, texts)
    if done.prompt_logprobs is not None:
        info["input_token_logprobs"] = logprob_triples(done.prompt_logprobs,
                                                       done.prompt_token_ids, texts)
    if done.prompt_top_logprobs is not None:
        info["input_top_logprobs"] = top_triples(done.prompt_top_logprobs, texts)
    return info


def result_from_done(done: Done, latency_s: float) -> GenerateResult:
    return GenerateResult(
        text=done.text,
        token_ids=done.token_ids,
        meta_info=meta_info(done, latency_s),
        session=done.session,
        index=done.index,
        logprobs=done.logprobs,
        prompt_logprobs=done.prompt_logprobs,
        tool_calls=done.tool_calls,
    )


# -- inputs -------------------------------------------------------------------------------


def to_messages(messages: Any) -> list[Message]:
    """Chat messages as protocol `Message`s, from dicts (OpenAI's shape, tool calls
    included), `Message`s or (role, content) pairs."""
    out = []
    for m in messages:
        if isinstance(m, Message):
            out.append(m)
        elif isinstance(m, dict):
            out.append(Message(role=m["role"], content=m.get("content"),
                               tool_calls=to_tool_calls(m.get("tool_calls")),
                               tool_call_id=m.get("tool_call_id"), name=m.get("name")))
        else:
            role, content = m
            out.append(Message(role=role, content=content))
    return out
