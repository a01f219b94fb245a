"""docs/protocol.schema.json: current, deterministic, and true to the wire.

"True to the wire" is checked against the msgspec decoder that the engine itself uses:
for valid messages and for thousands of mutated ones, the committed schema and
`protocol.decode_client`/`decode_server` must agree on what is a valid message. The
validator below is a small, independent implementation of the JSON Schema keywords the
schema uses, with msgpack's typing (a float is never an "integer", a bool never a
number).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from message_mutations import mutated, nested_values
from radixlm.runtime import protocol
from radixlm.runtime.protocol_schema import protocol_schema, protocol_schema_json

REPO = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO / "docs" / "protocol.schema.json"
REGENERATE = "make schema"


def committed_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


# --- a minimal JSON Schema validator (the keywords protocol_schema() emits) -------------

_TYPE_CHECKS = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_KNOWN_KEYWORDS = {
    "$ref", "anyOf", "type", "enum", "properties", "required", "additionalProperties",
    "items", "prefixItems", "minItems", "maxItems", "discriminator", "title",
    "description", "default",
}  # fmt: skip


def schema_error(
    value: Any, schema: dict[str, Any], root: dict[str, Any], path: str = "$"
) -> str | None:
    """The first way ``value`` violates ``schema`` (None when it is valid)."""
    unknown = set(schema) - _KNOWN_KEYWORDS
    assert not unknown, f"validator does not implement {unknown} (at {path})"
    if "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/$defs/"), ref
        return schema_error(value, root["$defs"][ref.removeprefix("#/$defs/")], root, path)
    if "anyOf" in schema:
        errors = [schema_error(value, option, root, path) for option in schema["anyOf"]]
        if all(errors):
            return f"{path}: matches none of anyOf ({'; '.join(e for e in errors if e)})"
    if "type" in schema and not _TYPE_CHECKS[schema["type"]](value):
        return f"{path}: {value!r} is not of type {schema['type']}"
    if "enum" in schema and not any(value == e and type(value) is type(e) for e in schema["enum"]):
        return f"{path}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                return f"{path}: missing required {name!r}"
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in properties:
                error = schema_error(item, properties[name], root, f"{path}.{name}")
            elif extra is False:
                error = f"{path}: unexpected property {name!r}"
            elif isinstance(extra, dict):
                error = _TYPE_CHECKS["string"](name) or f"{path}: non-string key {name!r}"
                error = None if error is True else error
                error = error or schema_error(item, extra, root, f"{path}[{name!r}]")
            else:
                error = None
            if error:
                return error
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get(
            "maxItems", len(value)
        ):
            return f"{path}: {len(value)} items outside [{schema.get('minItems')}, {schema.get('maxItems')}]"
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            item_schema = prefix[i] if i < len(prefix) else schema.get("items")
            if item_schema is not None and (
                error := schema_error(item, item_schema, root, f"{path}[{i}]")
            ):
                return error
    return None


def decoder_accepts(decode: Any, value: Any) -> bool:
    try:
        decode(msgpack.packb(value))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    return True


# --- the committed file -------------------------------------------------------------


def test_committed_schema_is_current() -> None:
    assert SCHEMA_PATH.exists(), f"{SCHEMA_PATH} is missing: run `{REGENERATE}`"
    assert committed_schema() == protocol_schema(), (
        f"docs/protocol.schema.json is stale (runtime/protocol.py changed): run `{REGENERATE}` "
        "and commit the result"
    )
    assert SCHEMA_PATH.read_text() == protocol_schema_json(), (
        f"docs/protocol.schema.json is formatted differently from its generator: run `{REGENERATE}`"
    )


def test_schema_text_is_deterministic_across_processes() -> None:
    code = (
        "from radixlm.runtime.protocol_schema import protocol_schema_json as f; print(f(), end='')"
    )
    texts = {
        subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }  # fmt: skip
    assert texts == {protocol_schema_json()}


def test_cli_protocol_schema_prints_the_generated_schema() -> None:
    """`make schema` runs `radixlm protocol-schema`; it must print this module's schema."""
    out = subprocess.run(
        [sys.executable, "-m", "radixlm.runtime.cli", "protocol-schema"],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    assert out == protocol_schema_json()


def test_schema_names_every_message_and_error_code() -> None:
    schema = committed_schema()
    for union, types in (
        ("ClientMessage", protocol.ClientMessage),
        ("ServerMessage", protocol.ServerMessage),
    ):
        mapping = schema["$defs"][union]["discriminator"]["mapping"]
        tags = {t.__struct_config__.tag for t in types.__args__}
        assert set(mapping) == tags
    codes = {v for k, v in vars(protocol.ErrorCode).items() if not k.startswith("_")}
    assert set(schema["x-error-codes"]) == codes
    assert schema["x-protocol-version"] == protocol.PROTOCOL_VERSION


# --- schema and decoder agree ------------------------------------------------------------

VALID_CLIENT = [
    {"type": "hello", "protocol_version": 1},
    {"type": "hello", "protocol_version": 1, "client_name": "x"},
    {"type": "hello", "protocol_version": 1, "gateway": {"tenant": "k1", "token": "t"}},
    {"type": "generate", "rid": "r", "input": {"text": "hi"}},
    {
        "type": "generate", "rid": "r", "stream": True, "n": 2, "session": "s", "priority": 3,
        "namespace": "ns", "prompt_logprobs_start": 0,
        "input": {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
        "sampling": {
            "max_tokens": 4, "temperature": 0, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
            "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.1,
            "seed": 7, "stop": ["\n"], "stop_token_ids": [2], "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2,
        },
    },
    {"type": "generate", "rid": "r", "input": {"input_ids": [1, 2, 3]}, "sampling": {"seed": None}},
    {"type": "generate", "rid": "r", "sampling": {"json_schema": '{"type": "integer"}'},
     "input": {"messages": [
         {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "name": "add", "arguments": '{"a": 2, "b": 2}'}]},
         {"role": "tool", "content": "4", "tool_call_id": "c1", "name": "add"}]},
     "tools": [{"name": "add", "description": "a + b", "parameters": {
         "type": "object", "properties": {"a": {"type": "number"}}}}, {"name": "noop"}],
     "tool_choice": {"name": "add"}},
    {"type": "generate", "rid": "r", "input": {"text": "x"}, "tool_choice": "required",
     "sampling": {"regex": "[0-9]+", "ebnf": None}},
    {"type": "abort", "rid": "r"},
    {"type": "stats", "rid": "r"},
    {"type": "flush_cache", "rid": "r"},
    {"type": "open_session", "rid": "r"},
    {"type": "open_session", "rid": "r", "input": {"text": "sys"}, "retention": "soft", "ttl_s": 1.5},
    {"type": "open_session", "rid": "r", "pinned": "tools", "namespace": None},
    {"type": "open_session", "rid": "r", "durable": True},
    {"type": "resume_session", "rid": "r", "session": "s"},
    {"type": "tool_done_soon", "rid": "r", "session": "s"},
    {"type": "fork_session", "rid": "r", "session": "s", "n": 3},
    {"type": "truncate_session", "rid": "r", "session": "s", "length": 4},
    {"type": "close_session", "rid": "r", "session": "s"},
    {"type": "pin", "rid": "r", "name": "tools", "input": {"text": "You can call tools."}},
    {"type": "unpin", "rid": "r", "name": "tools"},
    {"type": "list_sessions", "rid": "r"},
    {"type": "tokenize", "rid": "r", "input": {"input_ids": []}},
    {"type": "detokenize", "rid": "r", "token_ids": [1, 2]},
]  # fmt: skip

