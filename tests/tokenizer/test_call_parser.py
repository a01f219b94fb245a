"""`CallParser` (tokenizer/call_parser.py), the one reader of tool calls, against outputs
built here from known calls.

Each example writes calls (known names, argument objects with awkward strings, either
key order, extra keys, arguments as a JSON string) in a format's markup, with text
around them where the format allows it, and feeds the result cut at random points
(hypothesis). The reference is what was written: the same calls (`json` reads their
arguments) in order, the same text outside them, every call's name before any of its
argument fragments, fragments that add up to its arguments. Outputs that are not calls
(unknown names, other keys, prose) must come back whole as text, and text must never wait
for the end unless it may still begin a call.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixlm.tokenizer.call_parser import ArgsDelta, CallBegin, CallEnd, CallParser, TextDelta
from radixlm.tokenizer.tools import FORMATS, framed_format, tool_format

NAMES = ["get_weather", "add", "search.web"]
SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
_AWKWARD = ['a}b', 'say "hi"', "back\\slash", "{[", "]}", "line\nbreak", "ünï", "", "</tool_call>"]

args_st = st.dictionaries(
    st.sampled_from(["city", "a", "q", "deep"]),
    st.one_of(st.sampled_from(_AWKWARD), st.integers(-5, 5), st.none(), st.booleans(),
              st.just([1, {"x": "}"}]), st.just({"er": ["]"]})),
    max_size=3)


@st.composite
def written_call(draw, fmt: str) -> tuple[str, dict, str]:  # noqa: ANN001
    """(name, arguments, the call's JSON as a model may write it)."""
    name = draw(st.sampled_from(NAMES))
    args = draw(args_st)
    key = draw(st.sampled_from(FORMATS[fmt].args_keys))
    dump = {"ensure_ascii": draw(st.booleans()), "indent": draw(st.sampled_from([None, 1]))}
    value = json.dumps(json.dumps(args)) if draw(st.booleans()) and not dump["indent"] else None
    pairs = [("name", json.dumps(name)), (key, value or json.dumps(args, **dump))]
    if draw(st.booleans()):
        pairs.reverse()
    if draw(st.booleans()):
        pairs.insert(draw(st.integers(0, 2)), ("extra", json.dumps([1, {"x": None}])))
    text = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in pairs) + "}"
    return name, args, text


@st.composite
def output(draw, fmt: str) -> tuple[str, list[tuple[str, dict]], str]:  # noqa: ANN001
    """(the output, its calls, its text outside calls)."""
    calls = draw(st.lists(written_call(fmt), min_size=1, max_size=3))
    expected = [(n, a) for n, a, _ in calls]
    if fmt == "hermes":
        before = draw(st.sampled_from(["", "Let me look.\n", "I'll call <tool it"]))
        after = draw(st.sampled_from(["", "Done."]))
        blocks = [f"<tool_call>{draw(st.sampled_from(['', chr(10), ' ']))}{c}"
                  f"{draw(st.sampled_from(['', chr(10)]))}</tool_call>" for _, _, c in calls]
        return before + "\n".join(blocks) + ("\n" + after if after else ""), expected, before + after
    lead = draw(st.sampled_from(["", " ", "\n"]))
    if fmt == "llama3" and draw(st.booleans()):
        lead += FORMATS["llama3"].lead
    sep = draw(st.sampled_from(["\n", "; ", " "]))
    return lead + sep.join(c for _, _, c in calls), expected, ""


def run(parser: CallParser, text: str, cuts: list[int]) -> list:
    events, pos = [], 0
    for cut in sorted({c % (len(text) + 1) for c in cuts}):
        events += parser.feed(text[pos:cut])
        pos = cut
    return events + parser.feed(text[pos:]) + parser.finish()


