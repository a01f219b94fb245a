"""/v1/messages through the real `anthropic` client (sync and async), the twins of the chat
completions checks (test_chat.py, test_tool_streaming.py, test_errors.py).

References: the engine spoken to directly over the protocol (the same generation without
the HTTP layer), the HF tokenizer (prompt lengths), the non-streamed reply of the same
greedy request (what a stream must add up to), `json` / `jsonschema`, and Anthropic's
event and error shapes as its SDK parses them (and, raw, as its docs give them).
"""

from __future__ import annotations

import asyncio
import json
import uuid

import jsonschema
import pytest
from http_helpers import API_KEY, real_anthropic

from tests.http.test_chat import _direct, _hf_prompt_len  # the chat twins' references

pytestmark = pytest.mark.timeout(180)

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string",
                                                                      "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 16}},
          "required": ["answer"], "additionalProperties": False}
GREEDY = {"temperature": 0}  # (the SDK takes sampling options as extra body fields)


@pytest.fixture
def claude(http_server, api):  # noqa: ANN001, ANN201 - `api` checks the pool afterwards
    client = real_anthropic().Anthropic(base_url=http_server.url, api_key=API_KEY, max_retries=0)
    yield client
    client.close()


def _events(body: str) -> list[tuple[str, dict]]:
    """A raw SSE body as (event name, data) pairs."""
    out = []
    for frame in body.strip().split("\n\n"):
        name, data = frame.split("\n", 1)
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_messages_match_the_engine_and_count_the_prompt(http_server, claude) -> None:  # noqa: ANN001
    hello = f"Hello {uuid.uuid4().hex[:6]}"
    r = claude.messages.create(model=http_server.model, max_tokens=12, system="Be brief.",
                               messages=[{"role": "user", "content": hello}], extra_body=GREEDY)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": hello}]
    done = _direct(http_server, chat, max_tokens=12, temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.model == http_server.model
    assert r.id.startswith("msg_") and [b.type for b in r.content] == ["text"]
    assert r.content[0].text == done.text
    assert r.stop_reason == ("max_tokens" if done.finish_reason == "length" else "end_turn")
    assert r.usage.input_tokens == _hf_prompt_len(http_server.model_dir, chat)
    assert r.usage.output_tokens == len(done.token_ids)
    # no cache_control: nothing is read or written, by Anthropic's rules
    assert r.usage.cache_read_input_tokens == 0 and r.usage.cache_creation_input_tokens == 0
    # system blocks are joined by a blank line, as are a message's text blocks
    blocks = claude.messages.create(
        model=http_server.model, max_tokens=12, extra_body=GREEDY,
        system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": hello}]}])
    joined = [{"role": "system", "content": "Be\n\nbrief."}, {"role": "user", "content": hello}]
    assert blocks.usage.input_tokens == _hf_prompt_len(http_server.model_dir, joined)
    assert blocks.content[0].text == _direct(http_server, joined, max_tokens=12,
                                             temperature=0).text


def test_stream_events_add_up_to_the_same_reply(http_server, claude) -> None:  # noqa: ANN001
    kw = dict(model=http_server.model, max_tokens=16, extra_body=GREEDY,
              messages=[{"role": "user", "content": f"Tell me {uuid.uuid4().hex[:6]}"}])
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == whole.content[0].text == final.content[0].text and len(texts) > 3
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    # the exact event sequence, raw
    body = json.dumps({**kw, "stream": True, "temperature": 0, "extra_body": None}).encode()
    status, text = http_server.request("POST", "/v1/messages", body)
    assert status == 200
    events = _events(text)
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(d["type"] == n for n, d in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens


def test_stop_sequences_and_sampling_options(http_server, claude) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Count: one two three"}]
    free = claude.messages.create(model=http_server.model, max_tokens=20, messages=messages,
                                  extra_body=GREEDY)
    text = free.content[0].text
    if len(text) >= 4:  # stop at a piece of the free reply: the reply ends just before it
        stop = text[2:4]
        cut = claude.messages.create(model=http_server.model, max_tokens=20, messages=messages,
                                     stop_sequences=[stop, "never-there"], extra_body=GREEDY)
        assert cut.content[0].text == text[:text.index(stop)]
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    seeded = dict(temperature=1.0, top_p=0.9, top_k=20, seed=11)
    a = claude.messages.create(model=http_server.model, max_tokens=8, messages=messages,
                               metadata={"user_id": "u1"}, extra_body=seeded)
    chat = [{"role": "user", "content": "Count: one two three"}]
    assert a.content[0].text == _direct(http_server, chat, max_tokens=8, **seeded).text


def test_async_client_and_count_tokens(http_server, api) -> None:  # noqa: ANN001
    from radixlm.runtime.protocol import Tool
    from radixlm.tokenizer.tools import generic_tool_prompt

    anthropic = real_anthropic()

    async def run() -> tuple:
        client = anthropic.AsyncAnthropic(base_url=http_server.url, api_key=API_KEY,
                                          max_retries=0)
        messages = [{"role": "user", "content": "Weather in Rome?"}]
        r = await client.messages.create(model=http_server.model, max_tokens=6,
                                         messages=messages, extra_body=GREEDY)
        async with client.messages.stream(model=http_server.model, max_tokens=6,
                                          messages=messages, extra_body=GREEDY) as s:
            streamed = await s.get_final_message()
        counted = await client.messages.count_tokens(model=http_server.model, messages=messages,
                                                     tools=[WEATHER], system="Be brief.")
        plain = await client.messages.count_tokens(model=http_server.model, messages=messages)
        await client.close()
        return r, streamed, counted, plain

    r, streamed, counted, plain = asyncio.run(run())
    assert streamed.content[0].text == r.content[0].text
    assert plain.input_tokens == r.usage.input_tokens == _hf_prompt_len(
        http_server.model_dir, [{"role": "user", "content": "Weather in Rome?"}])
    # the tiny model's template has no tools: radixlm's generic tool prompt joins the system
    tool = Tool(name=WEATHER["name"], description=WEATHER["description"],
                parameters=WEATHER["input_schema"])
    shown = [{"role": "system", "content": f"Be brief.\n\n{generic_tool_prompt([tool])}"},
             {"role": "user", "content": "Weather in Rome?"}]
    assert counted.input_tokens == _hf_prompt_len(http_server.model_dir, shown)


def test_models_in_anthropic_shape_when_asked(http_server, claude) -> None:  # noqa: ANN001
    page = claude.models.list()
    assert [m.id for m in page.data] == [http_server.model] and page.data[0].type == "model"
    assert claude.models.retrieve(http_server.model).display_name == http_server.model
    status, body = http_server.request("GET", "/v1/models")  # no anthropic-version: OpenAI's
    assert status == 200 and body["object"] == "list"
    anthropic = real_anthropic()
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.models.retrieve("claude-nope")
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"


# -- tools ---------------------------------------------------------------------------------------


def test_streamed_tool_input_arrives_in_fragments(http_server, claude) -> None:  # noqa: ANN001
    kw = dict(model=http_server.model, max_tokens=120, tools=[WEATHER], extra_body=GREEDY,
              tool_choice={"type": "any", "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                 and e.delta.type == "input_json_delta"]
    assert len(fragments) > 1, "the input came in one piece"
    args = json.loads("".join(fragments))
    jsonschema.validate(args, WEATHER["input_schema"])
    calls = [b for b in final.content if b.type == "tool_use"]
    assert [b.type for b in final.content] == ["tool_use"] and calls[0].name == "get_weather"
    assert calls[0].input == args == whole.content[0].input and calls[0].id.startswith("toolu_")
    assert final.stop_reason == whole.stop_reason == "tool_use"
    starts = [e for e in events if e.type == "content_block_start"]
    assert starts[0].content_block.type == "tool_use" and starts[0].content_block.input == {}
    assert not any(e.type == "text" for e in events)


def test_a_tool_loop(http_server, claude) -> None:  # noqa: ANN001
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = claude.messages.create(model=http_server.model, max_tokens=120, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=messages, extra_body=GREEDY)
    call = next(b for b in first.content if b.type == "tool_use")
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                   for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": [{"type": "text", "text": "cold"}]}]}]
    second = claude.messages.create(model=http_server.model, max_tokens=8, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=messages,
                                    extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in second.content)
    # the same conversation through chat completions: the same reply
    from http_helpers import HttpServer  # noqa: F401 - (the server's openai client)

    chat = http_server.openai().chat.completions.create(
        model=http_server.model, max_tokens=8, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {"name": WEATHER["name"],
                                                  "description": WEATHER["description"],
                                                  "parameters": WEATHER["input_schema"]}}],
        messages=[{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.id, "type": "function", "function": {
                          "name": call.name, "arguments": json.dumps(call.input)}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "cold"}])
    assert "".join(b.text for b in second.content) == (chat.choices[0].message.content or "")


def test_streamed_text_with_tools_bound_is_not_held_to_the_end(http_server, claude) -> None:  # noqa: ANN001
    kw = dict(model=http_server.model, max_tokens=24, tools=[WEATHER],
              messages=[{"role": "user", "content": "Say hi"}], extra_body={**GREEDY, "seed": 3})
    whole = claude.messages.create(**kw)
    if any(b.type == "tool_use" for b in whole.content):
        pytest.skip("the tiny model wrote a call")
    with claude.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
    assert "".join(texts) == "".join(b.text for b in whole.content) and len(texts) > 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_with_an_output_format_is_a_call_or_schema_valid_text(http_server, claude, seed) -> None:  # noqa: ANN001
    r = claude.messages.create(model=http_server.model, max_tokens=80, tools=[WEATHER],
                               messages=[{"role": "user", "content": "Weather in Paris?"}],
                               output_config={"format": {"type": "json_schema", "schema": ANSWER}},
                               extra_body={"temperature": 1.0, "seed": seed})
    if r.stop_reason == "max_tokens":
        pytest.skip("ran out of tokens inside the match")
    calls = [b for b in r.content if b.type == "tool_use"]
    if calls:
        assert r.stop_reason == "tool_use"
        for call in calls:
            jsonschema.validate(call.input, WEATHER["input_schema"])
    else:
        jsonschema.validate(json.loads(r.content[0].text), ANSWER)


def test_any_with_a_format_is_a_call_and_the_answer_follows_the_format(http_server, claude) -> None:  # noqa: ANN001
    fmt = {"format": {"type": "json_schema", "schema": ANSWER}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = claude.messages.create(model=http_server.model, max_tokens=120, tools=[WEATHER],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               output_config=fmt, messages=messages, extra_body=GREEDY)
    calls = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and calls
    follow = claude.messages.create(
        model=http_server.model, max_tokens=60, tools=[WEATHER], tool_choice={"type": "none"},
        output_config=fmt, extra_body=GREEDY, messages=[
            *messages, {"role": "assistant", "content": [c.model_dump(exclude_none=True)
                                                         for c in calls]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id,
                                          "content": "sunny"} for c in calls]}])
    if follow.stop_reason != "max_tokens":
        jsonschema.validate(json.loads(follow.content[0].text), ANSWER)


# -- errors ---------------------------------------------------------------------------------------


def _body(served: str, **fields: object) -> bytes:
    body = {"model": served, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


def _assert_error(status: int, body: object, expect: int, kind: str, says: str = "") -> None:
    assert status == expect, body
    assert isinstance(body, dict) and set(body) == {"type", "error", "request_id"}, body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and says in body["error"]["message"], body


@pytest.mark.parametrize(("fields", "status", "kind", "says"), [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"temperature": "hot"}, 400, "invalid_request_error", "Expected `float | null`"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request_error", "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "image"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error", "web_search_20250305"),
    ({"max_tokens": 100000}, 400, "invalid_request_error", ""),  # beyond the context
    ({"model": "claude-nope"}, 404, "not_found_error", "claude-nope"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "nope"),
])
def test_invalid_requests_get_anthropic_errors(http_server, fields, status, kind, says) -> None:  # noqa: ANN001
    s, b = http_server.request("POST", "/v1/messages", _body(http_server.model, **fields))
    _assert_error(s, b, status, kind, says)


def test_malformed_huge_and_unauthorized_requests(http_server) -> None:  # noqa: ANN001
    s, b = http_server.request("POST", "/v1/messages", b"{not json")
    _assert_error(s, b, 400, "invalid_request_error", "not valid JSON")
    big = _body(http_server.model, messages=[{"role": "user", "content": "x" * 100_000}])
    s, b = http_server.request("POST", "/v1/messages", big)
    _assert_error(s, b, 413, "request_too_large", "65536")
    long = _body(http_server.model, messages=[{"role": "user", "content": "word " * 5000}])
    _assert_error(*http_server.request("POST", "/v1/messages", long), 400, "invalid_request_error")
    for key in ("wrong", None):
        s, b = http_server.request("POST", "/v1/messages", _body(http_server.model), key=key)
        _assert_error(s, b, 401, "authentication_error", "API key")
    # x-api-key is a key as the bearer is, on every route
    ok = http_server.request("POST", "/v1/messages/count_tokens", _body(http_server.model),
                             key=None, headers={"x-api-key": API_KEY})
    assert ok[0] == 200 and ok[1]["input_tokens"] > 0
    assert http_server.request("GET", "/v1/models", key=None,
                               headers={"x-api-key": API_KEY})[0] == 200
    s, b = http_server.request("GET", "/v1/messages", headers={"anthropic-version": "2023-06-01"})
    _assert_error(s, b, 405, "invalid_request_error")


def test_sdk_errors_and_the_server_keeps_serving(http_server, claude) -> None:  # noqa: ANN001
    anthropic = real_anthropic()
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=http_server.model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "document", "source": {"type": "text",
                                                                          "data": "x"}}]}])
    assert "document" in e.value.message and e.value.body["error"]["type"] == "invalid_request_error"
    bad = anthropic.Anthropic(base_url=http_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=http_server.model, max_tokens=2,
                            messages=[{"role": "user", "content": "x"}])
    bad.close()
    for _ in range(3):
        http_server.request("POST", "/v1/messages", b"\xff\xfe")
    r = claude.messages.create(model=http_server.model, max_tokens=2,
                               messages=[{"role": "user", "content": "Still there?"}])
    assert r.stop_reason in ("end_turn", "max_tokens")


