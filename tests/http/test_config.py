"""The HTTP frontend's flags, bind rule and stored-conversation expiry (no server)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from radixlm.runtime.http.config import (
    HttpConfig,
    HttpConfigError,
    check_bind,
    parse_listen,
    read_api_keys,
)
from radixlm.runtime.http.store import ConversationStore


@pytest.mark.parametrize(("text", "expect"), [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)),
    ("localhost:80", ("127.0.0.1", 80)),
    ("[::1]:9000", ("::1", 9000)),
    ("0.0.0.0:1", ("0.0.0.0", 1)),
    ("8080", ("127.0.0.1", 8080)),
])
def test_parse_listen(text: str, expect: tuple[str, int]) -> None:
    assert parse_listen(text) == expect


@pytest.mark.parametrize("text", ["nohost", ":80", "h:99999", "h:x", "*:80"])
def test_parse_listen_refuses(text: str) -> None:
    with pytest.raises(HttpConfigError):
        parse_listen(text)


def test_non_loopback_needs_a_key_or_insecure() -> None:
    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind(host, (), False)
    for host in ("0.0.0.0", "::", "192.0.2.7"):
        with pytest.raises(HttpConfigError, match="--insecure"):
            check_bind(host, (), False)
        check_bind(host, ("k",), False)
        check_bind(host, (), True)


def test_api_keys_from_flags_file_and_environment(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "keys"
    path.write_text("# the team's keys\ns3cret\n\n  other  \n")
    assert read_api_keys(None, str(path)) == ("s3cret", "other")
    assert read_api_keys(["k", "k2"], None) == ("k", "k2")
    assert read_api_keys(["k"], str(path), "envkey\nk") == ("k", "envkey", "s3cret", "other")
    assert read_api_keys(None, None) == ()
    with pytest.raises(HttpConfigError, match="cannot read"):
        read_api_keys(None, str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n# none\n")
    with pytest.raises(HttpConfigError, match="holds no key"):
        read_api_keys(None, str(tmp_path / "empty"))
    with pytest.raises(HttpConfigError, match="empty"):
        read_api_keys([" "], None)
    with pytest.raises(HttpConfigError, match="white space"):
        read_api_keys(["a b"], None)


def test_serve_refuses_a_public_bind_without_a_key_before_loading() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "radixlm.runtime.cli", "serve", "--model", "/nonexistent",
         "--http", "0.0.0.0:8999"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "without an API key" in result.stderr and "--insecure" in result.stderr


def test_store_expires_and_closes_sessions() -> None:
    closed: list[str] = []
    now = [100.0]
    store = ConversationStore(10.0, closed.extend, clock=lambda: now[0])
    store.put("a", "sa", 5)
    store.put("b", "sb", 7)
    now[0] = 105.0
    assert store.get("a") is not None  # use restarts the TTL
    now[0] = 112.0
    assert store.sweep() == 1 and closed == ["sb"]
    assert store.get("b") is None and store.get("a") is not None
    busy = store.get("a")
    assert busy is not None
    busy.busy = True  # a turn running on it: never expired under it
    now[0] = 200.0
    assert store.sweep() == 0 and store.get("a") is not None
    busy.busy = False
    now[0] = 300.0
    assert store.get("a") is None and closed == ["sb", "sa"]
    assert store.delete("a") is False and len(store) == 0


def test_an_error_after_the_first_event_is_the_last_event() -> None:
    import json

    import anyio
    from radixlm.runtime.http import sse
    from radixlm.runtime.http.errors import ApiError

    async def body():  # noqa: ANN202
        yield b"data: {}\n\n"
        raise ApiError(503, "the engine went away", type="server_error", code="engine_dead")

    async def collect(error_event: bool) -> list[bytes]:
        return [chunk async for chunk in sse._errors_as_events(body(), error_event)]

    chat = anyio.run(collect, False)
    assert chat[0] == b"data: {}\n\n" and len(chat) == 2
    assert json.loads(chat[1].removeprefix(b"data: ")) == {"error": {
        "message": "the engine went away", "type": "server_error", "param": None,
        "code": "engine_dead"}}
    kind, payload = anyio.run(collect, True)[1].split(b"\n", 1)
    assert kind == b"event: error"
    assert json.loads(payload.removeprefix(b"data: ")) == {
        "type": "error", "code": "engine_dead", "message": "the engine went away", "param": None}


def test_metrics_are_open_on_loopback_unless_asked() -> None:
    assert HttpConfig("ipc://x").metrics_public
    assert HttpConfig("ipc://x", api_keys=("k",)).metrics_public
    assert not HttpConfig("ipc://x", api_keys=("k",), metrics_require_key=True).metrics_public
    assert not HttpConfig("ipc://x", host="0.0.0.0", api_keys=("k",)).metrics_public
    assert HttpConfig("ipc://x", host="0.0.0.0", insecure=True).metrics_public