def read(events: list) -> tuple[list[tuple[str, str]], str]:
    """The calls (name, arguments) and text of `events`, checking their order rules."""
    names: dict[int, str] = {}
    frags: dict[int, list[str]] = {}
    calls = []
    for e in events:
        if isinstance(e, CallBegin):
            assert e.index == len(names) and e.index not in names
            names[e.index], frags[e.index] = e.name, []
        elif isinstance(e, ArgsDelta):
            assert e.index in names, "a fragment before its call's name"
            frags[e.index].append(e.text)
        elif isinstance(e, CallEnd):
            assert "".join(frags[e.index]) == e.arguments
            calls.append((names[e.index], e.arguments))
    return calls, "".join(e.text for e in events if isinstance(e, TextDelta))


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "generic"])
@SETTINGS
@given(data=st.data())
def test_calls_come_back_as_written_however_the_text_is_cut(fmt: str, data) -> None:  # noqa: ANN001
    text, expected, outside = data.draw(output(fmt))
    cuts = data.draw(st.lists(st.integers(0, 10_000), max_size=12))
    parser = CallParser(fmt, NAMES)  # type: ignore[arg-type]
    calls, streamed_text = read(run(parser, text, cuts))
    assert [(n, json.loads(a)) for n, a in calls] == expected
    assert streamed_text == outside
    assert parser.calls == calls and parser.text == outside


PLAIN = [
    ("generic", '{"name": "Bob", "age": 3}'),
    ("generic", 'The answer is {"name": "add"}'),
    ("generic", '{"answer": "four"}'),
    ("generic", '{"name": "unknown", "arguments": {}}'),
    ("generic", '{"name": "add", "arguments": [1]}'),
    ("generic", '{"name": "add", "arguments": "not json"}'),
    ("generic", '"a string"'),
    ("generic", '   '),
    ("hermes", 'I think <tool_ca is not a call, nor is <tool_call without its end'),
    ("hermes", 'No calls at all.'),
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'),
    ("llama3", '<|pyt and more'),
    ("llama3", '<|python_tag|>print(1)'),
]


@pytest.mark.parametrize(("fmt", "text"), PLAIN)
@SETTINGS
@given(cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_what_is_not_a_call_is_text(fmt: str, text: str, cuts: list[int]) -> None:
    calls, streamed = read(run(CallParser(fmt, NAMES), text, cuts))  # type: ignore[arg-type]
    assert calls == [] and streamed == text


def test_text_streams_at_once_and_only_a_possible_call_start_waits() -> None:
    p = CallParser("hermes", ["add"])
    assert p.feed("Hello wor") == [TextDelta("Hello wor")]
    assert p.feed("ld <tool") == [TextDelta("ld ")]  # "<tool" may begin a call
    assert p.feed("box>") == [TextDelta("<toolbox>")]
    g = CallParser("generic", ["add"])
    assert g.feed("  ") == [] and g.feed("Sure") == [TextDelta("  Sure")]
    g = CallParser("generic", ["add"])
    assert g.feed('{"name": "add", "arguments": {"a"') == [CallBegin(0, "add"), ArgsDelta(0, '{"a"')]
    events = g.feed(": 1}}")
    assert events[0] == ArgsDelta(0, ": 1}") and isinstance(events[1], CallEnd)
    assert (events[1].arguments, events[1].complete) == ('{"a": 1}', True)


def test_a_call_cut_short_ends_incomplete() -> None:
    p = CallParser("generic", ["add"])
    events = p.feed('{"name": "add", "arguments": {"a": ') + p.finish()
    end = events[-1]
    assert isinstance(end, CallEnd) and not end.complete and end.arguments == '{"a": '


def test_one_call_drops_everything_from_a_second_call_on() -> None:
    text = ('{"name": "add", "arguments": {"a": 1}}\n{"name": "get_weather", "arguments": {}}'
            '\n{"name": "add", "arguments": {}}')
    for cut in range(len(text) + 1):
        p = CallParser("generic", NAMES, one_call=True)
        calls, _ = read(p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish())
        assert calls == [("add", '{"a": 1}')]
    h = CallParser("hermes", NAMES, one_call=True)
    calls, streamed = read(h.feed('A <tool_call>{"name": "add", "arguments": {}}</tool_call> B '
                                  '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
                                  ' C') + h.finish())
    assert calls == [("add", "{}")] and streamed == "A B "


def test_without_names_any_name_is_a_call() -> None:
    p = CallParser("generic", None)
    calls, _ = read(p.feed('{"name": "anything", "arguments": {}}') + p.finish())
    assert calls == [("anything", "{}")]


def test_the_table_drives_formats_and_frames() -> None:
    assert tool_format("{{ tools }} <tool_call>") == "hermes"
    assert tool_format('{{ tools }} "parameters"') == "llama3"
    assert tool_format("no tool support") == tool_format(None) == "generic"
    assert framed_format(*FORMATS["hermes"].frame) is FORMATS["hermes"]
    assert framed_format("", "") is FORMATS["generic"]
    with pytest.raises(ValueError):
        framed_format("<x>", "</x>")
