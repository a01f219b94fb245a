"""Grammars and tool calls through the real frontend and engine (tiny model, CPU):
streaming, n > 1, stop strings, session turns, tool_choice, and bad input answered with
`invalid_params` while the server keeps serving (the pool is checked after each test).

References: `re.fullmatch`, `jsonschema`, `json`, and the concatenation of streamed
chunks against the final `Done`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from radixlm.runtime.protocol import (
    Chunk,
    CloseSession,
    Error,
    ErrorCode,
    ForkSession,
    Generate,
    Input,
    NamedToolChoice,
    OpenSession,
    SamplingParams,
    SessionOpened,
    SessionsForked,
    Tool,
)
from radixlm.runtime.transport.errors import EngineError
from radixlm.runtime.transport.raw_client import RawClient

pytestmark = pytest.mark.usefixtures("pool_integrity")

DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-9]{2}"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = Tool(name="get_weather", description="Weather in a city", parameters={
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"], "additionalProperties": False})  # fmt: skip
CALC = Tool(name="calc", parameters={
    "type": "object", "properties": {"expr": {"type": "string", "maxLength": 10}},
    "required": ["expr"], "additionalProperties": False})  # fmt: skip
SAMPLED: dict[str, Any] = {"temperature": 1.0, "max_tokens": 150}


def test_json_schema_stream_and_branches(raw_client: RawClient) -> None:
    chunks: list[Chunk] = []
    dones = raw_client.generate_n("Person:", n=2, stream=True, on_chunk=chunks.append, seed=3,
                                  json_schema=json.dumps(PERSON), **SAMPLED)
    for d in dones:
        assert d.finish_reason == "stop"
        jsonschema.validate(json.loads(d.text), PERSON)
        mine = [c for c in chunks if c.index == d.index]
        assert "".join(c.text for c in mine) == d.text
        assert [t for c in mine for t in c.token_ids] == d.token_ids


def test_regex_with_a_stop_string_and_max_tokens(raw_client: RawClient) -> None:
    done = raw_client.generate("Date:", regex=DATE, seed=1, **SAMPLED)
    assert re.fullmatch(DATE, done.text) and done.finish_reason == "stop"
    stopped = raw_client.generate("Date:", regex="[0-9]{4}-xyz-[0-9]{4}", stop=["-xyz"], seed=2,
                                  **SAMPLED)
    assert re.fullmatch("[0-9]{4}", stopped.text) and stopped.matched_stop == "-xyz"
    cut = raw_client.generate("Id:", regex="q{30}", max_tokens=3, temperature=1.0)
    assert cut.finish_reason == "length" and re.fullmatch("q+", cut.text) and len(cut.text) < 30


def test_ebnf(raw_client: RawClient) -> None:
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    for seed in range(3):
        done = raw_client.generate("Answer:", ebnf=grammar, seed=seed, **SAMPLED)
        assert re.fullmatch("yes|no|maybe [0-9]", done.text), done.text


def test_a_grammar_applies_to_its_session_turn_only(raw_client: RawClient) -> None:
    opened = raw_client.request(OpenSession(rid=raw_client.new_rid(), input=Input(text="Log:")))
    assert isinstance(opened, SessionOpened)
    sid = opened.session
    try:
        turn = raw_client.generate(Input(text=" date="), session=sid, regex=DATE, seed=4, **SAMPLED)
        assert re.fullmatch(DATE, turn.text)
        free = raw_client.generate(Input(text=" note="), session=sid, max_tokens=6,
                                   temperature=1.0, ignore_eos=True, seed=5)
        assert len(free.token_ids) == 6  # not held to the date grammar
        # The history grew by the constrained turn, then by this input and its 6 tokens.
        assert free.session_length is not None and turn.session_length is not None
        assert free.session_length >= turn.session_length + 1 + 6
    finally:
        raw_client.request(CloseSession(rid=raw_client.new_rid(), session=sid))


def test_forks_after_a_constrained_turn_continue_its_whole_history(raw_client: RawClient) -> None:
    """A fork of a session whose last turn was constrained holds that turn token-exactly:
    each fork's next (free) turn finds the whole history cached, and the grammar no longer
    applies to it."""
    opened = raw_client.request(OpenSession(rid=raw_client.new_rid(), input=Input(text="Log:")))
    assert isinstance(opened, SessionOpened)
    sid, forks = opened.session, []
    try:
        turn = raw_client.generate(Input(text=" date="), session=sid, regex=DATE, seed=6, **SAMPLED)
        assert re.fullmatch(DATE, turn.text) and turn.session_length is not None
        forked = raw_client.request(ForkSession(rid=raw_client.new_rid(), session=sid, n=2))
        assert isinstance(forked, SessionsForked) and len(forked.sessions) == 2
        forks = forked.sessions
        for i, fork in enumerate(forks):
            free = raw_client.generate(Input(text=" note="), session=fork, max_tokens=5,
                                       temperature=1.0, ignore_eos=True, seed=20 + i)
            assert len(free.token_ids) == 5
            # The first fork computes only its input; the second also finds that input,
            # inserted by its sibling after the same history.
            cached = free.usage.cached_tokens
            assert cached == turn.session_length if i == 0 else cached > turn.session_length
            assert free.session_length == free.usage.prompt_tokens + 5
    finally:
        for s in [sid, *forks]:
            raw_client.request(CloseSession(rid=raw_client.new_rid(), session=s))


@pytest.mark.parametrize("choice", ["required", NamedToolChoice(name="calc")],
                         ids=["required", "named"])
def test_tool_choice_forces_a_valid_call(raw_client: RawClient, choice: Any) -> None:
    for seed in range(3):
        rid = raw_client.new_rid()
        # Text input: the tools constrain and parse the output without being rendered (a
        # generic tool prompt does not fit the tiny model's 256-token context).
        raw_client.send(Generate(rid=rid, input=Input(text="Call:"), tools=[WEATHER, CALC],
                                 tool_choice=choice, parallel_tool_calls=False,
                                 sampling=SamplingParams(seed=seed, **SAMPLED)))
        done = raw_client.collect(rid)[0]
        assert done.tool_calls is not None and len(done.tool_calls) == 1, done.text
        call = done.tool_calls[0]
        tool = {"calc": CALC, "get_weather": WEATHER}[call.name]
        if isinstance(choice, NamedToolChoice):
            assert call.name == "calc"
        jsonschema.validate(json.loads(call.arguments), tool.parameters)
        assert call.id.startswith("call_")
        # The raw text is the generic format's JSON call (the tiny template has no tools).
        assert json.loads(done.text) == {"name": call.name, "arguments": json.loads(call.arguments)}


BAD: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("invalid-regex", {"regex": "(a"}, {}, "parenthesis"),
    ("invalid-ebnf", {"ebnf": "root ::= missing"}, {}, "missing"),
    ("schema-not-json", {"json_schema": "{nope"}, {}, "not valid JSON"),
    ("unsupported-schema", {"json_schema": '{"type": "tuple"}'}, {}, "tuple"),
    ("two-grammars", {"regex": "a", "json_schema": "{}"}, {}, "at most one"),
    ("tool-not-schema", {}, {"tools": [{"name": "f", "parameters": {"type": "object",
     "properties": {"x": {"type": "text"}}}}]}, "not a JSON Schema type"),
    ("unknown-named-tool", {}, {"tools": [{"name": "f"}], "tool_choice": {"name": "g"}},
     "not among tools"),
]  # fmt: skip


@pytest.mark.parametrize(("sampling", "fields", "needle"), [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_structured_input_is_invalid_params(raw_client: RawClient, sampling: dict[str, Any],
                                                fields: dict[str, Any], needle: str) -> None:
    import msgpack

    rid = raw_client.new_rid()
    raw_client.send_raw(msgpack.packb({"type": "generate", "rid": rid, "input": {"text": "x"},
                                       "sampling": sampling, **fields}))
    reply = raw_client.recv_for(rid)
    assert isinstance(reply, Error) and reply.code == ErrorCode.INVALID_PARAMS, reply
    assert needle in reply.message, reply.message
    done = raw_client.generate("x", regex="ok", temperature=1.0, max_tokens=8)
    assert done.text == "ok"  # still serving, grammars included


def test_server_error_type_is_raised_for_grammar_errors(raw_client: RawClient) -> None:
    with pytest.raises(EngineError):
        raw_client.generate("x", regex="[", max_tokens=4)
