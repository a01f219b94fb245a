"""Every rule a client request can break, each written once, and the runtime's one
refusal type.

A rule is checked where its facts are first known, and only there:

- at the frontend, as a message arrives (nothing queued yet, no tokenizer needed): the
  input's form and size, sampling, `n`, tools (their names and parameter schemas), fork
  counts, close lists, pin names (before a tenant's prefix makes an empty name look
  taken);
- at the engine, which alone knows a session's history, the pool and what is retained:
  the prompt's length (empty, context, pool, retention; an unset ``max_tokens`` is what
  is left of them), `prompt_logprobs_start` against the input it counts in, truncate
  lengths, and every session and pin rule (runtime/engine/sessions/).

Nothing here imports torch or anything of the engine or the frontend: both import it.
Each check raises `RequestError` with a stable protocol `ErrorCode`; the caller turns it
into an `Error` reply for the request's rid.
"""

from __future__ import annotations

import math
import re
from typing import Any, Protocol

import msgspec
from radixlm.runtime.protocol import (
    MAX_CLOSE,
    MAX_FORK,
    MAX_N,
    MAX_TOP_LOGPROBS,
    CloseSession,
    ErrorCode,
    Generate,
    Input,
    SamplingParams,
    Tool,
)
from radixlm.tokenizer.stop_regex import check_patterns


class RequestError(Exception):
    """A refused request: `code` is a protocol ErrorCode, `message` says why (both go to
    the client in an `Error`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# -- sampling parameters (the frontend checks them; the engine's sampler re-exports them) --

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


def _invalid(message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_PARAMS, message)


# --------------------------------------------------------------- at the frontend
def check_input(inp: Input, vocab_size: int) -> None:
    """Exactly one of text / input_ids / messages, ids inside the vocabulary, and every
    message with content (or tool calls)."""
    given = [name for name in ("text", "input_ids", "messages") if getattr(inp, name) is not None]
    if len(given) != 1:
        raise _invalid(f"input needs exactly one of text, input_ids, messages (got {given or 'none'})")
    ids = inp.input_ids
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise _invalid(f"input_ids must be in [0, {vocab_size}), got {bad}")
    for i, m in enumerate(inp.messages or ()):
        if m.content is None and not m.tool_calls:
            raise _invalid(f"messages[{i}] ({m.role}) has no content")


def check_input_size(inp: Input | None, max_bytes: int, context_length: int) -> None:
    """Refuse, before any tokenizing, an input that cannot fit the context whatever its
    tokens: more ids than the context, or more text bytes than `max_bytes` (the context
    times the longest token's bytes, with a margin). Characters are counted first (never
    more than bytes), so a huge text costs no encoding."""
    if inp is None or max_bytes <= 0:
        return
    if inp.input_ids is not None and len(inp.input_ids) > context_length:
        raise RequestError(ErrorCode.TOO_LONG, f"input ({len(inp.input_ids)} tokens) exceeds "
                                               f"the context length ({context_length})")
    messages = inp.messages or ()
    # Every message and tool call renders to at least one token: more of them than the
    # context holds can never fit, and is refused before anything is rendered.
    parts = len(messages) + sum(len(m.tool_calls or ()) for m in messages)
    if parts > context_length:
        raise RequestError(ErrorCode.TOO_LONG, f"input ({len(messages)} messages, {parts} with "
                                               f"their tool calls) exceeds the context length "
                                               f"({context_length}): each takes a token at least")
    texts = [inp.text] if inp.text is not None else [
        t for m in messages for t in (m.content or "", *(
            f"{c.name}{c.arguments}" for c in m.tool_calls or ()))]
    chars = sum(len(t) for t in texts)
    if chars * 4 <= max_bytes:  # UTF-8: at most 4 bytes a character
        return
    size = chars if chars > max_bytes else sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > max_bytes:
        raise RequestError(
            ErrorCode.TOO_LONG,
            f"input text ({size} UTF-8 bytes{' at least' if size == chars else ''}) is longer "
            f"than any text that fits the context of {context_length} tokens")


def check_count(name: str, n: int, limit: int) -> None:
    if not 1 <= n <= limit:
        raise _invalid(f"{name} must be in [1, {limit}], got {n}")


def check_sampling(sampling: SamplingParams, vocab_size: int) -> None:
    problem = validate_sampling(sampling, vocab_size)
    if problem is not None:
        raise _invalid(problem)


def check_generate(msg: Generate, vocab_size: int) -> None:
    """Everything about a Generate that can be judged before tokenization: `n` (and
    ``n > 1`` needs output to branch), sampling, the input."""
    check_count("n", msg.n, MAX_N)
    if msg.n > 1 and msg.sampling.max_tokens == 0:
        raise _invalid("n > 1 needs max_tokens >= 1")
    check_sampling(msg.sampling, vocab_size)
    check_input(msg.input, vocab_size)


def check_tools(tools: list[Tool] | None, context_length: int) -> None:
    """A request's tools: at least one when given; no more than the context holds (each
    definition renders to a token at least: refused before anything is rendered); names
    of 1-64 letters, digits, '_', '.' or '-', none given twice; ``parameters`` a JSON
    Schema object schema -- a map whose ``type`` (if given) is "object", whose
    ``properties`` map names to schemas and whose ``required`` names only strings, every
    nested schema a map (or a boolean) with known ``type``s."""
    if tools is None:
        return
    if not tools:
        raise _invalid("tools is empty: omit it, or give at least one tool")
    if len(tools) > context_length:
        raise RequestError(ErrorCode.TOO_LONG, f"{len(tools)} tool definitions exceed the "
                                               f"context length ({context_length})")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.name
        if not _TOOL_NAME.match(name):
            raise _invalid(f"tools[{i}].name {name!r} must be 1-64 letters, digits, '_', '.' "
                           "or '-'")
        if name in seen:
            raise _invalid(f"tools[{i}].name {name!r} is given twice")
        seen.add(name)
        params = tool.parameters
        if params.get("type", "object") != "object":
            raise _invalid(f"tools[{i}] ({name}).parameters must be an object schema, got "
                           f"type {params['type']!r}")
        if problem := _schema_problem(params, f"tools[{i}] ({name}).parameters"):
            raise _invalid(problem)


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _schema_problem(schema: Any, where: str) -> str | None:
    """The first problem with a JSON Schema `schema` (found at `where`), or None."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} must be a JSON Schema (a map), got {type(schema).__name__}"
    kind = schema.get("type")
    for k in kind if isinstance(kind, list) else [kind] if kind is not None else []:
        if k not in _JSON_TYPES:
            return f"{where}.type {k!r} is not a JSON Schema type ({', '.join(sorted(_JSON_TYPES))})"
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            return f"{where}.properties must be a map of schemas"
        for key, sub in props.items():
            if problem := _schema_problem(sub, f"{where}.properties.{key}"):
                return problem
    required = schema.get("required")
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        return f"{where}.required must be a list of property names"
    for key in ("items", "additionalProperties", "not"):
        sub = schema.get(key)
        if sub is not None and (problem := _schema_problem(sub, f"{where}.{key}")):
            return problem
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        subs = schema.get(key)
        if subs is None:
            continue
        if not isinstance(subs, list):
            return f"{where}.{key} must be a list of schemas"
        for j, sub in enumerate(subs):
            if problem := _schema_problem(sub, f"{where}.{key}[{j}]"):
                return problem
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{where}.enum must be a list"
    return None


