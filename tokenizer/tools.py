"""Tool calls: how a model is shown functions and what a constrained call looks like.

The call formats (how each model writes calls, chosen from its chat template) are one
table, `radixlm.tokenizer.call_formats`; calls are read back out of an output by one
parser, `radixlm.tokenizer.call_parser`. Here: rendering -- tools as chat templates take
them (`tool_dicts`), the generic format's system prompt (`generic_tool_prompt`),
messages with calls (`template_messages`) -- and `call_schema`, the JSON Schema of one
call in a format (what ``tool_choice`` "required" or a named function constrains the
output to), framed by `call_frame`. Pure functions over plain data: no torch, no engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from radixlm.tokenizer.call_formats import FORMATS, ToolFormat, tool_format

__all__ = [
    "ToolFormat",
    "call_frame",
    "call_schema",
    "generic_tool_prompt",
    "template_messages",
    "tool_dicts",
    "tool_format",
]


# -- rendering ------------------------------------------------------------------------


def tool_dicts(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """Tools as HF chat templates take them (OpenAI's function-tool shape)."""
    return [
        {"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools
    ]  # fmt: skip


def generic_tool_prompt(tools: Sequence[Any]) -> str:
    """The system text that shows `tools` to a model whose template has no tool support."""
    lines = [
        "You can call functions. To call one, answer with only a JSON object "
        '{"name": <function name>, "arguments": <arguments object>} and nothing else.',
        "Functions:",
    ]
    for t in tools:
        lines.append(json.dumps(
            {"name": t.name, "description": t.description, "parameters": t.parameters},
            ensure_ascii=False))  # fmt: skip
    return "\n".join(lines)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def template_messages(messages: Sequence[Any], fmt: ToolFormat, tools: Sequence[Any] | None,
                      with_tools_prompt: bool) -> list[dict[str, Any]]:
    """`messages` as dicts for the chat template: tool calls in HF's shape (arguments
    as objects); in the generic format an assistant call is written out as its JSON and,
    if asked, the tool prompt joins (or becomes) the leading system message."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role}
        for key in ("content", "tool_call_id", "name"):
            if getattr(m, key) is not None:
                d[key] = getattr(m, key)
        calls = m.tool_calls or []
        if calls and fmt == "generic":
            text = "\n".join(
                json.dumps({"name": c.name, "arguments": _arguments(c.arguments)}, ensure_ascii=False)
                for c in calls)  # fmt: skip
            d["content"] = (d.get("content") or "") + text
        elif calls:
            d["tool_calls"] = [
                {"type": "function", "id": c.id,
                 "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                for c in calls
            ]  # fmt: skip
            d.setdefault("content", "")
        out.append(d)
    if with_tools_prompt and tools and fmt == "generic":
        prompt = generic_tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content', '')}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- constrained calls ------------------------------------------------------------------


def _one_call(tool: Any, fmt: ToolFormat) -> dict[str, Any]:
    args_key = FORMATS[fmt].args_key
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: tool.parameters},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def call_schema(tools: Sequence[Any], fmt: ToolFormat) -> str:
    """JSON Schema (as text) of one call of any of `tools` in format `fmt`."""
    options = [_one_call(t, fmt) for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return json.dumps(schema, ensure_ascii=False)


def call_frame(fmt: ToolFormat) -> tuple[str, str]:
    """The fixed text around a constrained call's JSON: (begin, end)."""
    return FORMATS[fmt].frame