USAGE = {"prompt_tokens": 5, "cached_tokens": 3, "completion_tokens": 2}
VALID_SERVER = [
    {"type": "welcome", "protocol_version": 1, "server_version": "0.1.0", "model": "m",
     "context_length": 64, "page_size": 1, "kv_capacity": 1024},
    {"type": "chunk", "rid": "r", "text": "a", "token_ids": [1]},
    {"type": "chunk", "rid": "r", "text": "", "token_ids": [1, 2], "logprobs": [-0.1, -2.0],
     "top_logprobs": [[[1, -0.1], [3, -2.5]], [[2, -2.0]]], "index": 1},
    {"type": "done", "rid": "r", "finish_reason": "stop", "text": "ab", "token_ids": [1, 2],
     "usage": USAGE, "matched_stop": 2},
    {"type": "done", "rid": "r", "finish_reason": "length", "text": "", "token_ids": [],
     "usage": {**USAGE, "recomputed_tokens": 4, "restored_tokens": 1}, "matched_stop": "\n",
     "prompt_logprobs": [-1.0], "prompt_top_logprobs": [[[5, -1.0]]], "session": "s",
     "session_length": 9, "index": 0},
    {"type": "done", "rid": "r", "finish_reason": "stop", "text": "<tool_call>...",
     "token_ids": [1], "usage": USAGE,
     "tool_calls": [{"id": "call_0", "name": "f", "arguments": "{}"}]},
    {"type": "error", "rid": None, "code": "bad_message", "message": "not msgpack"},
    {"type": "ok", "rid": "r"},
    {"type": "stats_reply", "rid": "r", "capacity": 10, "free": 4, "evictable": 3, "protected": 3,
     "private": 0, "retained_tokens": {"hard": 3}, "retained_cap": 5, "host_capacity": 0,
     "host_used": 0, "sessions": 1, "pins": 0, "running": 0, "waiting": 0,
     "prompt_tokens_total": 9, "cached_tokens_total": 3, "hit_rate": 0.33, "invariant_ok": True,
     "generated_tokens_total": 4, "retractions": 1, "fair_preemptions": 1, "capped_steps": 2,
     "finish_reasons": {"stop": 2}, "latency": {"e2e_request_latency": {
         "bounds": [0.5, 1.0], "counts": [1, 1, 0], "sum": 1.2, "count": 2}}},
    {"type": "session_opened", "rid": "r", "session": "s", "length": 0},
    {"type": "session_opened", "rid": "r", "session": "s", "length": 9, "durable": True},
    {"type": "sessions_forked", "rid": "r", "sessions": ["a", "b"]},
    {"type": "pinned", "rid": "r", "name": "tools", "length": 12},
    {"type": "session_list", "rid": "r", "sessions": [
        {"session": "s", "length": 3, "idle_s": 0.5, "retention": "demoted", "busy": False},
        {"session": "t", "length": 3, "idle_s": 9.0, "retention": "soft", "busy": False,
         "durable": True, "attached": False}]},
    {"type": "tokens", "rid": "r", "input_ids": [1, 2]},
    {"type": "detokenized", "rid": "r", "text": "hi"},
]  # fmt: skip