def check_fork(n: int) -> None:
    check_count("fork: n", n, MAX_FORK)


def check_close(msg: CloseSession) -> None:
    ids = msg.ids()
    if not ids:
        raise _invalid("close_session: name a `session` or a list of `sessions`")
    if len(ids) > MAX_CLOSE:
        raise _invalid(f"close_session: at most {MAX_CLOSE} sessions, got {len(ids)}")


def check_pin_name(name: str) -> None:
    if not name:
        raise _invalid("pin: the name must not be empty")


# ------------------------------------------------------------------- at the engine
def check_prompt(prompt_len: int, max_tokens: int, *, context_length: int, pool: int,
                 retained: int = 0, history_len: int = 0, what: str = "the prompt") -> None:
    """Refuse up front what can never run: an empty prompt, one beyond the context or the
    pool, or beyond the pool less what pins and hard sessions retain (`retained`; the
    request's own `history_len` aside)."""
    if prompt_len == 0:
        raise RequestError(ErrorCode.EMPTY_PROMPT, f"{what} is empty")
    total = prompt_len + max_tokens
    for limit, where in ((context_length, f"the context length ({context_length})"),
                         (pool, f"the KV pool ({pool} tokens)")):  # fmt: skip
        if total > limit:
            raise RequestError(
                ErrorCode.TOO_LONG,
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds {where}",
            )
    if total > pool - max(0, retained - history_len):
        raise RequestError(
            ErrorCode.CAPACITY,
            f"prompt + max_tokens ({total} tokens) cannot fit: pins and hard sessions "
            f"retain {retained} of the pool's {pool} tokens",
        )


def resolve_max_tokens(sampling: SamplingParams, prompt_len: int, *, context_length: int,
                       pool: int) -> SamplingParams:
    """``max_tokens`` None: what is left of the context (and of the KV pool) after the
    prompt -- at least 1, so a prompt that fills it all is refused as too long by
    `check_prompt`."""
    if sampling.max_tokens is not None:
        return sampling
    room = min(context_length, pool) - prompt_len
    return msgspec.structs.replace(sampling, max_tokens=max(1, room))


def check_prompt_logprobs_start(start: int | None, input_len: int, history_len: int = 0) -> None:
    """A position in the request's input, 0 up to its length (which asks for no values);
    with a session the input is what it appends, which only the engine knows, and a
    negative start counts back into the session's history (-k: its last k tokens)."""
    if start is not None and not -history_len <= start <= input_len:
        raise _invalid(f"prompt_logprobs_start ({start}) must be in [{-history_len}, {input_len}]"
                       + ("" if history_len else " (negative only into a session's history)"))


def check_truncate(length: int, history_len: int) -> None:
    if not 0 <= length <= history_len:
        raise _invalid(f"truncate: length must be in [0, {history_len}], got {length}")