def test_a_template_that_opens_thinking_gives_thinking_blocks(tmp_path, http_model_dir) -> None:  # noqa: ANN001
    """A model whose generation header opens a ``<think>`` block (as DeepSeek-R1's) thinks
    from its first token: its output up to ``</think>`` is a thinking block, streamed as
    thinking_delta. Reference: `split_reasoning` (SGLang's rule) over the engine's own
    text for the same request."""
    import shutil

    from conftest import start_test_server
    from http_helpers import HttpServer, free_port
    from radixlm.sdk.reasoning import REASONING_FORMATS, split_reasoning

    model_dir = tmp_path / "thinking-model"
    shutil.copytree(http_model_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = config["chat_template"].replace(
        "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
    assert "<think>" in config["chat_template"]
    config_path.write_text(json.dumps(config))
    port = free_port()
    with start_test_server(tmp_path / "server", model_dir, "--http", f"127.0.0.1:{port}",
                           "--api-key", API_KEY) as handle:
        server = HttpServer(handle, f"http://127.0.0.1:{port}", model_dir.name, model_dir)
        claude = real_anthropic().Anthropic(base_url=server.url, api_key=API_KEY,
                                            max_retries=0)
        kw = dict(model=server.model, max_tokens=24, extra_body=GREEDY,
                  thinking={"type": "adaptive"}, messages=[{"role": "user", "content": "Why?"}])
        whole = claude.messages.create(**kw)
        with claude.messages.stream(**kw) as stream:
            events = list(stream)
            final = stream.get_final_message()
        claude.close()
        done = _direct(server, [{"role": "user", "content": "Why?"}], max_tokens=24,
                       temperature=0)
    reasoning, answer = split_reasoning(done.text, REASONING_FORMATS["deepseek-r1"])
    expect = [("thinking", reasoning)] + ([("text", answer.lstrip())] if answer.strip() else [])
    got = [(b.type, b.thinking if b.type == "thinking" else b.text) for b in whole.content]
    assert got == expect and whole.content[0].signature
    assert [(b.type, b.thinking if b.type == "thinking" else b.text) for b in final.content] == expect
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == reasoning
    assert [d.signature for d in deltas if d.type == "signature_delta"] == [whole.content[0].signature]
