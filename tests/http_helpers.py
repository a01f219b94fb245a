"""Shared by the HTTP API tests: a server handle with raw requests and `openai` clients,
a tool definition, and streamed tool calls put together as OpenAI's clients do."""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import ServerHandle

API_KEY = "test-key-7f3a"
OWN_KEY = "<the server's key>"  # the default of `request` and `openai`
SMOL_MODEL = "SmolLM2-135M-Instruct"  # the embedded default model's served name
SMOL_KEY = "agents-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class HttpServer:
    server: ServerHandle
    url: str
    model: str
    model_dir: Path
    api_key: str = API_KEY

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def request(self, method: str, path: str, body: bytes | None = None, *,
                key: str | None = OWN_KEY, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """A raw HTTP request: (status, the JSON body, or the text if not JSON)."""
        conn = http.client.HTTPConnection(self.url.removeprefix("http://"), timeout=60)
        try:
            all_headers = {"content-type": "application/json", **(headers or {})}
            if key == OWN_KEY:
                key = self.api_key
            if key is not None:
                all_headers["authorization"] = f"Bearer {key}"
            conn.request(method, path, body=body, headers=all_headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data.decode(errors="replace")

    def openai(self, api_key: str = OWN_KEY, **kw: object):  # noqa: ANN201 - openai.OpenAI
        import openai

        key = self.api_key if api_key == OWN_KEY else api_key
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, **kw)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}


def accumulate_calls(chunks: Any) -> list[dict[str, Any]]:
    """Streamed tool calls put together as OpenAI's clients do (by index)."""
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": "",
                                                "fragments": 0})
            if tc.id:
                assert entry["id"] is None, "a call's id comes once, first"
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                assert entry["name"] is not None, "the name comes before the arguments"
                entry["arguments"] += tc.function.arguments
                entry["fragments"] += 1
    return [calls[i] for i in sorted(calls)]


def real_anthropic():  # noqa: ANN201 - the `anthropic` module
    """The `anthropic` SDK: pytest (importlib mode) registers a checkout whose folder is
    named ``anthropic`` under that very name, which would shadow it (as for ``agents``)."""
    import sys

    repo = str(Path(__file__).resolve().parents[1])
    for name in [n for n in sys.modules if n == "anthropic" or n.startswith("anthropic.")]:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(repo):
            del sys.modules[name]
    import anthropic

    return anthropic
