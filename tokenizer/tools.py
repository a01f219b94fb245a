"""Tool calls: how a model is shown functions, how its calls look, how they are parsed.

Three formats, chosen from the chat template (`tool_format`):

- ``hermes``: the template renders ``tools`` itself and the model answers
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen2/2.5/3);
- ``llama3``: the template renders ``tools`` and the model answers a bare JSON object
  ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3; an optional ``<|python_tag|>``);
- ``generic``: the template knows no tools (SmolLM2, plain ChatML). radixlm then shows
  the functions in a system message (`generic_tool_prompt`) and the model answers a bare
  JSON object ``{"name": ..., "arguments": {...}}``.

`call_schema` is the JSON Schema of one call in a format (what ``tool_choice``
"required" or a named function constrains the output to); `parse_tool_calls` reads the
calls back out of an output text. Pure functions over plain data: no torch, no engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ParsedCall",
    "ToolFormat",
    "call_frame",
    "call_schema",
    "check_tools",
    "generic_tool_prompt",
    "parse_tool_calls",
    "template_messages",
    "tool_format",
]

ToolFormat = Literal["hermes", "llama3", "generic"]

_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


def tool_format(template_source: str | None) -> ToolFormat:
    """The call format a chat template implies (see the module docstring)."""
    src = template_source or ""
    if "tools" not in src:
        return "generic"
    if "<tool_call>" in src:
        return "hermes"
    return "llama3" if ('"parameters"' in src or "ipython" in src) else "hermes"


# -- checks ---------------------------------------------------------------------------


def check_tools(tools: Sequence[Any]) -> str | None:
    """The first problem with `tools` (objects with name/description/parameters), or None.

    ``parameters`` must be a JSON Schema object schema: a map whose ``type`` (if given)
    is "object", whose ``properties`` map names to schemas and whose ``required`` names
    only strings; every nested schema must be a map (or a boolean) with known ``type``s.
    """
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.name
        if not _NAME.match(name):
            return f"tools[{i}].name {name!r} must be 1-64 letters, digits, '_', '.' or '-'"
        if name in seen:
            return f"tools[{i}].name {name!r} is given twice"
        seen.add(name)
        params = tool.parameters
        if params.get("type", "object") != "object":
            return f"tools[{i}] ({name}).parameters must be an object schema, got type {params['type']!r}"
        problem = _schema_problem(params, f"tools[{i}] ({name}).parameters")
        if problem:
            return problem
    return None


def _schema_problem(schema: Any, where: str) -> str | None:
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} must be a JSON Schema (a map), got {type(schema).__name__}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
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
    args_key = "parameters" if fmt == "llama3" else "arguments"
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
    return ("<tool_call>\n", "\n</tool_call>") if fmt == "hermes" else ("", "")


# -- parsing -------------------------------------------------------------------------------


def parse_tool_calls(text: str, fmt: ToolFormat, tools: Sequence[Any]) -> list[ParsedCall] | None:
    """The calls of known tools in `text`, or None when it holds none (plain text).

    A call whose JSON does not parse, or names no tool of `tools`, is not a call: the
    output then stays plain text for the client to read.
    """
    names = {t.name for t in tools}
    if fmt == "hermes":
        blobs = _HERMES_CALL.findall(text)
        args_keys = ("arguments", "parameters")
    else:
        body = text.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG):].strip()
        blobs = _json_objects(body)
        args_keys = ("parameters", "arguments") if fmt == "llama3" else ("arguments", "parameters")
    calls = []
    for blob in blobs:
        call = _call_from(blob, names, args_keys)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _json_objects(body: str) -> list[str]:
    """`body` as one JSON object, or several separated by ';' or newlines."""
    if not body.startswith("{"):
        return []
    decoder = json.JSONDecoder()
    out, pos = [], 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return out if out else [body]  # let _call_from reject it
        out.append(body[pos:end])
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if pos < len(body) and body[pos] != "{":
            return []  # text after the calls: not a pure call answer
    return out


def _call_from(blob: str, names: set[str], args_keys: tuple[str, ...]) -> ParsedCall | None:
    try:
        obj = json.loads(blob)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
