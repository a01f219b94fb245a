"""Fixtures of the HTTP API tests: one `radixlm serve --http` on a tiny model, with an
API key, shared by the whole session, and `openai` clients pointed at it.

- ``http_model_dir`` (session): the tests' tiny Llama with a 2,048-token context.
- ``http_server`` (session, `HttpServer`): ``base_url`` (…/v1), ``url`` (root),
  ``server`` (the `ServerHandle` of conftest: ``endpoint``, ``log()``, ``client()``),
  ``model`` (the served model id), ``model_dir``.
- ``api`` (function, ``openai.OpenAI``): a client with the right key; after the test the
  engine's pool accounting is checked (free + evictable + protected == capacity, nothing
  private, nothing running).
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ServerHandle, assert_pool_clean, start_test_server

API_KEY = "test-key-7f3a"


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
                key: str | None = API_KEY, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """A raw HTTP request: (status, the JSON body, or the text if not JSON)."""
        conn = http.client.HTTPConnection(self.url.removeprefix("http://"), timeout=60)
        try:
            all_headers = {"content-type": "application/json", **(headers or {})}
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

    def openai(self, api_key: str = API_KEY, **kw: object):  # noqa: ANN201 - openai.OpenAI
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)


@pytest.fixture(scope="session")
def http_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 2,048-token context: room for rendered tool definitions."""
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("http-model"), "llama",
                                name="tiny-llama-2k", max_position_embeddings=2048)


@pytest.fixture(scope="session")
def http_server(tmp_path_factory: pytest.TempPathFactory, http_model_dir: Path) -> Iterator[HttpServer]:
    port = free_port()
    with start_test_server(tmp_path_factory.mktemp("http-server"), http_model_dir,
                           "--http", f"127.0.0.1:{port}", "--api-key", API_KEY,
                           "--max-body-bytes", "65536") as handle:
        yield HttpServer(handle, f"http://127.0.0.1:{port}", http_model_dir.name, http_model_dir)


@pytest.fixture
def api(http_server: HttpServer) -> Iterator[object]:
    client = http_server.openai()
    yield client
    client.close()
    with http_server.server.client(timeout_s=60) as raw:
        assert_pool_clean(raw)
