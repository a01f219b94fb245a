"""Streamed tool calls and tools beside a response format, through the `openai` client.

References: `json`/`jsonschema` for arguments and content, the non-streamed reply of the
same greedy request for what the stream must add up to, and OpenAI's chunk / event
shapes as the `openai` client parses them.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from http_helpers import WEATHER, accumulate_calls

pytestmark = pytest.mark.timeout(180)

ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 16}},
          "required": ["answer"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def test_streamed_call_arguments_arrive_in_fragments(http_server, api) -> None:  # noqa: ANN001
    kw = dict(model=http_server.model, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
              max_tokens=120, temperature=0, parallel_tool_calls=False)
    whole = api.chat.completions.create(**kw)
    chunks = list(api.chat.completions.create(**kw, stream=True))
    calls = accumulate_calls(chunks)
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert calls[0]["fragments"] > 1, "the arguments came in one piece"
    args = json.loads(calls[0]["arguments"])  # the fragments make valid JSON
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert args == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_streamed_text_with_tools_bound_is_not_held_to_the_end(http_server, api) -> None:  # noqa: ANN001
    """tool_choice auto on the tiny model: what it writes is not a call, and streams as it
    is made (only a start that may be a call's '{' would wait)."""
    kw = dict(model=http_server.model, messages=[{"role": "user", "content": "Say hi"}],
              tools=[WEATHER], max_tokens=24, temperature=0, seed=3)
    whole = api.chat.completions.create(**kw)
    if whole.choices[0].message.tool_calls:
        pytest.skip("the tiny model wrote a call")
    chunks = list(api.chat.completions.create(**kw, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(texts) == whole.choices[0].message.content
    assert len(texts) > 3


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_auto_with_a_schema_is_a_call_or_schema_valid_content(http_server, api, seed) -> None:  # noqa: ANN001
    r = api.chat.completions.create(model=http_server.model, messages=MESSAGES, tools=[WEATHER],
                                    response_format=FORMAT, max_tokens=80, temperature=1.0,
                                    seed=seed)
    choice = r.choices[0]
    if choice.finish_reason == "length":
        pytest.skip("ran out of tokens inside the match")
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                WEATHER["function"]["parameters"])
    else:
        jsonschema.validate(json.loads(choice.message.content), ANSWER)


def test_required_with_a_schema_is_a_call_and_the_answer_follows_the_schema(http_server, api) -> None:  # noqa: ANN001
    """OpenAI's semantics: "required" beside a schema gives a call; the answer after the
    tool's result (tool_choice none) follows the schema."""
    r = api.chat.completions.create(model=http_server.model, messages=MESSAGES, tools=[WEATHER],
                                    tool_choice="required", response_format=FORMAT,
                                    max_tokens=120, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    follow = api.chat.completions.create(
        model=http_server.model, tools=[WEATHER], tool_choice="none", response_format=FORMAT,
        max_tokens=60, temperature=0, messages=[
            *MESSAGES, msg.model_dump(exclude_none=True),
            *[{"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in msg.tool_calls]])
    if follow.choices[0].finish_reason != "length":
        jsonschema.validate(json.loads(follow.choices[0].message.content), ANSWER)


def test_responses_stream_function_call_events(http_server, api) -> None:  # noqa: ANN001
    tool = {"type": "function", **WEATHER["function"]}
    kw = dict(model=http_server.model, input="Weather in Oslo?", tools=[tool],
              tool_choice="required", max_output_tokens=120, temperature=0,
              parallel_tool_calls=False, text={"format": {"type": "json_schema", "name": "a",
                                                          "schema": ANSWER}})
    events = list(api.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] and added[0].item.name == "get_weather"
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 1 and kinds.index("response.output_item.added") < kinds.index(
        "response.function_call_arguments.delta")
    assert "".join(d.delta for d in deltas) == done.arguments
    jsonschema.validate(json.loads(done.arguments), tool["parameters"])
    final = events[-1].response
    assert [o.type for o in final.output] == ["function_call"]
    assert final.output[0].arguments == done.arguments and final.output[0].call_id == added[0].item.call_id
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # The streamed response is stored: continuing it hits its whole history.
    nxt = api.responses.create(model=http_server.model, previous_response_id=final.id,
                               tools=[tool], max_output_tokens=4, temperature=0, input=[
                                   {"type": "function_call_output",
                                    "call_id": final.output[0].call_id, "output": "cold"}])
    assert nxt.usage.input_tokens_details.cached_tokens == (final.usage.input_tokens
                                                             + final.usage.output_tokens)
