"""Where each call ends in a constrained output, as the engine reads it (`CallParser` over
a call grammar's frame, no names: `CallEnd.text` and `CallEnd.end`), against the text
built here from known calls: every call is reported once, with its exact text (frame
included), where it ends, however the text is cut into pieces."""

from __future__ import annotations

import json
import random

import pytest
from radixlm.tokenizer.call_parser import CallEnd, CallParser
from radixlm.tokenizer.tools import FORMATS, framed_format

_NASTY = ['a}b', 'say "hi"', "back\\slash", "{[", "]}", "line\nbreak", "ünï", "", "</tool_call>"]


def _call(rng: random.Random, lead: bool) -> str:
    args = {f"k{i}": rng.choice([rng.choice(_NASTY), rng.randint(-5, 5), [1, {"x": "}"}],
                                 {"deep": {"er": ["]"]}}, None, True])
            for i in range(rng.randint(0, 3))}
    text = json.dumps({"name": "get_weather", "arguments": args}, ensure_ascii=rng.random() < 0.5,
                      indent=rng.choice([None, 1]))
    return " " * (lead and rng.randint(0, 1)) + text


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("fmt", ["generic", "hermes"])
def test_each_call_is_reported_where_it_ends(fmt: str) -> None:
    rng = random.Random(fmt)
    begin, end = FORMATS[fmt].frame
    for _ in range(300):
        # (only the first of bare calls may have spaces before it: they join its text)
        calls = [begin + _call(rng, bool(begin) or i == 0) + end for i in range(rng.randint(1, 4))]
        text, ends = "", []
        for i, c in enumerate(calls):
            text += ("\n" if i else "") + c
            ends.append(len(text))
        parser = CallParser(framed_format(begin, end), None)
        seen, offset = [], 0
        for piece in _pieces(text, rng):
            for e in parser.feed(piece):
                if isinstance(e, CallEnd):
                    assert offset <= e.end <= offset + len(piece)  # inside the piece fed
                    seen.append((e.end, e.text))
            offset += len(piece)
        assert seen == list(zip(ends, calls, strict=True))


@pytest.mark.parametrize("text", [
    "It is sunny.",  # content, not a call
    '{"answer": "four"}',  # content of an auto request's own schema
    '"a string"',
    "[1]",
])
def test_content_is_no_call(text: str) -> None:
    parser = CallParser(framed_format("", ""), None)
    assert not [e for piece in text for e in parser.feed(piece) if isinstance(e, CallEnd)]
