"""Shared by the HTTP API tests: a tool definition, and streamed tool calls put together
as OpenAI's clients do."""

from __future__ import annotations

from typing import Any

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}


def accumulate_calls(chunks: Any) -> list[dict[str, Any]]:
    """Streamed tool calls put together as OpenAI's clients do (by index)."""
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": "",
                                                "fragments": 0})
            if tc.id:
                assert entry["id"] is None, "a call's id comes once, first"
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                assert entry["name"] is not None, "the name comes before the arguments"
                entry["arguments"] += tc.function.arguments
                entry["fragments"] += 1
    return [calls[i] for i in sorted(calls)]
