"""How models write tool calls: one table of call formats, read by everything that shows a
model its tools, constrains its calls or reads them back (`radixlm.tokenizer.tools`,
`radixlm.tokenizer.call_parser`, the frontend's call grammar).

- ``hermes``: the template renders ``tools`` itself and the model answers
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Hermes, Qwen2/2.5/3);
- ``llama3``: the template renders ``tools`` and the model answers a bare JSON object
  ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3; an optional ``<|python_tag|>``);
- ``generic``: the template knows no tools (SmolLM2, plain ChatML). radixlm then shows
  the functions in a system message and the model answers a bare JSON object
  ``{"name": ..., "arguments": {...}}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["FORMATS", "CallFormat", "ToolFormat", "call_format", "framed_format", "tool_format"]

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
