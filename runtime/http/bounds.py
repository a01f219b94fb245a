"""Bounds on what one request may hold, checked right after its body is decoded and before
anything is rendered, tokenized or sent to the engine: the number of messages (or input
items), tools and content parts, and the nesting of the free-form JSON it carries (tool
parameters, JSON schemas), so that no body within --max-body-bytes can make the server's
processes allocate or recurse far beyond its size."""

from __future__ import annotations

from typing import Any

import msgspec
from radixlm.runtime.http.config import HttpConfig
from radixlm.runtime.http.errors import ApiError

MAX_SCHEMA_DEPTH = 64  # nested objects and arrays in a schema (OpenAI allows 10 levels)


def _too_many(what: str, count: int, limit: int, flag: str, param: str) -> ApiError:
    return ApiError(400, f"{param} holds {count} {what}; at most {limit} are accepted "
                         f"({flag})", param=param, code="array_above_max_length")


def _depth(value: Any) -> int:
    """How deeply `value` nests (iteratively: no recursion however deep it is)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _check_schema(value: Any, param: str) -> None:
    if value is not None and _depth(value) > MAX_SCHEMA_DEPTH:
        raise ApiError(400, f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels",
                       param=param, code="invalid_value")


def _parts(message: Any) -> int:
    """Content parts and tool calls of one message or input item."""
    count = 0
    for name in ("content", "output", "tool_calls"):
        value = getattr(message, name, None)
        if isinstance(value, list):
            count += len(value)
    return count


def check_request(req: msgspec.Struct, config: HttpConfig) -> None:
    """Raise a 400 for a decoded body beyond the configured bounds."""
    for field in ("messages", "input", "items"):
        messages = getattr(req, field, None)
        if not isinstance(messages, list):
            continue
        if len(messages) > config.max_messages:
            raise _too_many("messages" if field == "messages" else "items", len(messages),
                            config.max_messages, "--max-messages", field)
        parts = sum(_parts(m) for m in messages)
        if parts > config.max_parts:
            raise _too_many("content parts and tool calls", parts, config.max_parts,
                            "--max-parts", field)
    tools = getattr(req, "tools", None)
    if tools:
        if len(tools) > config.max_tools:
            raise _too_many("tools", len(tools), config.max_tools, "--max-tools", "tools")
        for i, tool in enumerate(tools):
            function = getattr(tool, "function", tool)
            _check_schema(function.parameters, f"tools[{i}].parameters")
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.json_schema is not None:
        _check_schema(fmt.json_schema.schema, "response_format.json_schema.schema")
    text = getattr(req, "text", None)
    if text is not None and text.format is not None:
        _check_schema(text.format.schema, "text.format.schema")
