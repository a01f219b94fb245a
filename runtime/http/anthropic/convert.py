"""Messages API request -> protocol data: messages, tools, tool_choice, sampling, and the
request's cache breakpoints.

- ``system`` (a string or text blocks) is the system message; text blocks of one message
  are joined by a blank line (`JOIN`).
- A user message's ``tool_result`` blocks are ``tool`` messages answering their
  ``tool_use_id`` (a result marked ``is_error`` reads ``Error: ...``), in the order given;
  its text blocks a user message. An assistant message's ``tool_use`` blocks are its
  calls. ``thinking`` / ``redacted_thinking`` blocks of earlier turns are left out of the
  prompt (as Anthropic drops earlier turns' thinking from the context).
- Refused with a 400 naming the block or tool type: images, documents, search results,
  citations, server tools and their blocks (web search, code execution, MCP, ...), and a
  final assistant message (prefill). Server-side message threads (``thread``) are refused
  as Anthropic refuses a thread it cannot serve (``thread_unsupported_request``): its SDK's
  tool runner then sends the whole conversation, as it does to any server without them.
- **Blocks** are counted in Anthropic's order -- each tool, each system block, each
  message's content blocks (a string is one) -- and a block with ``cache_control`` is a
  `Breakpoint`: the prompt up to and including it (`Cut`), held for its TTL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Union

from radixlm.runtime.http.anthropic.errors import DetailedError
from radixlm.runtime.http.anthropic.schemas import (
    Block,
    CacheControl,
    InputMessage,
    MessagesRequest,
    ToolDef,
)
from radixlm.runtime.http.bounds import MAX_SCHEMA_DEPTH, _depth
from radixlm.runtime.http.config import HttpConfig
from radixlm.runtime.http.errors import ApiError, invalid
from radixlm.runtime.protocol import Message, NamedToolChoice, SamplingParams, Tool, ToolCall

JOIN = "\n\n"  # between text blocks of one message (and of the system prompt)
MAX_BREAKPOINTS = 4  # Anthropic's limit of blocks with cache_control per request
MAX_STOP_SEQUENCES = 64
TTL_S = {None: 300.0, "5m": 300.0, "1h": 3600.0}
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
MIN_THINKING_BUDGET = 1024  # Anthropic's minimum budget_tokens
ToolChoiceValue = Union[str, NamedToolChoice]

# Block types of Anthropic's API that radixlm does not serve: a clear 400 each.
_UNSERVED = {
    "image": "images", "document": "documents", "search_result": "search results",
    "container_upload": "container uploads",
}


@dataclass(frozen=True)
class Cut:
    """Where a request is cut to get a breakpoint's prefix: after ``tools[index]``, after
    system block `index`, or after block `block` of ``messages[index]``."""

    section: str  # "tools", "system" or "messages"
    index: int
    block: int = 0


@dataclass(frozen=True)
class Breakpoint:
    block: int  # the block's position in the request (tools, system, messages)
    ttl_s: float
    cut: Cut


@dataclass
class Prompt:
    """What the model is shown: the messages and tools a chat template renders."""

    messages: list[Message]
    tools: list[Tool] | None


@dataclass
class Converted:
    prompt: Prompt
    breakpoints: list[Breakpoint]
    blocks: int  # blocks in the request
    tool_choice: ToolChoiceValue
    parallel: bool
    thinking_shown: bool  # False: thinking display "omitted" (blocks sent empty)


def _refuse(kind: str, where: str) -> ApiError:
    what = _UNSERVED.get(kind)
    if what is not None:
        return invalid(f"{where}: {kind} blocks are not supported (radixlm serves text; "
                       f"{what} are refused)", where)
    return invalid(f"{where}: content blocks of type {kind!r} are not supported here (text, "
                   "tool_use, tool_result and thinking are)", where)


def _ttl(cc: CacheControl, where: str) -> float:
    if cc.type != "ephemeral":
        raise invalid(f"{where}.cache_control.type must be 'ephemeral', got {cc.type!r}",
                      f"{where}.cache_control.type")
    if cc.ttl not in TTL_S:
        raise invalid(f"{where}.cache_control.ttl must be '5m' or '1h', got {cc.ttl!r}",
                      f"{where}.cache_control.ttl")
    return TTL_S[cc.ttl]


def _check_text(block: Block, where: str) -> str:
    if block.citations:
        raise invalid(f"{where}: citations are not supported", f"{where}.citations")
    if not block.text:
        raise invalid(f"{where}: text content blocks must be non-empty", f"{where}.text")
    return block.text


# -- tools ------------------------------------------------------------------------------


def tools_of(tools: list[ToolDef] | None) -> list[Tool] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if t.type not in (None, "custom"):
            raise invalid(f"{where}: server tools (type {t.type!r}) are not supported; "
                          "radixlm serves custom tools (name, description, input_schema)",
                          f"{where}.type")
        if not t.name:
            raise invalid(f"{where}.name is required", f"{where}.name")
        if t.input_schema is None:
            raise invalid(f"{where}.input_schema is required", f"{where}.input_schema")
        out.append(Tool(name=t.name, description=t.description or "",
                        parameters=t.input_schema))
    return out


def tool_choice_of(req: MessagesRequest, tools: list[Tool] | None) -> tuple[ToolChoiceValue, bool]:
    """(the protocol's tool_choice, whether several calls may be made at once)."""
    choice = req.tool_choice
    if choice is None:
        return "auto", True
    parallel = not choice.disable_parallel_tool_use
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    if choice.type == "tool":
        if not choice.name:
            raise invalid("tool_choice of type 'tool' needs the tool's name", "tool_choice.name")
        if tools is None:
            raise invalid("tool_choice names a tool but no tools were given", "tool_choice")
        return NamedToolChoice(name=choice.name), parallel
    if choice.type not in kinds:
        raise invalid(f"tool_choice.type must be auto, any, tool or none, got {choice.type!r}",
                      "tool_choice.type")
    if choice.type == "any" and tools is None:
        raise invalid("tool_choice 'any' needs tools", "tool_choice")
    return kinds[choice.type], parallel


# -- messages ---------------------------------------------------------------------------


def system_message(system: str | list[Block] | None) -> list[Message]:
    if system is None:
        return []
    if isinstance(system, str):
        return [Message(role="system", content=system)] if system else []
    texts = []
    for i, block in enumerate(system):
        if block.type != "text":
            raise _refuse(block.type, f"system[{i}]")
        texts.append(_check_text(block, f"system[{i}]"))
    return [Message(role="system", content=JOIN.join(texts))] if texts else []


def _result_text(block: Block, where: str) -> str:
    content = block.content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if part.type != "text":
                raise _refuse(part.type, f"{where}.content[{k}]")
            parts.append(_check_text(part, f"{where}.content[{k}]"))
        text = JOIN.join(parts)
    else:
        text = content or ""
    if block.is_error:
        return f"Error: {text}" if text else "Error"
    return text


def _user(blocks: list[Block], where: str, names: dict[str, str]) -> list[Message]:
    out: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            texts.append(_check_text(block, at))
        elif block.type == "tool_result":
            if not block.tool_use_id:
                raise invalid(f"{at}: a tool_result needs tool_use_id", f"{at}.tool_use_id")
            if texts:
                out.append(Message(role="user", content=JOIN.join(texts)))
                texts = []
            out.append(Message(role="tool", content=_result_text(block, at),
                               tool_call_id=block.tool_use_id,
                               name=names.get(block.tool_use_id)))
        else:
            raise _refuse(block.type, at)
    if texts:
        out.append(Message(role="user", content=JOIN.join(texts)))
    return out


def _assistant(blocks: list[Block], where: str, names: dict[str, str]) -> list[Message]:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            texts.append(_check_text(block, at))
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise invalid(f"{at}: a tool_use needs id and name", at)
            if not isinstance(block.input, dict):
                raise invalid(f"{at}.input must be an object", f"{at}.input")
            names[block.id] = block.name
            calls.append(ToolCall(id=block.id, name=block.name,
                                  arguments=json.dumps(block.input, ensure_ascii=False)))
        elif block.type not in ("thinking", "redacted_thinking"):
            raise _refuse(block.type, at)
    if not texts and not calls:
        return []  # thinking only: nothing the template shows
    return [Message(role="assistant", content=JOIN.join(texts) if texts else None,
                    tool_calls=calls or None)]


def messages_of(messages: list[InputMessage], *, final: bool = True) -> list[Message]:
    """Anthropic messages -> protocol messages. `final`: these are the whole request's
    (its last one must be the user's); a breakpoint's prefix may end anywhere."""
    if final and not messages:
        raise invalid("messages must not be empty", "messages")
    out: list[Message] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results' messages
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        blocks = _blocks(m)
        if m.role == "user":
            if isinstance(m.content, str) and not m.content:
                raise invalid(f"{where}: user messages must have non-empty content",
                              f"{where}.content")
            if not blocks:
                raise invalid(f"{where}: user messages must have non-empty content",
                              f"{where}.content")
            out += _user(blocks, where, names)
        elif m.role == "assistant":
            out += _assistant(blocks, where, names)
        else:
            raise invalid(f"{where}.role must be 'user' or 'assistant', got {m.role!r} (the "
                          "system prompt is the top-level system field)", f"{where}.role")
    if final and messages[-1].role != "user":
        raise invalid("the last message must be the user's: a final assistant message "
                      "(prefill) is not supported", f"messages[{len(messages) - 1}].role")
    return out


def _blocks(m: InputMessage) -> list[Block]:
    if isinstance(m.content, str):
        return [Block(type="text", text=m.content)] if m.content else []
    return m.content


# -- breakpoints ------------------------------------------------------------------------


def breakpoints_of(req: MessagesRequest) -> tuple[list[Breakpoint], int]:
    """The request's breakpoints in block order, and its number of blocks. Checked as
    Anthropic checks them: at most 4, ``ttl`` '5m' or '1h', no 1h after a 5m one, none on
    a thinking block."""
    found: list[Breakpoint] = []
    count = 0

    def mark(cc: CacheControl | None, cut: Cut, where: str) -> None:
        if cc is not None:
            found.append(Breakpoint(count, _ttl(cc, where), cut))

    for i, tool in enumerate(req.tools or ()):
        mark(tool.cache_control, Cut("tools", i), f"tools[{i}]")
        count += 1
    if isinstance(req.system, list):
        for i, block in enumerate(req.system):
            mark(block.cache_control, Cut("system", i), f"system[{i}]")
            count += 1
    elif req.system:
        count += 1
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            count += 1
            continue
        for j, block in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            cc = block.cache_control
            if cc is None and isinstance(block.content, list):  # on a tool_result's part
                cc = next((p.cache_control for p in block.content if p.cache_control), None)
            if cc is not None and block.type in ("thinking", "redacted_thinking"):
                raise invalid(f"{where}: thinking blocks cannot be marked with cache_control "
                              "(they are cached as part of the turn)", f"{where}.cache_control")
            mark(cc, Cut("messages", i, j), where)
            count += 1
    if req.cache_control is not None and req.messages:  # automatic: the last block
        last = len(req.messages) - 1
        content = req.messages[last].content
        j = 0 if isinstance(content, str) else max(len(content) - 1, 0)
        if not found or found[-1].block != count - 1:
            found.append(Breakpoint(count - 1, _ttl(req.cache_control, "cache_control"),
                                    Cut("messages", last, j)))
    if len(found) > MAX_BREAKPOINTS:
        raise invalid(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                      f"provided. Found {len(found)}.", "cache_control")
    for a, b in zip(found, found[1:], strict=False):
        if b.ttl_s > a.ttl_s:
            raise invalid("a cache_control with ttl '1h' cannot come after one with ttl '5m' "
                          "(longer TTLs first: tools, system, messages)", "cache_control")
    return found, count


def prefix_of(req: MessagesRequest, cut: Cut) -> Prompt:
    """The prompt up to and including the block `cut` names (no final-message rule)."""
    tools = tools_of(req.tools)
    if cut.section == "tools":
        return Prompt([], tools[: cut.index + 1] if tools else None)
    system = req.system
    if cut.section == "system":
        assert isinstance(system, list)
        return Prompt(system_message(system[: cut.index + 1]), tools)
    kept = list(req.messages[: cut.index])
    m = req.messages[cut.index]
    if not isinstance(m.content, str):
        m = InputMessage(role=m.role, content=m.content[: cut.block + 1])
    return Prompt(system_message(system) + messages_of([*kept, m], final=False), tools)


# -- the whole request ------------------------------------------------------------------


def check_bounds(req: MessagesRequest, config: HttpConfig) -> None:
    """What the shared bounds do not see: tool results' nested parts, and schemas."""
    parts = sum(len(b.content) for m in req.messages if isinstance(m.content, list)
                for b in m.content if isinstance(b.content, list))
    if parts > config.max_parts:
        raise ApiError(400, f"messages hold {parts} tool result parts; at most "
                            f"{config.max_parts} are accepted (--max-parts)",
                       param="messages", code="array_above_max_length")
    fmt = output_format(req)
    if fmt is not None and fmt.schema is not None and _depth(fmt.schema) > MAX_SCHEMA_DEPTH:
        raise invalid(f"output_config.format.schema nests deeper than {MAX_SCHEMA_DEPTH} "
                      "levels", "output_config.format.schema")


def output_format(req: MessagesRequest) -> Any:
    if req.output_config is not None and req.output_config.format is not None:
        return req.output_config.format
    return req.output_format


def convert(req: MessagesRequest) -> Converted:
    """The request's prompt, breakpoints and tool settings (400s for what is refused)."""
    if req.mcp_servers:
        raise invalid("mcp_servers are not supported (a server-side feature): give the "
                      "tools as custom tools", "mcp_servers")
    if req.container is not None:
        raise invalid("container is not supported (code execution is a server tool)",
                      "container")
    if req.thread is not None:
        raise DetailedError(400, "message threads are not supported: send the whole "
                                 "conversation (with cache_control, its prefix is held as KV)",
                            {"error_code": "thread_unsupported_request",
                             "unsupported": ["thread"]}, param="thread")
    tools = tools_of(req.tools)
    choice, parallel = tool_choice_of(req, tools)
    messages = system_message(req.system) + messages_of(req.messages)
    breakpoints, blocks = breakpoints_of(req)
    shown = True
    if req.thinking is not None:
        if req.thinking.type not in THINKING_TYPES:
            raise invalid(f"thinking.type must be one of {', '.join(THINKING_TYPES)}, got "
                          f"{req.thinking.type!r}", "thinking.type")
        shown = req.thinking.display != "omitted"
    return Converted(Prompt(messages, tools), breakpoints, blocks, choice, parallel, shown)


def sampling(req: MessagesRequest) -> SamplingParams:
    """SamplingParams for /v1/messages (``max_tokens`` required, as Anthropic requires it)."""
    if req.max_tokens is None:
        raise invalid("max_tokens: field required", "max_tokens")
    if req.max_tokens < 1:
        raise invalid(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise invalid(f"temperature must be in [0, 1], got {req.temperature}", "temperature")
    thinking = req.thinking
    if thinking is not None and thinking.type == "enabled":
        budget = thinking.budget_tokens
        if budget is None or budget < MIN_THINKING_BUDGET or budget >= req.max_tokens:
            raise invalid(f"thinking.budget_tokens must be >= {MIN_THINKING_BUDGET} and less "
                          f"than max_tokens ({req.max_tokens}), got {budget}",
                          "thinking.budget_tokens")
    stops = req.stop_sequences or []
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid(f"at most {MAX_STOP_SEQUENCES} stop_sequences", "stop_sequences")
    if any(not s for s in stops):
        raise invalid("stop_sequences must be non-empty strings", "stop_sequences")
    schema = None
    fmt = output_format(req)
    if fmt is not None:
        if fmt.type != "json_schema" or fmt.schema is None:
            raise invalid("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                          "output_config.format")
        schema = json.dumps(fmt.schema)
    given: dict[str, Any] = {name: getattr(req, name) for name in ("temperature", "top_p",
                                                                   "top_k", "seed")
                             if getattr(req, name) is not None}
    try:
        return SamplingParams(max_tokens=req.max_tokens, stop=stops, json_schema=schema, **given)
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"invalid sampling options: {e}") from None


__all__ = ["Breakpoint", "Converted", "Cut", "Prompt", "convert", "prefix_of", "sampling"]
