"""Bad input gets a clear 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.timeout(120)


def _chat(model: str, **fields: object) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body.update(fields)
    return json.dumps(body).encode()


def _assert_error(status: int, body: object, expect_status: int, *, param: str | None = None,
                  says: str = "") -> None:
    assert status == expect_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and says in err["message"], err
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize(("body", "status", "param", "says"), [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "Expected `object`"),
    (b'{"model": "m"}', 400, None, "missing required field `messages`"),
    (json.dumps({"model": 3, "messages": []}).encode(), 400, "model", "Expected `str | null`"),
])
def test_malformed_bodies(http_server, body, status, param, says) -> None:  # noqa: ANN001
    s, b = http_server.request("POST", "/v1/chat/completions", body)
    _assert_error(s, b, status, param=param, says=says)


@pytest.mark.parametrize(("fields", "status", "param", "says"), [
    ({"temperature": "hot"}, 400, "temperature", "Expected `float | null`"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", ""),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "wizard"),
    ({"messages": []}, 400, "messages", "empty"),
    ({"n": 0}, 400, "n", "n must be"),
    ({"n": 65}, 400, "n", "n must be"),
    ({"top_p": 0}, 400, None, "top_p"),
    ({"max_tokens": -1}, 400, "max_tokens", ">= 0"),
    ({"max_tokens": 100000}, 400, None, ""),  # prompt + max_tokens beyond the context
    ({"response_format": {"type": "xml"}}, 400, "response_format.type", "xml"),
    ({"response_format": {"type": "json_schema"}}, 400, "response_format.json_schema", "schema"),
    ({"tool_choice": "sometimes"}, 400, "tool_choice", "sometimes"),
    ({"tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ({"stop": [str(i) for i in range(20)]}, 400, "stop", "16"),
    ({"session": {"id": "sess_nope"}}, 404, None, "sess_nope"),
])
def test_invalid_parameters(http_server, fields, status, param, says) -> None:  # noqa: ANN001
    s, b = http_server.request("POST", "/v1/chat/completions", _chat(http_server.model, **fields))
    _assert_error(s, b, status, param=param, says=says)


def test_unknown_fields_are_ignored(http_server) -> None:  # noqa: ANN001
    s, b = http_server.request("POST", "/v1/chat/completions",
                               _chat(http_server.model, frobnicate=True, temperature=0))
    assert s == 200 and b["choices"][0]["message"]["role"] == "assistant"


def test_unknown_model_route_and_ids(http_server, api) -> None:  # noqa: ANN001
    with pytest.raises(openai.NotFoundError) as e:
        api.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model=http_server.model, input="x", previous_response_id="resp_0")
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve("resp_0")
    s, b = http_server.request("GET", "/v1/nothing-here")
    _assert_error(s, b, 404, says="/v1/nothing-here")
    s, b = http_server.request("GET", "/v1/chat/completions")
    _assert_error(s, b, 405)


def test_huge_bodies_are_refused(http_server) -> None:  # noqa: ANN001
    big = _chat(http_server.model, messages=[{"role": "user", "content": "x" * 100_000}])
    s, b = http_server.request("POST", "/v1/chat/completions", big)
    _assert_error(s, b, 413, says="65536")
    s, b = http_server.request("POST", "/v1/responses", big)  # every route has the limit
    _assert_error(s, b, 413)
    # A body under the byte limit but far over the context: the engine's too_long, a 400.
    long = _chat(http_server.model, messages=[{"role": "user", "content": "word " * 5000}])
    s, b = http_server.request("POST", "/v1/chat/completions", long)
    _assert_error(s, b, 400)
    assert b["error"]["code"] == "context_length_exceeded"


def test_invalid_response_format_on_responses(http_server) -> None:  # noqa: ANN001
    body = json.dumps({"model": http_server.model, "input": "x",
                       "text": {"format": {"type": "yaml"}}}).encode()
    s, b = http_server.request("POST", "/v1/responses", body)
    _assert_error(s, b, 400, param="text.format.type", says="yaml")


def test_bad_or_missing_key(http_server) -> None:  # noqa: ANN001
    for key in ("wrong", None):
        s, b = http_server.request("POST", "/v1/chat/completions", _chat(http_server.model),
                                   key=key)
        _assert_error(s, b, 401, says="API key")
    bad = http_server.openai(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for route in ("/v1/conversations/conv_x", "/v1/models/m", "/v1/responses/r"):
        s, b = http_server.request("GET", route, key="wrong")
        _assert_error(s, b, 401, says="API key")
    # /metrics is open on loopback (as vLLM leaves it), unless --metrics-require-key
    s, b = http_server.request("GET", "/metrics", key=None)
    assert s == 200 and "radixlm_http_requests_total" in b


def test_the_server_keeps_serving_after_errors(http_server, api) -> None:  # noqa: ANN001
    for _ in range(3):
        http_server.request("POST", "/v1/chat/completions", b"\xff\xfe")
    r = api.chat.completions.create(model=http_server.model, max_tokens=2,
                                    messages=[{"role": "user", "content": "Still there?"}])
    assert r.choices[0].finish_reason in ("stop", "length")