# Each direction: its union's name in the schema, valid messages of it, its decoder.
BOTH_DIRECTIONS = pytest.mark.parametrize(("union", "messages", "decode"), [
    ("ClientMessage", VALID_CLIENT, protocol.decode_client),
    ("ServerMessage", VALID_SERVER, protocol.decode_server),
])


@BOTH_DIRECTIONS
def test_valid_messages_pass_schema_and_decoder(
    union: str, messages: list[dict], decode: Any
) -> None:
    schema = committed_schema()
    for message in messages:
        assert decoder_accepts(decode, message), message
        assert schema_error(message, schema["$defs"][union], schema) is None, message
    tags = {m["type"] for m in messages}
    assert tags == set(schema["$defs"][union]["discriminator"]["mapping"]), "cover every message"


# Values a field may be mutated to: every msgpack type, edge numbers, nested garbage.
_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_scalars = st.one_of(
    st.none(), st.booleans(), _INT64, st.floats(allow_nan=False), st.text(max_size=8),
    st.sampled_from(["hard", "soft", "stop", "user", "generate", "r", ""]),
)  # fmt: skip
_values = nested_values(_scalars, max_size=3, max_leaves=6)
_ADDED_KEYS = ["extra", "rid", "n", "type", "input", "text", "x"]


@BOTH_DIRECTIONS
def test_schema_and_decoder_agree_on_mutated_messages(
    union: str, messages: list[dict], decode: Any
) -> None:
    schema = committed_schema()
    union_schema = schema["$defs"][union]

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mutated(messages, _values, _ADDED_KEYS, (1, 3)))
    def agree(message: dict) -> None:
        error = schema_error(message, union_schema, schema)
        assert decoder_accepts(decode, message) == (error is None), (message, error)

    agree()
