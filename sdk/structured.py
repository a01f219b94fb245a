"""Structured-output arguments as the SDK accepts them, turned into protocol values:
JSON Schemas (text, dict or pydantic model class), tools (protocol `Tool`s, OpenAI-style
function dicts or plain ``{name, description, parameters}`` dicts) and ``tool_choice``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from radixlm.runtime.protocol import NamedToolChoice, Tool, ToolCall

__all__ = ["pop_tool_options", "schema_text", "to_tool_calls", "to_tool_choice", "to_tools"]


def schema_text(schema: Any) -> str | None:
    """A JSON Schema as the JSON text the protocol carries (None stays None)."""
    if schema is None or isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        return json.dumps(schema)
    dump = getattr(schema, "model_json_schema", None)  # a pydantic (v2) model class
    if isinstance(schema, type) and callable(dump):
        return json.dumps(dump())
    raise TypeError(
        f"json_schema must be a JSON text, a dict or a pydantic model class, got {schema!r}")


def _tool(spec: Any) -> Tool:
    if isinstance(spec, Tool):
        return spec
    if isinstance(spec, dict):
        fn = spec.get("function", spec) if spec.get("type", "function") == "function" else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters", {"type": "object"})
            return Tool(name=fn["name"], description=fn.get("description", "") or "",
                        parameters=params)
    raise TypeError(f"a tool must be a Tool, {{'name', 'parameters'...}} or OpenAI's "
                    f"{{'type': 'function', 'function': {{...}}}}, got {spec!r}")


def to_tools(tools: Sequence[Any] | None) -> list[Tool] | None:
    return None if tools is None else [_tool(t) for t in tools]


def to_tool_choice(choice: Any) -> str | NamedToolChoice:
    """"auto" / "none" / "required", a function name's `NamedToolChoice`, or OpenAI's
    ``{"type": "function", "function": {"name": ...}}``."""
    if isinstance(choice, NamedToolChoice) or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        fn = choice.get("function", choice)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return NamedToolChoice(name=fn["name"])
    raise TypeError(f"tool_choice must be 'auto', 'none', 'required' or a named function, "
                    f"got {choice!r}")


def to_tool_calls(calls: Sequence[Any] | None) -> list[ToolCall] | None:
    """`ToolCall`s from themselves, ``{id, name, arguments}`` or OpenAI's ``{id, type,
    function: {name, arguments}}`` dicts (arguments as JSON text or an object)."""
    if calls is None:
        return None
    out = []
    for c in calls:
        if isinstance(c, ToolCall):
            out.append(c)
            continue
        fn = c.get("function", c)
        args = fn.get("arguments", {})
        out.append(ToolCall(id=c.get("id", ""), name=fn["name"],
                            arguments=args if isinstance(args, str) else json.dumps(args)))
    return out


def pop_tool_options(options: dict[str, Any]) -> dict[str, Any]:
    """Take ``tools`` and ``tool_choice`` out of keyword options (they travel with the
    sampling keywords of `generate`, `stream` and chat `send`) as `Generate` fields."""
    tools = to_tools(options.pop("tools", None))
    choice = to_tool_choice(options.pop("tool_choice", None) or "auto")
    return {"tools": tools, "tool_choice": choice}
