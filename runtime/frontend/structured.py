"""A Generate's structured-output plan: its grammar (own regex / json_schema / ebnf, or
the call format `tool_choice` forces) and how tool calls are read from its output.

Built on the frontend's main thread as the request arrives (no tokenizer work, no
xgrammar: a grammar that does not compile is reported by the engine, which compiles it).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from radixlm.runtime.grammar.spec import GrammarSpec, grammar_fields_given
from radixlm.runtime.protocol import ErrorCode, Generate, NamedToolChoice, Tool, ToolCall
from radixlm.runtime.rules import RequestError
from radixlm.tokenizer.tools import (
    ToolFormat,
    call_frame,
    call_schema,
    check_tools,
    parse_tool_calls,
)

__all__ = ["StructuredPlan", "plan_structured"]


@dataclass(frozen=True)
class StructuredPlan:
    grammar: GrammarSpec | None
    tools: list[Tool] | None  # rendered with the prompt (messages input)
    fmt: ToolFormat
    parse_calls: bool  # read tool calls out of the output into Done.tool_calls

    def tool_calls(self, text: str) -> list[ToolCall] | None:
        if not self.parse_calls or not self.tools:
            return None
        parsed = parse_tool_calls(text, self.fmt, self.tools)
        if parsed is None:
            return None
        return [ToolCall(id=f"call_{secrets.token_hex(12)}", name=c.name, arguments=c.arguments)
                for c in parsed]


NO_PLAN = StructuredPlan(grammar=None, tools=None, fmt="generic", parse_calls=False)


def plan_structured(msg: Generate, fmt: ToolFormat) -> StructuredPlan:
    """Check the request's grammar fields, tools and tool_choice; raise `RequestError`
    (invalid_params) naming the first problem."""
    sampling, tools, choice = msg.sampling, msg.tools, msg.tool_choice
    given = grammar_fields_given(sampling)
    if len(given) > 1:
        raise _invalid(f"at most one of regex, json_schema, ebnf per request (got {', '.join(given)})")
    grammar = GrammarSpec(kind=given[0], text=getattr(sampling, given[0])) if given else None
    if tools is None and choice == "auto" and grammar is None:
        return NO_PLAN
    if tools is not None:
        if not tools:
            raise _invalid("tools is empty: omit it, or give at least one tool")
        if problem := check_tools(tools):
            raise _invalid(problem)
    forced = _forced_tools(tools, choice)
    if forced is not None:
        if grammar is not None:
            raise _invalid(f"tool_choice {_choice_name(choice)} constrains the output: "
                           f"it cannot be combined with {given[0]}")
        begin, end = call_frame(fmt)
        grammar = GrammarSpec(kind="json_schema", text=call_schema(forced, fmt), begin=begin, end=end)
    parse = tools is not None and choice != "none" and not given
    return StructuredPlan(grammar=grammar, tools=tools, fmt=fmt, parse_calls=parse)


def _forced_tools(tools: list[Tool] | None, choice: str | NamedToolChoice) -> list[Tool] | None:
    if isinstance(choice, NamedToolChoice):
        if not tools:
            raise _invalid(f"tool_choice names {choice.name!r} but no tools are given")
        named = [t for t in tools if t.name == choice.name]
        if not named:
            known = ", ".join(t.name for t in tools)
            raise _invalid(f"tool_choice names {choice.name!r}, which is not among tools ({known})")
        return named
    if choice == "required":
        if not tools:
            raise _invalid('tool_choice "required" needs tools')
        return tools
    return None


def _choice_name(choice: str | NamedToolChoice) -> str:
    return repr(choice.name) if isinstance(choice, NamedToolChoice) else f'"{choice}"'


def _invalid(message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_PARAMS, message)
