"""Each API key is a tenant (a server with two keys, its own): stored responses, chat
sessions and conversations of one key are unknown to the other, and the cache is not
shared -- the ``cached_tokens`` PIN-recovery attack recovers nothing across keys, while
the same attack within one key (which shares its own cache) does recover the PIN, so the
test can tell. Also: /metrics behind --metrics-require-key, and /health that turns 503
while the engine is frozen (SIGSTOP) and 200 again after.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import start_test_server
from http_helpers import HttpServer, free_port

pytestmark = pytest.mark.timeout(300)

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
PIN = "4 8 2 1"
PREFIX = "Account note for the vault: the PIN is"


@pytest.fixture(scope="module")
def two_keys(tmp_path_factory: pytest.TempPathFactory, http_model_dir: Path) -> Iterator[HttpServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(f"# two tenants\n{KEY_A}\n{KEY_B}\n")
    port = free_port()
    with start_test_server(tmp_path_factory.mktemp("tenants"), http_model_dir,
                           "--http", f"127.0.0.1:{port}", "--api-key-file", str(keys),
                           "--metrics-require-key") as handle:
        yield HttpServer(handle, f"http://127.0.0.1:{port}", http_model_dir.name,
                         http_model_dir, KEY_A)


def _cached(client: openai.OpenAI, model: str, text: str) -> int:
    r = client.chat.completions.create(model=model, max_tokens=1, temperature=0,
                                       messages=[{"role": "user", "content": text}])
    return r.usage.prompt_tokens_details.cached_tokens


def _recover(client: openai.OpenAI, model: str) -> str | None:
    """Guess the PIN digit by digit from cached_tokens; None where no digit stands out."""
    known = ""
    _cached(client, model, PREFIX)  # the shared prefix is then cached for every guess
    for _ in range(4):
        scores = {d: _cached(client, model, f"{PREFIX} {known}{d}") for d in "0123456789"}
        best = max(scores.values())
        winners = [d for d, s in scores.items() if s == best]
        if len(winners) != 1:
            return None
        known += winners[0] + " "
    return known.strip()


def test_the_pin_attack_recovers_nothing_across_keys(two_keys: HttpServer) -> None:
    a, b = two_keys.openai(KEY_A), two_keys.openai(KEY_B)
    model = two_keys.model
    _cached(a, model, f"{PREFIX} {PIN}. Keep it safe.")  # the victim's prompt, cached for A
    assert _recover(b, model) is None  # B sees no difference between any two guesses
    assert _recover(a, model) == PIN  # the attack works where the cache is shared


def test_stored_objects_never_cross_keys(two_keys: HttpServer) -> None:
    a, b = two_keys.openai(KEY_A), two_keys.openai(KEY_B)
    model = two_keys.model
    r = a.responses.create(model=model, input="secret plan", max_output_tokens=3, temperature=0)
    for call in (lambda: b.responses.retrieve(r.id),
                 lambda: b.responses.delete(r.id),
                 lambda: b.responses.input_items.list(r.id),
                 lambda: b.responses.create(model=model, input="x", previous_response_id=r.id,
                                            max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert a.responses.retrieve(r.id).id == r.id  # still A's, untouched
    conv = a.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
    for call in (lambda: b.conversations.retrieve(conv.id),
                 lambda: b.conversations.items.list(conv.id),
                 lambda: b.conversations.delete(conv.id),
                 lambda: b.responses.create(model=model, input="x", conversation=conv.id,
                                            max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            call()
    chat = a.chat.completions.create(model=model, max_tokens=2, messages=[
        {"role": "user", "content": "hello"}], extra_body={"session": {}})
    sid = chat.model_extra["session"]["id"]
    s, _ = two_keys.request("GET", f"/v1/sessions/{sid}", key=KEY_B)
    assert s == 404
    s, _ = two_keys.request("GET", f"/v1/sessions/{sid}", key=KEY_A)
    assert s == 200
    with pytest.raises(openai.AuthenticationError):
        two_keys.openai("not-a-key").models.list()


def test_metrics_need_a_key_when_asked(two_keys: HttpServer) -> None:
    s, _ = two_keys.request("GET", "/metrics", key=None)
    assert s == 401
    s, body = two_keys.request("GET", "/metrics", key=KEY_B)
    assert s == 200 and "radixlm_http_requests_total" in body


def _engine_pid(two_keys: HttpServer) -> int:
    for pid in two_keys.server.child_pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine" in cmdline and b"radixlm.runtime.server.child" in cmdline:
            return pid
    raise AssertionError("no engine process among the server's children")


def test_health_is_503_while_the_engine_is_frozen(two_keys: HttpServer) -> None:
    assert two_keys.request("GET", "/health", key=None)[0] == 200
    pid = _engine_pid(two_keys)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        s, body = two_keys.request("GET", "/health", key=None)
        assert s == 503 and body["error"]["code"] == "engine_unavailable"
        assert time.monotonic() - started < 30
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while two_keys.request("GET", "/health", key=None)[0] != 200:
        assert time.monotonic() < deadline, "/health did not recover"
        time.sleep(0.2)


def test_http_beside_auth_dir(tmp_path: Path, http_model_dir: Path) -> None:
    """--http with --auth-dir: the HTTP process reaches the CURVE endpoint with the
    gateway key the frontend made and authorized; its key's tenant is not a CurveZMQ
    client's (alice's identical prompt finds nothing of it cached)."""
    import radixlm as rl

    from tests.transport.test_curve_auth import make_keys, serve

    auth = tmp_path / "auth"
    make_keys(auth, "alice")
    port = free_port()
    with serve(tmp_path, http_model_dir, "--auth-dir", str(auth), "--endpoint",
               "tcp://127.0.0.1:0", "--http", f"127.0.0.1:{port}", "--api-key", KEY_A) as (
            endpoint, log):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY_A,
                               max_retries=0)
        deadline = time.monotonic() + 60
        while True:  # serve() returns at the endpoint file; the HTTP API follows it
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        prompt = f"{PREFIX} {PIN}. Keep it safe."
        first = client.chat.completions.create(model=http_model_dir.name, max_tokens=2,
                                               temperature=0,
                                               messages=[{"role": "user", "content": prompt}])
        assert first.choices[0].finish_reason in ("stop", "length")
        assert _cached(client, http_model_dir.name, prompt) == first.usage.prompt_tokens - 1
        with rl.connect(endpoint, server_key=auth / "server.key",
                        client_key=auth / "clients" / "alice.key_secret") as alice:
            r = alice.generate(messages=[{"role": "user", "content": prompt}], max_tokens=1,
                               temperature=0)
            assert r.meta_info["cached_tokens"] == 0
        client.close()
