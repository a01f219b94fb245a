"""Which tools a turn's output calls, as the engine reads it: the one call parser
(`radixlm.tokenizer.call_parser`) over the output's text, in the call format the model's
chat template implies (`radixlm.tokenizer.tools.tool_format`) -- what the frontend's
call readers give clients, read here once more at the turn's end because the engine
decides what a session waits on (tool_waits.py)."""

from __future__ import annotations

from collections.abc import Sequence

from radixlm.tokenizer import Tokenizer
from radixlm.tokenizer.call_parser import CallBegin, CallEnd, CallParser
from radixlm.tokenizer.tools import tool_format


class CallNames:
    """`names(output_ids, tools)`: the tools the output calls, in order, complete calls
    only (nothing without a tokenizer)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template if tokenizer is not None else None
        self.format = tool_format(template.source if template is not None else None)

    def names(self, output_ids: Sequence[int], tools: Sequence[str] | None) -> list[str]:
        if self.tokenizer is None or not tools or not output_ids:
            return []
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        parser = CallParser(self.format, tools)
        events = parser.feed(text) + parser.finish()
        begun: dict[int, str] = {}
        called: list[str] = []
        for e in events:
            if isinstance(e, CallBegin):
                begun[e.index] = e.name
            elif isinstance(e, CallEnd) and e.complete and e.index in begun:
                called.append(begun[e.index])
        return called
