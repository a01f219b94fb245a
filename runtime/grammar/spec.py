"""What a request's output is constrained to: `GrammarSpec`, free of torch and xgrammar.

The frontend builds specs (it validates requests without importing either); the engine
compiles them (`radixlm.runtime.grammar.compiler`). A spec is plain data, so it is also
the compiled-grammar cache's key.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

__all__ = ["GRAMMAR_FIELDS", "GrammarKind", "GrammarSpec", "grammar_fields_given", "spec_from"]

GrammarKind = Literal["regex", "json_schema", "ebnf"]
GRAMMAR_FIELDS: tuple[GrammarKind, ...] = ("regex", "json_schema", "ebnf")


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A grammar of `kind` over `text`, optionally framed by fixed text, repeated, or
    offered beside another grammar.

    `begin` and `end` are literal strings the output starts and ends with around the
    grammar's match (a tool call's ``<tool_call>`` markup around its JSON); empty for a
    request's own regex / json_schema / ebnf. With `separator` the framed match may
    repeat, each repeat after that text (parallel tool calls). With `alternative` the
    output matches either this grammar or that one (tool calls, or content that follows
    the request's own schema): one union grammar, compiled once and cached as a whole.
    """

    kind: GrammarKind
    text: str
    begin: str = ""
    end: str = ""
    separator: Union[str, None] = None
    alternative: Union[GrammarSpec, None] = None


def grammar_fields_given(sampling: Any) -> list[str]:
    """The grammar fields a `SamplingParams`-like object sets, in `GRAMMAR_FIELDS` order."""
    return [name for name in GRAMMAR_FIELDS if getattr(sampling, name, None) is not None]


def spec_from(sampling: Any) -> GrammarSpec | None:
    """The request's own grammar (None without one); at most one field must be set."""
    given = grammar_fields_given(sampling)
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"at most one of regex, json_schema, ebnf per request (got {', '.join(given)})")
    kind = given[0]
    return GrammarSpec(kind=kind, text=getattr(sampling, kind))
