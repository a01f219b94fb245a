"""Sampling options as keyword arguments: their names and types (`SamplingOptions`, for
type checkers and ``help()``), SGLang's spellings of them, and `sampling_params`, which
turns them into the protocol's `SamplingParams`."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypedDict

from radixlm.runtime.protocol import SamplingParams, branch_seed
from radixlm.sdk.structured import schema_text

__all__ = [
    "GEN_FIELDS", "SAMPLING_FIELDS", "GenDefaults", "SamplingOptions", "TurnOptions", "branch_seed", "protocol_options", "sampling_params",
    "unknown_keyword",
]


class SamplingOptions(TypedDict, total=False):
    """The sampling keywords of `generate`, `stream`, `session`, `send` and program runs:
    the fields of the protocol's `SamplingParams`, plus SGLang's names for four of them.
    ``None`` means "the default"; ``stop`` and ``stop_regex`` may be one string."""

    max_tokens: int | None
    max_new_tokens: int | None  # SGLang's name for max_tokens
    temperature: float | None  # 0 = greedy
    top_p: float | None
    top_k: int | None
    min_p: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    repetition_penalty: float | None
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    stop_regex: str | Sequence[str] | None  # ends the output once its text matches
    min_tokens: int | None  # EOS / stop_token_ids cannot end the output before this many
    min_new_tokens: int | None  # SGLang's name for min_tokens
    ignore_eos: bool | None
    logprobs: bool | None
    return_logprob: bool | None  # SGLang's name for logprobs
    top_logprobs: int | None
    top_logprobs_num: int | None  # SGLang's name for top_logprobs
    regex: str | None  # constrained decoding: at most one of regex, json_schema, ebnf
    json_schema: Any  # a JSON Schema: JSON text, a dict or a pydantic model class
    ebnf: str | None  # a GBNF/EBNF grammar whose start rule is `root`
    # Not sampling, but `Generate` fields that travel with these keywords:
    tools: Sequence[Any] | None  # Tools, or OpenAI-style function dicts
    tool_choice: Any  # "auto", "none", "required" or a named function


class TurnOptions(SamplingOptions, total=False):
    """A chat turn's keywords: `SamplingOptions`, and for a tool result
    (``role="tool"``) the call it answers."""

    tool_call_id: str | None
    name: str | None


# SGLang spellings accepted next to the protocol's field names.
_ALIASES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "return_logprob": "logprobs",
    "top_logprobs_num": "top_logprobs",
}
SAMPLING_FIELDS: frozenset[str] = frozenset(SamplingParams.__struct_fields__) | frozenset(_ALIASES)
# What a gen (or, as the default of its gens, a program run) takes besides sampling
# options: branches per gen, and the prompt logprobs its meta info reports (SGLang's).
GEN_FIELDS: frozenset[str] = frozenset({"n", "logprob_start_len", "return_text_in_logprobs"})


class GenDefaults(NamedTuple):
    """A run's defaults for its gens' `GEN_FIELDS` (a gen's own values override them)."""

    n: int = 1
    logprob_start_len: int | None = None
    text_in_logprobs: bool | None = None

    @classmethod
    def take(cls, options: dict[str, Any]) -> GenDefaults:
        """The `GEN_FIELDS` of run options, removed from `options` (None: not given)."""
        n = options.pop("n", None)
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        start = options.pop("logprob_start_len", None)
        if start is not None and start < 0:
            raise ValueError(f"logprob_start_len must be >= 0, got {start}")
        return cls(n or 1, start, options.pop("return_text_in_logprobs", None))


def unknown_keyword(where: str, key: str, known: Iterable[str]) -> TypeError:
    """The error for keyword `key` that `where` does not take, naming the closest known one."""
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return TypeError(f"{where} got an unexpected keyword argument {key!r}{hint}")


def protocol_options(where: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` by the protocol's field names (SGLang's names mapped, ``None``s dropped);
    a name that is no sampling option raises `TypeError` naming `where`."""
    fields: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        name = _ALIASES.get(key, key)
        if name not in SamplingParams.__struct_fields__:
            raise unknown_keyword(where, key, SAMPLING_FIELDS)
        if name == "json_schema":
            value = schema_text(value)  # the protocol carries JSON text
        if fields.get(name, value) != value:
            raise ValueError(f"{where} got {name}={fields[name]!r} and {key}={value!r}: "
                             f"they are one option, give one of them")
        fields[name] = value
    return fields


def sampling_params(options: Mapping[str, Any]) -> SamplingParams:
    """A `SamplingParams` from keyword options (``None`` means "default"); ``stop`` may be
    a single string. Unknown names raise ``TypeError``; values are checked by the engine."""
    fields = protocol_options("sampling options", options)
    for key in ("stop", "stop_regex"):
        value = fields.get(key)
        if value is not None:
            fields[key] = [value] if isinstance(value, str) else list(value)
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = list(fields["stop_token_ids"])
    return SamplingParams(**fields)
