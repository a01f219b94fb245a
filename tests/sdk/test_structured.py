"""Structured output through the SDK on the real engine (tiny model): `generate` with
regex / json_schema (text, dict, pydantic class) / ebnf / tools, `gen(...)` in programs,
and chat sessions whose `send(..., tools=...)` returns tool calls.

References: `re.fullmatch`, `jsonschema` and `json`; the pool is checked after each test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import radixlm as rl

pytestmark = pytest.mark.usefixtures("pool_integrity")

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
         "required": ["x", "y"], "additionalProperties": False}  # fmt: skip
CALC = {"type": "function", "function": {"name": "calc", "description": "arithmetic",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string", "maxLength": 8}},
                       "required": ["expr"], "additionalProperties": False}}}  # fmt: skip


@pytest.fixture(scope="module")
def engine(server: Any) -> Iterator[rl.Client]:
    with rl.connect(server.endpoint) as client:
        yield client


def test_generate_with_each_grammar_kind(engine: rl.Client) -> None:
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    out = engine.generate("Date:", regex=date, temperature=1.0, max_tokens=40, seed=1)
    assert re.fullmatch(date, out.text) and out.finish_reason == "stop"
    for schema in (POINT, json.dumps(POINT)):  # a dict or its JSON text
        out = engine.generate("Point:", json_schema=schema, temperature=1.0, max_tokens=60, seed=2)
        jsonschema.validate(json.loads(out.text), POINT)
    out = engine.generate("Answer:", ebnf='root ::= "yes" | "no"', temperature=1.0, seed=3)
    assert out.text in ("yes", "no")


def test_json_schema_from_a_pydantic_model(engine: rl.Client) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        label: str = pydantic.Field(max_length=6)

    out = engine.generate("Point:", json_schema=Point, temperature=1.0, max_tokens=60, seed=4)
    point = Point.model_validate_json(out.text)
    jsonschema.validate(json.loads(out.text), Point.model_json_schema())
    assert len(point.label) <= 6


def test_gen_in_a_program(engine: rl.Client) -> None:
    @rl.function
    def fill(s):
        s += "Point: " + rl.gen("point", json_schema=POINT, max_tokens=60)
        s += "\nDay: " + rl.gen("day", regex="(Mon|Tues|Wednes)day", max_tokens=8)

    state = fill.run(backend=engine, temperature=1.0, seed=5)
    jsonschema.validate(json.loads(state["point"]), POINT)
    assert state["day"] in ("Monday", "Tuesday", "Wednesday")


def test_tools_on_generate_and_in_a_chat_session(engine: rl.Client) -> None:
    out = engine.generate("Call:", tools=[CALC], tool_choice="required", temperature=1.0,
                          max_tokens=60, seed=6)
    assert out.tool_calls and out.tool_calls[0].name == "calc"
    jsonschema.validate(json.loads(out.tool_calls[0].arguments),
                        CALC["function"]["parameters"])  # type: ignore[index]
    # A session that starts with a system message: later turns do not render the tools
    # (the generic tool prompt would not fit the tiny model's 256-token context).
    with engine.session(system="Use tools.") as chat:
        reply = chat.send("2+2?", tools=[CALC], tool_choice={"type": "function",
                          "function": {"name": "calc"}}, temperature=1.0, max_tokens=60, seed=7)
        assert reply.tool_calls and reply.tool_calls[0].name == "calc"
        assert chat.history[-1]["tool_calls"][0]["name"] == "calc"
        free = chat.send("thanks", max_tokens=3, temperature=0)
        assert free.tool_calls is None


def test_bad_structured_arguments_are_errors(engine: rl.Client) -> None:
    with pytest.raises(rl.InvalidParamsError, match="parenthesis"):
        engine.generate("x", regex="(a", max_tokens=4)
    with pytest.raises(rl.InvalidParamsError, match="at most one"):
        engine.generate("x", regex="a", ebnf='root ::= "a"', max_tokens=4)
    with pytest.raises(TypeError, match="json_schema"):
        engine.generate("x", json_schema=42, max_tokens=4)
    out = engine.generate("x", regex="ok", max_tokens=4)
    assert out.text == "ok"
