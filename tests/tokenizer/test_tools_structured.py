"""Tools beside structured output, and tool calls read as they stream.

- `plan_structured` gives OpenAI's semantics: "required" / a named function -> calls (a
  request's own schema applies to content, of which there is none); "auto" with a schema
  -> one union grammar of calls or schema-valid content; ``parallel_tool_calls``.
- The union grammar, sampled under its token mask with random logits: every output is
  either calls (read here by splitting the frame and `json`, arguments valid under the
  tool's schema by `jsonschema`) or content valid under the request's schema -- and both
  happen; the frontend's call reader finds the same calls.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from radixlm.runtime.engine.sampling import Sampler
from radixlm.runtime.frontend.structured import CALL_SEPARATOR, plan_structured
from radixlm.runtime.grammar.bitmask import BatchMasker
from radixlm.runtime.grammar.compiler import GrammarCompiler
from radixlm.runtime.grammar.matcher import GrammarState
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.grammar.vocab import tokenizer_info
from radixlm.runtime.protocol import Generate, Input, NamedToolChoice, SamplingParams, Tool
from radixlm.tokenizer import Tokenizer
from radixlm.tokenizer.tools import call_frame

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
        calls = _reference_calls(text, fmt)
        if calls is not None:
            kinds.add("calls")
            for name, args in calls:
                tool = next(t for t in TOOLS if t.name == name)
                jsonschema.validate(args, tool.parameters)
            assert _read(fmt, text) == calls
        else:
            kinds.add("content")
            jsonschema.validate(json.loads(text), ANSWER)
            assert _read(fmt, text) is None
    assert kinds == {"calls", "content"}, kinds


def _reference_calls(text: str, fmt: str) -> list[tuple[str, object]] | None:
    """The calls of a union-grammar output by its construction: frame + JSON, joined by
    the separator; None when it is content (JSON without a call's keys)."""
    begin, end = call_frame(fmt)  # type: ignore[arg-type]
    calls = []
    for part in text.split(CALL_SEPARATOR + begin) if begin else text.split(CALL_SEPARATOR):
        body = part.removeprefix(begin).removesuffix(end)
        obj = json.loads(body)
        if set(obj) != {"name", "arguments"}:
            return None
        calls.append((obj["name"], obj["arguments"]))
    return calls


def _read(fmt: str, text: str) -> list[tuple[str, object]] | None:
    """The calls the frontend's call reader finds, fed three characters at a time."""
    reader = plan_structured(gen(tools=TOOLS), fmt).reader()  # type: ignore[arg-type]
    assert reader is not None
    for i in range(0, len(text), 3):
        reader.read(text[i:i + 3])
    reader.read("", final=True)
    return [(c.name, json.loads(c.arguments)) for c in reader.calls] if reader.calls else None
