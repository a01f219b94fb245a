"""Tools and JSON mode through the HTTP API (the engine's structured generation).

Until the engine implements grammars and tools it refuses them with invalid_params
("... not supported yet"): these tests then skip, naming the missing engine feature.
The reference for JSON output is the `jsonschema` package."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from http_helpers import WEATHER, accumulate_calls

pytestmark = pytest.mark.timeout(180)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _skip_if_unsupported(e: openai.BadRequestError, feature: str) -> None:
    if "not supported" in str(e):
        pytest.skip(f"the engine does not implement {feature} yet: {e.body}")


def test_json_schema_output_validates(http_server, api) -> None:  # noqa: ANN001
    try:
        r = api.chat.completions.create(
            model=http_server.model, messages=[{"role": "user", "content": "A person"}],
            max_tokens=60, temperature=0, response_format={
                "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    except openai.BadRequestError as e:
        _skip_if_unsupported(e, "response_format json_schema (SamplingParams.json_schema)")
        raise
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_mode(http_server, api) -> None:  # noqa: ANN001
    try:
        r = api.chat.completions.create(
            model=http_server.model, messages=[{"role": "user", "content": "JSON please"}],
            max_tokens=60, temperature=0, response_format={"type": "json_object"})
    except openai.BadRequestError as e:
        _skip_if_unsupported(e, "response_format json_object (SamplingParams.json_schema)")
        raise
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_invalid_schema_is_a_400(http_server, api) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(
            model=http_server.model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})


def test_required_tool_call(http_server, api) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    try:
        r = api.chat.completions.create(model=http_server.model, messages=messages,
                                        tools=[WEATHER], tool_choice="required", max_tokens=120,
                                        temperature=0)
    except openai.BadRequestError as e:
        _skip_if_unsupported(e, "tools / tool_choice (Generate.tools, Done.tool_calls)")
        raise
    choice = r.choices[0]
    if choice.finish_reason == "length":
        pytest.skip("the tiny model ran out of tokens inside the call")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # The call and its result go back as history: a tool message answering the call id.
    follow = api.chat.completions.create(model=http_server.model, max_tokens=5, temperature=0,
                                         tools=[WEATHER], messages=[
        *messages, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Streamed: the call's index, id and name first, then its arguments in fragments.
    chunks = list(api.chat.completions.create(
        model=http_server.model, messages=messages, tools=[WEATHER], tool_choice="required",
        max_tokens=120, temperature=0, stream=True))
    calls = accumulate_calls(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_responses_function_call_round_trip(http_server, api) -> None:  # noqa: ANN001
    tool = {"type": "function", **WEATHER["function"]}
    try:
        r = api.responses.create(model=http_server.model, input="Weather in Oslo?",
                                 tools=[tool], tool_choice="required", max_output_tokens=120,
                                 temperature=0)
    except openai.BadRequestError as e:
        _skip_if_unsupported(e, "tools / tool_choice (Generate.tools, Done.tool_calls)")
        raise
    if r.status != "completed":
        pytest.skip("the tiny model ran out of tokens inside the call")
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
    nxt = api.responses.create(model=http_server.model, previous_response_id=r.id, tools=[tool],
                               max_output_tokens=5, temperature=0, input=[
                                   {"type": "function_call_output", "call_id": calls[0].call_id,
                                    "output": "cold"}])
    assert nxt.usage.input_tokens_details.cached_tokens == (r.usage.input_tokens
                                                             + r.usage.output_tokens)


def test_tool_call_history_messages_render(http_server, api) -> None:  # noqa: ANN001
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    try:
        r = api.chat.completions.create(model=http_server.model, messages=messages,
                                        max_tokens=4, temperature=0)
    except openai.BadRequestError as e:
        _skip_if_unsupported(e, "tool-call messages (Message.tool_calls)")
        raise
    assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("stop", "length",
                                                                          "tool_calls")


def test_auto_tools_reply_or_call(http_server, api) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    try:
        r = api.chat.completions.create(model=http_server.model, messages=messages,
                                        tools=[WEATHER], max_tokens=24, temperature=0)
    except openai.BadRequestError as e:
        _skip_if_unsupported(e, "tools with tool_choice auto (Generate.tools)")
        raise
    choice = r.choices[0]
    streamed = list(api.chat.completions.create(model=http_server.model, messages=messages,
                                                tools=[WEATHER], max_tokens=24, temperature=0,
                                                stream=True))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        calls = accumulate_calls(streamed)
        assert [c["name"] for c in calls] == [c.function.name
                                              for c in choice.message.tool_calls]
    else:
        # A plain reply: streamed (held back only while it might still become a call).
        assert "".join(d.content or "" for d in deltas) == choice.message.content
        assert streamed[-1].choices[0].finish_reason == choice.finish_reason
