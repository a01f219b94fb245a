"""Sampling options as keyword arguments: their names and types (`SamplingOptions`, for
type checkers and ``help()``), SGLang's spellings of them, and `sampling_params`, which
turns them into the protocol's `SamplingParams`."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

from radixlm.runtime.protocol import SamplingParams, branch_seed
from radixlm.sdk.structured import schema_text

__all__ = [
    "SAMPLING_FIELDS", "SamplingOptions", "TurnOptions", "branch_seed", "protocol_options", "sampling_params",
    "unknown_keyword",
]


class SamplingOptions(TypedDict, total=False):
    """The sampling keywords of `generate`, `stream`, `session`, `send` and program runs:
    the fields of the protocol's `SamplingParams`, plus SGLang's names for three of them.
    ``None`` means "the default"; ``stop`` may be one string."""

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
    "return_logprob": "logprobs",
    "top_logprobs_num": "top_logprobs",
}
SAMPLING_FIELDS: frozenset[str] = frozenset(SamplingParams.__struct_fields__) | frozenset(_ALIASES)


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
    stop = fields.get("stop")
    if stop is not None:
        fields["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = list(fields["stop_token_ids"])
    return SamplingParams(**fields)
