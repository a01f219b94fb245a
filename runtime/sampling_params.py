"""Sampling-parameter constants and `validate_sampling`, free of torch.

The frontend process validates every request's sampling parameters as it arrives; this
module lets it do so without importing torch (seconds of CPU per server start).
`radixlm.runtime.sampling` re-exports all of it for the engine side.

Parameters are read by attribute from any object shaped like `radixlm.runtime.protocol.
SamplingParams`; the limits come from the protocol, where every process reads them.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from radixlm.runtime.protocol import MAX_TOP_LOGPROBS
from radixlm.tokenizer.stop_regex import check_patterns

__all__ = [
    "GREEDY_EPS",
    "MAX_TOP_LOGPROBS",
    "PENALTY_RANGE",
    "SamplingParamsLike",
    "validate_sampling",
]

GREEDY_EPS = 1e-5  # temperatures at or below this are greedy
PENALTY_RANGE = (-2.0, 2.0)  # frequency / presence penalties (OpenAI's range)


class SamplingParamsLike(Protocol):
    """The attributes read by sampling (``radixlm.runtime.protocol.SamplingParams`` has them)."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    stop_regex: list[str]
    min_tokens: int
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_INT_FIELDS = ("max_tokens", "top_k", "top_logprobs")


def validate_sampling(params: SamplingParamsLike, vocab_size: int | None = None) -> str | None:
    """A clear message for the first invalid field of `params`, or None if all are valid.

    ``max_tokens == 0`` is allowed (a prompt-only request, e.g. prompt logprobs).
    `vocab_size`, if given, bounds ``stop_token_ids``.
    """
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if not _number(value) or not math.isfinite(value):
            return f"{name} must be a finite number, got {value!r}"
    for name in _INT_FIELDS:
        value = getattr(params, name)
        if not _integer(value) and not (name == "max_tokens" and value is None):
            return f"{name} must be an integer, got {value!r}"

    if params.max_tokens is not None and params.max_tokens < 0:
        return f"max_tokens must be >= 0 (0: score the prompt only), got {params.max_tokens}"
    if params.temperature < 0:
        return f"temperature must be >= 0 (0 means greedy), got {params.temperature}"
    if not 0.0 < params.top_p <= 1.0:
        return f"top_p must be in (0, 1], got {params.top_p}"
    if params.top_k < -1:
        return f"top_k must be -1 or 0 (off) or a positive integer, got {params.top_k}"
    if not 0.0 <= params.min_p <= 1.0:
        return f"min_p must be in [0, 1], got {params.min_p}"
    lo, hi = PENALTY_RANGE
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        if not lo <= value <= hi:
            return f"{name} must be in [{lo:g}, {hi:g}], got {value}"
    if params.repetition_penalty <= 0:
        return f"repetition_penalty must be > 0 (1 = off), got {params.repetition_penalty}"
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        return f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {params.top_logprobs}"

    seed = params.seed
    if seed is not None and (not _integer(seed) or not -(1 << 63) <= seed < (1 << 64)):
        return f"seed must be an integer in [-2**63, 2**64), got {seed!r}"
    for s in params.stop:
        if not isinstance(s, str) or not s:
            return f"stop strings must be non-empty strings, got {s!r}"
    for t in params.stop_token_ids:
        if not _integer(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f" and < vocab size {vocab_size}" if vocab_size is not None else ""
            return f"stop_token_ids must be integers >= 0{bound}, got {t!r}"
    # max_tokens None is the rest of the context, resolved in the engine: any min_tokens
    # >= 0 is then within it (the engine's own bound ends the output first).
    top = params.max_tokens
    if not _integer(params.min_tokens) or params.min_tokens < 0 or (
            top is not None and params.min_tokens > top):
        return (f"min_tokens must be an integer in [0, max_tokens ({top})], "
                f"got {params.min_tokens!r}")
    return check_patterns(params.stop_regex)
