"""What the router knows of a request's prompt without a tokenizer: a routing key (a
string whose prefixes stand for the prompt's, for the approximate tree) and an estimate
of its tokens (for load).

Keys start with the tenant and namespace, which the engines' caches never share across,
so two tenants' identical prompts never look cached for each other. Text is itself; ids
are one character each; messages are their role and content (and tool calls), tools
their JSON, with separators no text uses.
"""

from __future__ import annotations

import json

from radixlm.runtime.protocol import Input, Tool

__all__ = ["CHARS_PER_TOKEN", "estimate_tokens", "input_key", "scope_key"]

CHARS_PER_TOKEN = 4  # a rough average for English text under BPE vocabularies
_ID_BASE = 0x10000  # ids become characters above the BMP (any id below ~1M fits)


def scope_key(tenant: str | None, namespace: str | None) -> str:
    """The prefix of every key of one (tenant, namespace)."""
    return f"{tenant or ''}\x00{namespace or ''}\x00"


def input_key(inp: Input | None, tools: list[Tool] | None = None) -> str:
    """An input's key, to be appended to a scope's or a history's."""
    if inp is None:
        return ""
    if inp.text is not None:
        return inp.text
    if inp.input_ids is not None:
        return "".join(chr(_ID_BASE + (i % 0xEFFFF)) for i in inp.input_ids if i >= 0)
    parts = []
    if tools:
        parts.append("\x1d" + json.dumps([t.name for t in tools]) + "\x1d")
    for m in inp.messages or ():
        calls = "".join(f"{c.name}({c.arguments})" for c in m.tool_calls or ())
        parts.append(f"\x1e{m.role}\x1f{m.content or ''}{calls}")
    return "".join(parts)


def estimate_tokens(inp: Input | None, key: str) -> int:
    """Tokens `inp` (whose key is `key`) probably holds: ids exactly, text by length."""
    if inp is not None and inp.input_ids is not None:
        return len(inp.input_ids)
    return (len(key) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN
