"""Tool calls: how each model writes them, how it is shown functions, and what a
constrained call looks like. Pure functions over plain data: no torch, no engine.

The call formats are one table, `FORMATS` (chosen from the chat template by
`tool_format`):

- ``hermes``: the template renders ``tools`` itself and the model answers
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen2/2.5/3);
- ``llama3``: the template renders ``tools`` and the model answers a bare JSON object
  ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3; an optional ``<|python_tag|>``);
- ``generic``: the template knows no tools (SmolLM2, plain ChatML). radixlm then shows
  the functions in a system message (`generic_tool_prompt`) and the model answers a bare
  JSON object ``{"name": ..., "arguments": {...}}``.

Everything that shows a model its tools, constrains its calls or reads them back reads
this table: rendering here (`tool_dicts`, `generic_tool_prompt`, `template_messages`),
`call_schema` (the JSON Schema of one call: what ``tool_choice`` "required" or a named
function constrains the output to) framed by `call_frame`, and the one reader of calls,
`radixlm.tokenizer.call_parser`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "FORMATS",
    "CallFormat",
    "ToolFormat",
    "call_format",
    "call_frame",
    "call_schema",
    "framed_format",
    "generic_tool_prompt",
    "template_messages",
    "tool_dicts",
    "tool_format",
]

# -- the call formats -------------------------------------------------------------------

ToolFormat = Literal["hermes", "llama3", "generic"]


@dataclass(frozen=True)
class CallFormat:
    """One way of writing calls.

    `begin` / `end`: the markup around each call's JSON object in free text ("" for a bare
    object, whose answer is then only calls); `lead`: a tag that may come before a bare
    call answer; `args_key`: the key the model writes arguments under (the other common
    one is read too)."""

    name: ToolFormat
    args_key: str
    begin: str = ""
    end: str = ""
    lead: str = ""

    @property
    def frame(self) -> tuple[str, str]:
        """The fixed text around a constrained call's JSON (what the call grammar writes):
        the markup on lines of its own, as the templates that use it show it."""
        return (self.begin + "\n", "\n" + self.end) if self.begin else ("", "")

    @property
    def args_keys(self) -> tuple[str, ...]:
        """The keys read as a call's arguments, the format's own first."""
        return (self.args_key, *(k for k in ("arguments", "parameters") if k != self.args_key))


FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat("hermes", "arguments", begin="<tool_call>", end="</tool_call>"),
    "llama3": CallFormat("llama3", "parameters", lead="<|python_tag|>"),
    "generic": CallFormat("generic", "arguments"),
}


def call_format(fmt: ToolFormat | CallFormat) -> CallFormat:
    return fmt if isinstance(fmt, CallFormat) else FORMATS[fmt]


def tool_format(template_source: str | None) -> ToolFormat:
    """The call format a chat template implies: one that renders ``tools`` and mentions
    the Hermes markup is ``hermes``, one that asks for ``"parameters"`` (or has an
    ``ipython`` role) ``llama3``; a template that never mentions tools, ``generic``."""
    src = template_source or ""
    if "tools" not in src:
        return "generic"
    if FORMATS["hermes"].begin in src:
        return "hermes"
    return "llama3" if ('"parameters"' in src or "ipython" in src) else "hermes"


def framed_format(begin: str, end: str) -> CallFormat:
    """The format whose constrained calls a grammar frames with `begin` / `end` (the
    engine knows a call grammar by its frame only). Bare formats differ only in what a
    free answer may hold, never in a constrained call, so the generic one stands for
    them."""
    for fmt in FORMATS.values():
        if fmt.frame == (begin, end) and not fmt.lead:
            return fmt
    raise ValueError(f"no call format frames calls with {begin!r} ... {end!r}")


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
