"""Responses and Conversations items <-> protocol messages.

An item list (a Responses ``input``, a response's ``output``, a conversation's items) is
read as the chat it stands for: messages, and function calls / outputs. Consecutive
function calls -- and the assistant text right before them -- are one assistant turn
(one message with several ``tool_calls``), which is how a model wrote them, so a history
sent back item by item maps onto the very messages the engine holds.

Stored and listed items are in OpenAI's shape, each with an id (``msg_``, ``fc_``,
``fco_``) and ``status: "completed"``.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
from radixlm.runtime.http.errors import invalid
from radixlm.runtime.http.schemas import InputContent, InputItem
from radixlm.runtime.protocol import Message, ToolCall

# Roles the chat templates know; OpenAI's "developer" is the newer name of "system".
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def text_of(content: str | list[Any] | None, where: str) -> str | None:
    """A content string or a list of text parts as one text."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type not in ("text", "input_text", "output_text") or part.text is None:
            raise invalid(f"{where}.content[{i}]: only text parts are supported (got "
                          f"{part.type!r})", f"{where}.content")
        texts.append(part.text)
    return "".join(texts)


def to_messages(items: list[InputItem], where: str = "input") -> list[Message]:
    """Items -> protocol messages (see the module docstring for how calls are merged)."""
    out: list[Message] = []
    for i, item in enumerate(items):
        kind = item.type or "message"
        at = f"{where}[{i}]"
        if kind == "message":
            role = ROLES.get(item.role or "")
            if role is None or role == "tool":
                raise invalid(f"{at}.role must be system, developer, user or assistant", f"{at}.role")
            out.append(Message(role=role, content=text_of(item.content, at) or ""))
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise invalid(f"{at}: a function_call needs call_id and name", at)
            call = ToolCall(id=item.call_id, name=item.name, arguments=item.arguments or "{}")
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or []), call],
                                                  content=last.content or None)
            else:
                out.append(Message(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            if not item.call_id or item.output is None:
                raise invalid(f"{at}: a function_call_output needs call_id and output", at)
            out.append(Message(role="tool", content=text_of(item.output, at) or "",
                               tool_call_id=item.call_id))
        else:
            raise invalid(f"{at}.type {kind!r} is not supported (message, function_call, "
                          "function_call_output)", f"{at}.type")
    return out


def item_id(kind: str) -> str:
    return f"{_ID_PREFIX.get(kind, 'item')}_{secrets.token_hex(12)}"


def stored_item(item: InputItem, taken: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """An item in OpenAI's listed shape, with an id (its own unless already `taken`)."""
    kind = item.type or "message"
    iid = item.id if item.id and item.id not in taken else item_id(kind)
    if kind == "function_call":
        return {"type": kind, "id": iid, "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments or "{}", "status": "completed"}
    if kind == "function_call_output":
        return {"type": kind, "id": iid, "call_id": item.call_id,
                "output": text_of(item.output, "item") or "", "status": "completed"}
    role = item.role or "user"
    part = "output_text" if role == "assistant" else "input_text"
    content = item.content
    parts: list[Any] = ([] if content is None else [{"type": part, "text": content}]
                        if isinstance(content, str) else [_part(c, part) for c in content])
    return {"type": "message", "id": iid, "status": "completed", "role": role, "content": parts}


def _part(c: InputContent, default: str) -> dict[str, Any]:
    kind = c.type if c.type in ("input_text", "output_text") else default
    out: dict[str, Any] = {"type": kind, "text": c.text or ""}
    if kind == "output_text":
        out["annotations"] = []
    return out


def items_of(dicts: list[dict[str, Any]]) -> list[InputItem]:
    """Item dicts (stored, or a response's output) as `InputItem`s."""
    return [msgspec.convert(d, InputItem) for d in dicts]


def input_items(raw: str | list[InputItem]) -> list[InputItem]:
    """A Responses ``input`` as items (a string is one user message)."""
    if isinstance(raw, str):
        return [InputItem(type="message", role="user", content=raw)]
    if not raw:
        raise invalid("input must not be empty", "input")
    return raw
