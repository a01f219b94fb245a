"""`FramedCalls` against the text it is fed, built here from known calls: every call is
reported once, with its exact text, where it ends, however the text is cut into pieces."""

from __future__ import annotations

import json
import random

import pytest
from radixlm.tokenizer.call_frames import FramedCalls
from radixlm.tokenizer.tools import call_frame

_NASTY = ['a}b', 'say "hi"', "back\\slash", "{[", "]}", "line\nbreak", "ünï", ""]


def _call(rng: random.Random) -> str:
    args = {f"k{i}": rng.choice([rng.choice(_NASTY), rng.randint(-5, 5), [1, {"x": "}"}],
                                 {"deep": {"er": ["]"]}}, None, True])
            for i in range(rng.randint(0, 3))}
    text = json.dumps({"name": "get_weather", "arguments": args}, ensure_ascii=rng.random() < 0.5,
                      indent=rng.choice([None, 1]))
    return " " * rng.randint(0, 1) + text


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("fmt", ["generic", "hermes"])
def test_each_call_is_reported_where_it_ends(fmt: str) -> None:
    rng = random.Random(fmt)
    begin, end = call_frame(fmt)  # type: ignore[arg-type]
    for _ in range(300):
        calls = [begin + _call(rng) + end for _ in range(rng.randint(1, 4))]
        text, ends = "", []
        for i, c in enumerate(calls):
            text += ("\n" if i else "") + c
            ends.append(len(text))
        watch = FramedCalls(begin, end, "\n")
        seen, offset = [], 0
        for piece in _pieces(text, rng):
            seen += [(offset + at, call) for at, call in watch.feed(piece)]
            offset += len(piece)
        assert seen == list(zip(ends, calls, strict=True))
        assert watch.watching


def test_one_call_without_a_separator_ends_the_watch() -> None:
    watch = FramedCalls("", "", "")
    assert watch.feed('{"name": "f", "arguments": {}}\n{"x"') == [(30, '{"name": "f", "arguments": {}}')]
    assert not watch.watching


@pytest.mark.parametrize(("begin", "end", "text"), [
    ("<tool_call>\n", "\n</tool_call>", "It is sunny."),  # content, not a call
    ("<tool_call>\n", "\n</tool_call>", '<tool_call>\n{"a": 1}\n</tool_call>;'),
    ("", "", '"a string"'),
    ("", "", "[1]"),
])
def test_text_that_leaves_the_frame_ends_the_watch(begin: str, end: str, text: str) -> None:
    watch = FramedCalls(begin, end, "\n")
    found = [call for piece in text for _, call in watch.feed(piece)]
    assert found == ([text[:-1]] if text.endswith(";") else [])
    assert not watch.watching
