"""Bounded HTTP input (issue 24): request heads are limited before any route (and so before
the API key) runs; integers past 64 bits, deep nesting, and too many messages, tools or
parts are 400s in OpenAI's error shape, refused before anything is rendered; errors about
a dead engine name no internal endpoint or path."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import start_test_server
from http_helpers import API_KEY, HttpServer, free_port

from tests.server.test_engine_liveness import role_pid

pytestmark = pytest.mark.timeout(180)

LIMITS = {"--max-header-bytes": 8192, "--max-headers": 20, "--max-messages": 6,
          "--max-tools": 2, "--max-parts": 8}


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory, http_model_dir: Path) -> Iterator[HttpServer]:
    port = free_port()
    flags = [str(x) for kv in LIMITS.items() for x in kv]
    with start_test_server(tmp_path_factory.mktemp("bounded"), http_model_dir, "--http",
                           f"127.0.0.1:{port}", "--api-key", API_KEY, *flags) as handle:
        yield HttpServer(handle, f"http://127.0.0.1:{port}", http_model_dir.name, http_model_dir)


def _error(status: int, body: object, expect: int, *, param: str | None = None,
           code: str | None = None) -> dict[str, object]:
    assert status == expect, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _raw(server: HttpServer, head: bytes, *, send_all: bool = True) -> tuple[int, bytes]:
    """Send a raw request head; (status, body) of the reply (0: the connection closed)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        try:
            s.sendall(head)
        except (BrokenPipeError, ConnectionResetError):
            if send_all:
                raise
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    if not data:
        return 0, b""
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def _chat(server: HttpServer, **fields: object) -> bytes:
    body: dict[str, object] = {"model": server.model, "max_tokens": 2,
                               "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return json.dumps(body).encode()


# -- request heads ---------------------------------------------------------------------------


def test_a_large_header_without_a_key_is_refused_with_431(bounded: HttpServer) -> None:
    big = b"x" * 200_000  # past the 8 KiB bound many times over
    for path in (b"/health", b"/v1/models"):
        status, body = _raw(bounded, b"GET " + path + b" HTTP/1.1\r\nhost: a\r\nx-big: " + big
                            + b"\r\n\r\n", send_all=False)
        err = _error(status, json.loads(body), 431, code="request_header_fields_too_large")
        assert "--max-header-bytes" in str(err["message"])
    assert bounded.request("GET", "/health", key=None)[0] == 200


def test_too_many_headers_are_refused_with_431(bounded: HttpServer) -> None:
    headers = b"".join(b"x-h%d: v\r\n" % i for i in range(21))
    status, body = _raw(bounded, b"GET /health HTTP/1.1\r\nhost: a\r\n" + headers + b"\r\n")
    err = _error(status, json.loads(body), 431)
    assert "--max-headers" in str(err["message"])
    status, _ = _raw(bounded, b"GET /health HTTP/1.1\r\nhost: a\r\nconnection: close\r\n"
                     + b"".join(b"x-h%d: v\r\n" % i for i in range(10)) + b"\r\n")
    assert status == 200


def test_heads_within_the_bounds_are_served_on_a_kept_alive_connection(bounded: HttpServer) -> None:
    one = (b"GET /v1/models HTTP/1.1\r\nhost: a\r\nauthorization: Bearer " + API_KEY.encode()
           + b"\r\nx-pad: " + b"p" * 6000 + b"\r\n\r\n")
    host, port = bounded.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        for _ in range(3):  # each request's head is counted on its own
            s.sendall(one)
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                reply += s.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


# -- values out of range, nesting ------------------------------------------------------------


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"max_completion_tokens": 2**64}, "max_completion_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"n": 2**70}, "n"),
    ({"top_k": 2**80}, "top_k"),
    ({"logprobs": True, "top_logprobs": 2**65}, "top_logprobs"),
    ({"stop_token_ids": [1, 2**64]}, "stop_token_ids[1]"),
])
def test_integers_past_64_bits_are_400(http_server: HttpServer, fields: dict, param: str) -> None:
    s, b = http_server.request("POST", "/v1/chat/completions", _chat(http_server, **fields))
    _error(s, b, 400, param=param)


def test_the_largest_seed_is_served(http_server: HttpServer) -> None:
    s, b = http_server.request("POST", "/v1/chat/completions",
                               _chat(http_server, seed=2**63 - 1, temperature=1.0))
    assert s == 200, b


