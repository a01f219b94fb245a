"""Tools beside structured output, and tool calls read as they stream.

- `plan_structured` gives OpenAI's semantics: "required" / a named function -> calls (a
  request's own schema applies to content, of which there is none); "auto" with a schema
  -> one union grammar of calls or schema-valid content; ``parallel_tool_calls``.
- The union grammar, sampled under its token mask with random logits: every output is
  either calls (`parse_tool_calls`, arguments valid under the tool's schema by
  `jsonschema`) or content valid under the request's schema -- and both happen.
- `CallStream` (tokenizer/tool_stream.py) against `parse_tool_calls` on the whole text:
  whatever the chunking (hypothesis), the same calls and text, argument fragments that
  concatenate to each call's arguments, the name before any fragment.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from radixlm.runtime.engine.sampling import Sampler
from radixlm.runtime.frontend.structured import CALL_SEPARATOR, plan_structured
from radixlm.runtime.grammar.bitmask import BatchMasker
from radixlm.runtime.grammar.compiler import GrammarCompiler
from radixlm.runtime.grammar.matcher import GrammarState
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.grammar.vocab import tokenizer_info
from radixlm.runtime.protocol import Generate, Input, NamedToolChoice, SamplingParams, Tool
from radixlm.tokenizer import Tokenizer
from radixlm.tokenizer.tool_stream import ArgsDelta, CallBegin, CallEnd, CallStream, TextDelta
from radixlm.tokenizer.tools import parse_tool_calls

WEATHER = Tool(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False})
ADD = Tool(name="add", parameters={
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False})
TOOLS = [WEATHER, ADD]
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
          "required": ["answer"], "additionalProperties": False}


def gen(**kw) -> Generate:
    return Generate(rid="r", input=Input(text="x"), **kw)


def schema_sampling() -> SamplingParams:
    return SamplingParams(json_schema=json.dumps(ANSWER))


# -- the plan ---------------------------------------------------------------------------


def test_required_with_a_schema_is_calls_only() -> None:
    plan = plan_structured(gen(tools=TOOLS, tool_choice="required", sampling=schema_sampling()),
                           "hermes")
    g = plan.grammar
    assert g is not None and plan.parse_calls
    assert (g.begin, g.end, g.separator, g.alternative) == (
        "<tool_call>\n", "\n</tool_call>", CALL_SEPARATOR, None)
    names = {o["properties"]["name"]["const"] for o in json.loads(g.text)["anyOf"]}
    assert names == {"get_weather", "add"}
    one = plan_structured(gen(tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                              sampling=schema_sampling()), "hermes")
    assert one.grammar is not None and one.grammar.separator is None and not one.parallel
    named = plan_structured(gen(tools=TOOLS, tool_choice=NamedToolChoice(name="add"),
                                sampling=schema_sampling()), "generic")
    assert named.grammar is not None and named.grammar.separator is None
    assert json.loads(named.grammar.text)["properties"]["name"] == {"const": "add"}


def test_auto_with_a_schema_is_one_union_grammar() -> None:
    plan = plan_structured(gen(tools=TOOLS, sampling=schema_sampling()), "generic")
    g = plan.grammar
    assert g is not None and plan.parse_calls and g.separator == CALL_SEPARATOR
    assert g.alternative == GrammarSpec(kind="json_schema", text=json.dumps(ANSWER))
    # "none": the schema alone, nothing parsed; no tools: the schema alone.
    none = plan_structured(gen(tools=TOOLS, tool_choice="none", sampling=schema_sampling()),
                           "generic")
    assert none.grammar == g.alternative and not none.parse_calls
    assert plan_structured(gen(sampling=schema_sampling()), "generic").grammar == g.alternative


def test_parallel_false_keeps_the_first_parsed_call() -> None:
    text = '{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "get_weather", "arguments": {"city": "x"}}'
    assert len(plan_structured(gen(tools=TOOLS), "generic").tool_calls(text) or []) == 2
    calls = plan_structured(gen(tools=TOOLS, parallel_tool_calls=False), "generic").tool_calls(text)
    assert calls is not None and [c.name for c in calls] == ["add"]


# -- the union grammar, sampled ----------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer):
    c = GrammarCompiler(tokenizer_info(tok, tok.vocab_size, tok.eos_token_ids))
    yield c
    c.close()


@pytest.mark.parametrize("fmt", ["generic", "hermes"])
def test_union_outputs_are_calls_or_schema_valid_content(compiler, tok, fmt: str) -> None:
    spec = plan_structured(gen(tools=TOOLS, sampling=schema_sampling()), fmt).grammar  # type: ignore[arg-type]
    assert spec is not None
    compiled = compiler.compile_now(spec)
    before = compiler.compiled
    assert compiler.compile_now(spec) is compiled and compiler.compiled == before  # cached
    vocab = tok.vocab_size
    masker, sampler = BatchMasker(vocab), Sampler(vocab)
    kinds = set()
    rows = 12
    states = [GrammarState(compiled, tok.eos_token_ids) for _ in range(rows)]
    outs: list[list[int]] = [[] for _ in range(rows)]
    g = torch.Generator().manual_seed(7)
    params = [SamplingParams(temperature=1.0)] * rows
    for _ in range(160):
        live = [i for i, s in enumerate(states) if not s.terminated]
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=g) * 4
        logits[:, list(tok.eos_token_ids)] += 6  # lean towards ending: short outputs
        mask = masker.fill([states[i] for i in live])
        res = sampler.sample(logits, [params[i] for i in live], [outs[i] for i in live],
                             generators=[g] * len(live), mask=mask)
        for i, t in zip(live, res.token_ids, strict=True):
            assert states[i].accept(t)
            outs[i].append(t)
    for out in outs:
        if out[-1] not in tok.eos_token_ids:
            continue  # ran out of steps inside a match
        text = tok.decode(out[:-1])
        calls = parse_tool_calls(text, fmt, TOOLS)
        if calls is not None:
            kinds.add("calls")
            for c in calls:
                tool = next(t for t in TOOLS if t.name == c.name)
                jsonschema.validate(json.loads(c.arguments), tool.parameters)
            assert _stream_all(fmt, text) == ([(c.name, json.loads(c.arguments)) for c in calls],
                                              "")
        else:
            kinds.add("content")
            jsonschema.validate(json.loads(text), ANSWER)
    assert kinds == {"calls", "content"}, kinds


def _stream_all(fmt: str, text: str) -> tuple[list[tuple[str, object]], str]:
    cs = CallStream(fmt, [t.name for t in TOOLS])  # type: ignore[arg-type]
    for i in range(0, len(text), 3):
        cs.feed(text[i:i + 3])
    cs.finish()
    return [(n, json.loads(a)) for n, a in cs.calls], cs.text.strip()


# -- CallStream ---------------------------------------------------------------------------

CALL_TEXTS = [
    ("generic", '{"name": "get_weather", "arguments": {"city": "Paris \\"}\\" x", "n": [1, {"a": "}"}]}}'),
    ("generic", '  {"arguments": {"a": 1, "b": 2}, "name": "add"}'),
    ("generic", '{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "get_weather", "arguments": {}}'),
    ("generic", '{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}'),
    ("generic", '{"name": "add", "extra": [1, {"x": null}], "arguments": {"a": 1, "b": 0}}'),
    ("hermes", 'Let me look. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 6}}'),
]
PLAIN_TEXTS = [
    ("generic", '{"name": "Bob", "age": 3}'),
    ("generic", 'The answer is {"name": "add"}'),
    ("generic", '{"answer": "four"}'),
    ("generic", '   '),
    ("hermes", 'I think <tool_ca is not a call, nor is <tool_call without its end'),
    ("hermes", 'No calls at all.'),
    ("llama3", '<|pyt and more'),
]


def _run(fmt: str, text: str, cuts: list[int]) -> tuple[list, list]:
    cs = CallStream(fmt, [t.name for t in TOOLS])  # type: ignore[arg-type]
    events = []
    pos = 0
    for cut in sorted(set(cuts)):
        events += cs.feed(text[pos:cut])
        pos = cut
    events += cs.feed(text[pos:])
    events += cs.finish()
    return events, cs.calls


def _check_events(events: list) -> list[tuple[str, str]]:
    """Each call: its name before any fragment, fragments that add up to its arguments."""
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    out = []
    for e in events:
        if isinstance(e, CallBegin):
            assert e.index not in names
            names[e.index] = e.name
            calls[e.index] = []
        elif isinstance(e, ArgsDelta):
            assert e.index in names, "a fragment before its call's name"
            calls[e.index].append(e.text)
        elif isinstance(e, CallEnd):
            assert "".join(calls[e.index]) == e.arguments or (e.arguments == "{}" and not calls[e.index])
            out.append((names[e.index], e.arguments))
    return out


@pytest.mark.parametrize(("fmt", "text"), CALL_TEXTS + PLAIN_TEXTS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_stream_matches_the_whole_text_parse(fmt: str, text: str, data) -> None:  # noqa: ANN001
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    events, calls = _run(fmt, text, cuts)
    assert _check_events(events) == calls
    streamed_text = "".join(e.text for e in events if isinstance(e, TextDelta))
    parsed = parse_tool_calls(text, fmt, TOOLS)
    if parsed is None:
        assert calls == [] and streamed_text == text
    else:
        assert [(n, json.loads(a)) for n, a in calls] == [(c.name, json.loads(c.arguments))
                                                          for c in parsed]
        assert "<tool_call>" not in streamed_text and "{" not in streamed_text


def test_plain_text_streams_at_once_and_only_a_marker_start_waits() -> None:
    cs = CallStream("hermes", ["add"])
    assert cs.feed("Hello wor") == [TextDelta("Hello wor")]
    assert cs.feed("ld <tool") == [TextDelta("ld ")]  # "<tool" may begin a call
    assert cs.feed("box>") == [TextDelta("<toolbox>")]
    g = CallStream("generic", ["add"])
    assert g.feed("  ") == [] and g.feed("Sure") == [TextDelta("  Sure")]
    g = CallStream("generic", ["add"])
    assert g.feed('{"name": "add", "arguments": {"a"') == [CallBegin(0, "add"), ArgsDelta(0, '{"a"')]
    assert g.feed(": 1}}") == [ArgsDelta(0, ": 1}"), CallEnd(0, '{"a": 1}')]
