"""A Generate's structured-output plan: its grammar and how tool calls are read from
its output, with OpenAI's semantics for tools beside a response format:

- ``tool_choice`` "required" or a named function: the output is a call (a required one
  may be several, joined by newlines, unless ``parallel_tool_calls`` is false); a
  request's own grammar applies to content, and there is none;
- "auto" with the request's own grammar (json_schema, ...): either calls or content that
  follows it -- one union grammar (`GrammarSpec.alternative`), compiled once and cached;
- "auto" without one: free text, read as calls when it is calls; "none": no calls.

Built on the frontend's main thread as the request arrives (no tokenizer work, no
xgrammar: a grammar that does not compile is reported by the engine, which compiles it).

Its call readers are the one place a call is read for clients and given its id:
`CallReader.read(text)` feeds a branch's new text to the call parser
(`radixlm.tokenizer.call_parser`) and returns it as a chunk carries it (docs/protocol.md,
`chunk`): the text outside calls (`content`) and the pieces of calls (`CallDelta`s, each
placed in that content by its `at`; the pieces of one call within one read merged into
one). Each call gets its id when its name is known, so the first piece that names it
carries it, and `calls` lists the complete calls with the same ids for the branch's Done.
A call the output ended inside is streamed as it stood but is not listed.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from radixlm.runtime.grammar.spec import GrammarSpec, grammar_fields_given
from radixlm.runtime.protocol import CallDelta, ErrorCode, Generate, NamedToolChoice, Tool, ToolCall
from radixlm.runtime.rules import RequestError
from radixlm.tokenizer.call_parser import ArgsDelta, CallBegin, CallEnd, CallParser, TextDelta
from radixlm.tokenizer.tools import ToolFormat, call_frame, call_schema

__all__ = ["CallReader", "StructuredPlan", "new_call_id", "plan_structured"]


# Between parallel calls (the call parser also reads calls split by spaces or ';').
CALL_SEPARATOR = "\n"


@dataclass(frozen=True)
class StructuredPlan:
    grammar: GrammarSpec | None
    tools: list[Tool] | None  # rendered with the prompt (messages input)
    fmt: ToolFormat
    parse_calls: bool  # read tool calls out of the output (chunks' and Done's tool_calls)
    parallel: bool = True  # several calls may be answered at once

    def reader(self) -> CallReader | None:
        """A branch's call reader (None: its calls are not read)."""
        if not self.parse_calls or not self.tools:
            return None
        return CallReader(self.fmt, self.tools, self.parallel)


# -- reading a branch's calls ------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class CallReader:
    """See the module docstring; ``parallel`` false keeps the first call only."""

    __slots__ = ("_parser", "_calls", "_id", "_name")

    def __init__(self, fmt: ToolFormat, tools: Sequence[Tool], parallel: bool) -> None:
        self._parser = CallParser(fmt, [t.name for t in tools], one_call=not parallel)
        self._calls: list[ToolCall] = []
        self._id = self._name = ""  # the open call's

    @property
    def calls(self) -> list[ToolCall] | None:
        return self._calls or None

    def read(self, text: str, final: bool = False) -> tuple[str, list[CallDelta] | None]:
        """`text` (the branch's next text; `final`: its last) as (content, call pieces)."""
        parser = self._parser
        events = parser.feed(text) if text else []
        if final:
            events += parser.finish()
        content: list[str] = []
        at = 0
        pieces: list[CallDelta] = []
        for e in events:
            if isinstance(e, TextDelta):
                content.append(e.text)
                at += len(e.text)
            elif isinstance(e, CallBegin):
                self._id, self._name = new_call_id(), e.name
                pieces.append(CallDelta(index=e.index, at=at, id=self._id, name=e.name))
            elif isinstance(e, ArgsDelta):
                self._piece(pieces, e.index, at).arguments += e.text
            elif isinstance(e, CallEnd) and e.complete:
                self._piece(pieces, e.index, at).done = True
                self._calls.append(ToolCall(id=self._id, name=self._name, arguments=e.arguments))
        return "".join(content), pieces or None

    @staticmethod
    def _piece(pieces: list[CallDelta], index: int, at: int) -> CallDelta:
        """The piece of call `index` at `at` in this read (made if none)."""
        last = pieces[-1] if pieces else None
        if last is None or last.index != index or last.at != at:
            last = CallDelta(index=index, at=at)
            pieces.append(last)
        return last


# -- the plan ---------------------------------------------------------------------------


NO_PLAN = StructuredPlan(grammar=None, tools=None, fmt="generic", parse_calls=False)


def call_grammar(tools: list[Tool], fmt: ToolFormat, *, several: bool,
                 alternative: GrammarSpec | None = None) -> GrammarSpec:
    """A call of one of `tools` (`several`: one or more), or else `alternative`."""
    begin, end = call_frame(fmt)
    return GrammarSpec(kind="json_schema", text=call_schema(tools, fmt), begin=begin, end=end,
                       separator=CALL_SEPARATOR if several else None, alternative=alternative)


def plan_structured(msg: Generate, fmt: ToolFormat) -> StructuredPlan:
    """Check the request's grammar fields and tool_choice (its tools have passed
    `rules.check_tools`); raise `RequestError` (invalid_params) naming the first problem."""
    sampling, tools, choice = msg.sampling, msg.tools, msg.tool_choice
    given = grammar_fields_given(sampling)
    if len(given) > 1:
        raise _invalid(f"at most one of regex, json_schema, ebnf per request (got {', '.join(given)})")
    grammar = GrammarSpec(kind=given[0], text=getattr(sampling, given[0])) if given else None
    if tools is None and choice == "auto" and grammar is None:
        return NO_PLAN
    forced = _forced_tools(tools, choice)
    parallel = msg.parallel_tool_calls
    if forced is not None:  # a call; the request's own grammar would shape content
        grammar = call_grammar(forced, fmt, several=parallel and choice == "required")
    elif tools is not None and choice == "auto" and grammar is not None:
        grammar = call_grammar(tools, fmt, several=parallel, alternative=grammar)
    parse = tools is not None and choice != "none"
    return StructuredPlan(grammar=grammar, tools=tools, fmt=fmt, parse_calls=parse,
                          parallel=parallel)


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


def _invalid(message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_PARAMS, message)