def test_big_token_ids_are_400_on_every_route(http_server: HttpServer) -> None:
    model = http_server.model
    cases = [
        ("/v1/completions", {"model": model, "prompt": [1, 2**70], "max_tokens": 1}),
        ("/v1/completions", {"model": model, "prompt": [[2**64]], "max_tokens": 1}),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2**64}),
        ("/v1/detokenize", {"model": model, "tokens": [2**64]}),
        ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 2**70}),
    ]
    for path, body in cases:
        s, b = http_server.request("POST", path, json.dumps(body).encode())
        _error(s, b, 400)


def test_deep_nesting_is_400_not_a_server_error(http_server: HttpServer) -> None:
    deep = "[" * 20_000 + "]" * 20_000  # within --max-body-bytes (64 KiB)
    body = _chat(http_server).decode()[:-1] + f', "extra": {deep}}}'
    s, b = http_server.request("POST", "/v1/chat/completions", body.encode())
    _error(s, b, 400, code="invalid_json")
    schema: dict[str, object] = {"type": "string"}
    for _ in range(100):
        schema = {"type": "array", "items": schema}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    s, b = http_server.request("POST", "/v1/chat/completions",
                               _chat(http_server, response_format=fmt))
    _error(s, b, 400, param="response_format.json_schema.schema")
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    s, b = http_server.request("POST", "/v1/chat/completions", _chat(http_server, tools=[tool]))
    _error(s, b, 400, param="tools[0].parameters")
    s, b = http_server.request("POST", "/v1/chat/completions", _chat(http_server))
    assert s == 200, b


# -- counts ----------------------------------------------------------------------------------


def test_message_tool_and_part_counts_are_bounded(bounded: HttpServer) -> None:
    msg = {"role": "user", "content": "x"}
    model = bounded.model
    def tool(name: str = "f") -> dict[str, object]:
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}

    part = {"type": "text", "text": "y"}
    cases = [
        ("/v1/chat/completions", _chat(bounded, messages=[msg] * 7), "messages", "--max-messages"),
        ("/v1/chat/completions", _chat(bounded, tools=[tool(f"f{i}") for i in range(3)]), "tools", "--max-tools"),
        ("/v1/chat/completions", _chat(bounded, messages=[
            {"role": "user", "content": [part] * 5}, {"role": "user", "content": [part] * 4}]),
         "messages", "--max-parts"),
        ("/v1/responses", json.dumps({"model": model, "input": [msg] * 7}).encode(), "input",
         "--max-messages"),
        ("/v1/tokenize", json.dumps({"model": model, "messages": [msg] * 7}).encode(),
         "messages", "--max-messages"),
        ("/v1/conversations", json.dumps({"items": [msg] * 7}).encode(), "items",
         "--max-messages"),
    ]
    for path, body, param, flag in cases:
        s, b = bounded.request("POST", path, body)
        err = _error(s, b, 400, param=param, code="array_above_max_length")
        assert flag in str(err["message"]), err
    s, b = bounded.request("POST", "/v1/chat/completions", _chat(
        bounded, messages=[msg] * 6, tools=[tool("f0"), tool("f1")]))
    assert s == 200, b


# -- a dead engine ---------------------------------------------------------------------------


def test_errors_about_a_dead_server_name_no_internal_endpoint(
        tmp_path: Path, http_model_dir: Path) -> None:
    port = free_port()
    # --link-timeout: the HTTP process gives the frozen frontend up after 3 s, not 15.
    with start_test_server(tmp_path / "dead", http_model_dir, "--http",
                           f"127.0.0.1:{port}", "--api-key", API_KEY,
                           "--link-timeout", "3") as handle:
        server = HttpServer(handle, f"http://127.0.0.1:{port}", http_model_dir.name,
                            http_model_dir)
        frontend = role_pid(server.server.pid, "frontend")
        os.kill(frontend, signal.SIGSTOP)  # frozen: the HTTP process's link gives up on it
        t0 = time.monotonic()
        try:
            s, b = server.request("POST", "/v1/chat/completions", _chat(server))
        finally:
            os.kill(frontend, signal.SIGCONT)
        assert time.monotonic() - t0 < 12, "--link-timeout 3 was not applied (15 s default)"
        err = _error(s, b, 503)
        message = str(err["message"])
        assert "ipc://" not in message and "tcp://" not in message, message
        assert str(tmp_path) not in message and "/run/" not in message, message
        assert "/tmp" not in message, message
