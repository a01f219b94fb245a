"""OpenAI request fields -> protocol fields: messages, tools, sampling, output formats.

Everything here is pure data mapping; the routes call it and send the result.
"""

from __future__ import annotations

import json
from typing import Any, Union

import msgspec
from radixlm.runtime.http.errors import ApiError, invalid
from radixlm.runtime.http.items import ROLES, text_of
from radixlm.runtime.http.schemas import (
    ChatMessage,
    ChatTool,
    ChatToolChoice,
    ResponseFormat,
    ResponseTool,
    ResponseToolChoice,
    SamplingExtras,
    TextFormat,
)
from radixlm.runtime.protocol import (
    MAX_N,
    Message,
    NamedToolChoice,
    SamplingParams,
    Tool,
    ToolCall,
)

# A JSON object of any shape: what response_format json_object constrains to.
ANY_OBJECT_SCHEMA = {"type": "object"}
ToolChoice = Union[str, NamedToolChoice]


def chat_messages(messages: list[ChatMessage]) -> list[Message]:
    """OpenAI chat messages -> protocol messages (tool calls and tool answers included)."""
    if not messages:
        raise invalid("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        role = ROLES.get(m.role)
        if role is None:
            raise invalid(f"messages[{i}].role must be one of {sorted(ROLES)}, got {m.role!r}",
                          f"messages[{i}].role")
        calls = None
        if m.tool_calls:
            calls = [ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                     for c in m.tool_calls]
        content = text_of(m.content, f"messages[{i}]")
        if content is None and calls is None:
            raise invalid(f"messages[{i}] has no content", f"messages[{i}].content")
        out.append(Message(role=role, content=content, tool_calls=calls,
                           tool_call_id=m.tool_call_id, name=m.name if role == "tool" else None))
    return out


def system_prompt(instructions: str | None) -> list[Message]:
    """Responses ``instructions``: the system message that starts the prompt."""
    return [Message(role="system", content=instructions)] if instructions else []


def chat_tools(tools: list[ChatTool] | None, choice: str | ChatToolChoice | None) -> tuple[list[Tool] | None, ToolChoice]:
    defs = None
    if tools:
        for i, t in enumerate(tools):
            if t.type != "function":
                raise invalid(f"tools[{i}].type must be 'function'", f"tools[{i}].type")
        defs = [Tool(name=t.function.name, description=t.function.description or "",
                     parameters=t.function.parameters or dict(ANY_OBJECT_SCHEMA)) for t in tools]
    named = choice.function.name if isinstance(choice, ChatToolChoice) else None
    return defs, _tool_choice(choice, named, defs)


def response_tools(tools: list[ResponseTool] | None, choice: str | ResponseToolChoice | None) -> tuple[list[Tool] | None, ToolChoice]:
    defs = None
    if tools:
        for i, t in enumerate(tools):
            if t.type != "function":
                raise invalid(f"tools[{i}].type {t.type!r} is not supported (only 'function')",
                              f"tools[{i}].type")
        defs = [Tool(name=t.name, description=t.description or "",
                     parameters=t.parameters or dict(ANY_OBJECT_SCHEMA)) for t in tools]
    named = choice.name if isinstance(choice, ResponseToolChoice) else None
    if isinstance(choice, ResponseToolChoice) and not named:
        raise invalid("tool_choice needs the function's name", "tool_choice")
    return defs, _tool_choice(choice, named, defs)


def _tool_choice(choice: object, named: str | None, defs: list[Tool] | None) -> ToolChoice:
    if named is not None:
        if defs is None:
            raise invalid("tool_choice names a function but no tools were given", "tool_choice")
        return NamedToolChoice(name=named)
    if choice is None:
        return "auto"
    if choice not in ("auto", "none", "required"):
        raise invalid(f"tool_choice must be 'auto', 'none', 'required' or a named function, "
                      f"got {choice!r}", "tool_choice")
    if choice == "required" and defs is None:
        raise invalid("tool_choice 'required' needs tools", "tool_choice")
    return choice  # type: ignore[return-value]


def chat_json_schema(fmt: ResponseFormat | None) -> str | None:
    """response_format -> the JSON Schema text the engine constrains to (None: free text)."""
    if fmt is None:
        return None
    spec = fmt.json_schema
    return _json_schema(fmt.type, spec.schema if spec else None, "response_format")


def text_json_schema(fmt: TextFormat | None) -> str | None:
    """Responses ``text.format`` -> the JSON Schema text (None: free text)."""
    return None if fmt is None else _json_schema(fmt.type, fmt.schema, "text.format")


def _json_schema(kind: str, schema: dict[str, Any] | None, param: str) -> str | None:
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps(ANY_OBJECT_SCHEMA)
    if kind == "json_schema":
        if schema is None:
            where = f"{param}.json_schema" if param == "response_format" else f"{param}.schema"
            raise invalid(f"{param} json_schema needs a schema", where)
        return json.dumps(schema)
    raise invalid(f"{param}.type must be text, json_object or json_schema, got {kind!r}",
                  f"{param}.type")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise invalid("at most 16 stop sequences", "stop")
    return [s for s in stops if s]


def sampling(req: SamplingExtras, *, max_tokens: int | None, stop: list[str], logprobs: bool = False,
             top_logprobs: int = 0, json_schema: str | None = None) -> SamplingParams:
    """The engine's SamplingParams; the engine validates ranges and names the bad field."""
    given: dict[str, Any] = {
        name: getattr(req, name)
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                     "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
        if getattr(req, name) is not None
    }
    try:
        return SamplingParams(max_tokens=max_tokens, stop=stop, logprobs=logprobs,
                              top_logprobs=top_logprobs, json_schema=json_schema, **given)
    except (TypeError, msgspec.ValidationError) as e:
        raise ApiError(400, f"invalid sampling options: {e}") from None


def n_of(value: int | None) -> int:
    if value is None:
        return 1
    if not 1 <= value <= MAX_N:
        raise invalid(f"n must be in [1, {MAX_N}], got {value}", "n")
    return value


def max_tokens_of(value: int | None, default: int | None, param: str) -> int | None:
    if value is None:
        return default
    if value < 0:
        raise invalid(f"{param} must be >= 0, got {value}", param)
    return value
