"""Clients find a running server without being told where, and hear at once when there
is none: the default server (``radixlm serve`` without ``--endpoint``; the first one keeps
the role while it runs), ``$RADIXLM_ENDPOINT``, and a missing or refused endpoint
reported in milliseconds by `rl.connect`, `chat`, `generate`, `sessions` and `top`.

Every test here has a radixlm directory of its own (``$RADIXLM_RUNTIME_DIR``): none ever
touches the user's real default server."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import radixlm as rl
from conftest import ServerHandle, start_test_server
from radixlm.runtime.cli.top import Sample, render
from radixlm.runtime.protocol import Input, Message, OpenSession, SessionOpened
from radixlm.runtime.transport.discovery import default_endpoint, default_server
from radixlm.runtime.transport.probe import NoServerError, probe_endpoint
from radixlm.runtime.transport.raw_client import RawClient

CLI = [sys.executable, "-m", "radixlm.runtime.cli"]
# What the old code waited for in silence: rl.connect / chat 30 s, generate 60 s,
# sessions 10 s. A command that fails in well under this did not wait.
NO_WAIT_S = 20.0


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty radixlm directory of this test's own (inherited by what it starts)."""
    path = tmp_path / "rt"
    monkeypatch.setenv("RADIXLM_RUNTIME_DIR", str(path))
    monkeypatch.delenv("RADIXLM_ENDPOINT", raising=False)
    return path


def _stale_socket(path: Path) -> str:
    """A socket file nobody listens on (left by a server that was killed)."""
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()
    return f"ipc://{path}"


def _refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connecting is refused


def test_the_probe_answers_at_once(tmp_path: Path) -> None:
    for endpoint, says in [(f"ipc://{tmp_path}/missing", "does not exist"),
                           (_stale_socket(tmp_path / "stale"), "nothing listens there"),
                           (f"tcp://127.0.0.1:{_refused_port()}", "connection refused")]:
        started = time.monotonic()
        with pytest.raises(NoServerError, match=says):
            probe_endpoint(endpoint)
        assert time.monotonic() - started < 1.0


def test_rl_connect_to_nothing_fails_at_once_with_a_hint(root: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [(f"ipc://{tmp_path}/missing", "does not exist"),
             (_stale_socket(tmp_path / "stale"), "nothing listens there"),
             (f"tcp://127.0.0.1:{_refused_port()}", "connection refused"),
             (None, "no radixlm server is running.*default server's socket.*radixlm serve")]
    for endpoint, says in cases:
        started = time.monotonic()
        with pytest.raises(rl.NoServerError, match=says):
            rl.connect(endpoint, connect_timeout=120)
        assert time.monotonic() - started < 5.0  # (it would have waited 120 s)
    monkeypatch.setenv("RADIXLM_ENDPOINT", f"ipc://{tmp_path}/gone")
    with pytest.raises(rl.NoServerError, match=r"\$RADIXLM_ENDPOINT: .*gone does not exist"):
        rl.connect(connect_timeout=120)


@pytest.mark.parametrize("argv", [
    ["chat", "--endpoint", "ENDPOINT", "--message", "hi"],
    ["generate", "hi", "--endpoint", "ENDPOINT"],
    ["sessions", "--endpoint", "ENDPOINT", "--timeout", "120"],
    ["top", "--endpoint", "ENDPOINT", "--timeout", "120", "--once"],
    ["sessions", "--timeout", "120"],  # the default server, which does not run
    ["top", "--once", "--timeout", "120"],
])
def test_cli_clients_of_nothing_fail_at_once(argv: list[str], root: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/missing.sock"
    started = time.monotonic()
    proc = subprocess.run([*CLI, *(endpoint if a == "ENDPOINT" else a for a in argv)],
                          capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < NO_WAIT_S, proc
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "radixlm serve" in lines[0], proc.stderr
    assert ("missing.sock does not exist" in lines[0] if "ENDPOINT" in argv
            else "no radixlm server is running" in lines[0]), lines[0]


def _http_url(server: ServerHandle) -> str:
    match = re.search(r"HTTP API at (http://127\.0\.0\.1:(\d+)/v1)", server.log())
    assert match is not None and match.group(2) != "0", server.log()
    return match.group(1)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)


def test_the_default_server_is_found_and_the_first_one_keeps_it(root: Path, tmp_path: Path,
                                                                 tiny_model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with start_test_server(tmp_path / "a", tiny_model_dir, "--port", "0") as first:
        # `serve` without --endpoint: the default server, with the HTTP API on by default
        # (port 0 here: a free one, printed as bound).
        assert first.endpoint == default_endpoint(root)
        assert "the default server" in first.log()
        url = _http_url(first)
        with urllib.request.urlopen(f"{url}/models", timeout=30) as r:
            assert r.status == 200 and tiny_model_dir.name in r.read().decode()
        record = default_server(root)
        assert record is not None and (record.pid, record.http, record.ready) == (first.pid, url, True)
        with rl.connect() as client:
            assert client.endpoint == first.endpoint and client.kv_capacity == 4096

        with start_test_server(tmp_path / "b", tiny_model_dir, "--kv-tokens", "2048") as second:
            # The second one serves privately and says where; the first keeps its socket.
            assert second.endpoint != first.endpoint
            assert f"another server (pid {first.pid}) is this user's default" in second.log()
            with rl.connect() as client:
                assert client.kv_capacity == 4096
            with RawClient(first.endpoint, timeout_s=30) as raw:
                reference = raw.generate("Hi", max_tokens=3, temperature=0).text
            # The CLI's clients find it too.
            gen = _cli("generate", "Hi", "--raw", "--max-tokens", "3")
            assert gen.returncode == 0 and gen.stdout == reference + "\n", gen
            listed = _cli("sessions")
            assert listed.returncode == 0 and listed.stdout.startswith("SESSION"), listed
            top = _cli("top", "--once", "--interval", "0.1")
            assert top.returncode == 0 and "4096 tokens" in top.stdout, top
            chat = _cli("chat", "--message", "Hi", "--max-tokens", "2")
            assert chat.returncode == 0, chat
            assert f"connected to the default server at {first.endpoint}" in chat.stderr
            # $RADIXLM_ENDPOINT names another one.
            monkeypatch.setenv("RADIXLM_ENDPOINT", second.endpoint)
            with rl.connect() as client:
                assert client.kv_capacity == 2048
            monkeypatch.delenv("RADIXLM_ENDPOINT")

            first.stop()
            # Gone: no default until a server takes the role (the second one does not).
            assert default_server(root) is None and not Path(first.endpoint[6:]).exists()
            with pytest.raises(rl.NoServerError):
                rl.connect(connect_timeout=120)
            with start_test_server(tmp_path / "c", tiny_model_dir, "--kv-tokens", "1024") as third:
                assert third.endpoint == default_endpoint(root)
                with rl.connect() as client:
                    assert client.kv_capacity == 1024
            with RawClient(second.endpoint, timeout_s=30) as raw:
                assert raw.welcome is not None and raw.welcome.kv_capacity == 2048


@pytest.mark.usefixtures("pool_integrity")
def test_generate_uses_the_chat_template_unless_raw(server: ServerHandle) -> None:
    prompt, system = "Tell me about the fox.", "Be brief."
    with server.client() as c:
        chat = c.generate(Input(messages=[Message(role="user", content=prompt)]),
                          max_tokens=8, temperature=0).text
        with_system = c.generate(Input(messages=[Message(role="system", content=system),
                                                 Message(role="user", content=prompt)]),
                                 max_tokens=8, temperature=0).text
        raw = c.generate(Input(text=prompt), max_tokens=8, temperature=0).text
    base = ["generate", prompt, "--endpoint", server.endpoint, "--max-tokens", "8"]
    assert _cli(*base).stdout == chat + "\n"
    assert _cli(*base, "--system", system).stdout == with_system + "\n"
    assert _cli(*base, "--raw").stdout == raw + "\n"


@pytest.mark.usefixtures("pool_integrity")
def test_top_once_shows_what_the_server_reports(server: ServerHandle) -> None:
    with server.client() as owner:
        opened = owner.call(OpenSession(rid="top-s", input=Input(text="Once upon a time")))
        assert isinstance(opened, SessionOpened)
        owner.generate("Hello", max_tokens=4, temperature=0)
        stats = owner.stats()
        out = _cli("top", "--once", "--interval", "0.1", "--endpoint", server.endpoint)
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert f"running {stats.running}  waiting {stats.waiting}" in text, text
        assert f"sessions {stats.sessions}" in text
        assert f"{stats.capacity} tokens" in text
        assert (f"protected(#) {stats.protected}  private(+) {stats.private}  evictable(=) "
                f"{stats.evictable}  free(.) {stats.free}") in text, text
        share = 100.0 * stats.cached_tokens_total / stats.prompt_tokens_total
        assert f"hit rate {share:.1f}% ({stats.cached_tokens_total}/{stats.prompt_tokens_total}" in text
        assert opened.session[:8] in text  # another client's session: its id prefix


def test_top_rates_are_over_the_interval(server: ServerHandle) -> None:
    with server.client() as c:
        welcome, stats = c.welcome, c.stats()
    assert welcome is not None
    import msgspec

    later = msgspec.structs.replace(
        stats, generated_tokens_total=stats.generated_tokens_total + 100,
        prompt_tokens_total=stats.prompt_tokens_total + 300,
        cached_tokens_total=stats.cached_tokens_total + 200)
    lines = render(welcome, "E", Sample(12.0, later, []), Sample(10.0, stats, []))
    assert ("throughput decode 50.0 tok/s  prefill 50.0 tok/s  |  cache hit 66.7% of 300 "
            "prompt tokens  (last 2.0 s)") in lines


def test_top_refreshes_in_place_until_ctrl_c(server: ServerHandle) -> None:
    from pty_session import CTRL_C, PtySession

    with PtySession([*CLI, "top", "--interval", "0.2", "--endpoint", server.endpoint]) as term:
        for _ in range(3):  # redrawn, over and over
            term.expect(r"KV pool", 60)
        term.type(CTRL_C)
        assert term.wait(30) == 0, term.output
        assert "Traceback" not in term.output


def test_the_default_record_is_json(root: Path) -> None:
    """What other tools may read: the lock file's record (see docs/architecture.md)."""
    from radixlm.runtime.transport.discovery import DefaultServer, claim_default, runtime_root

    claim = claim_default(runtime_root())
    assert not isinstance(claim, DefaultServer)
    try:
        claim.publish(DefaultServer(os.getpid(), claim.endpoint, "http://x/v1", ready=True))
        assert json.loads((root / "default.lock").read_text())["http"] == "http://x/v1"
        held = claim_default(root)  # a second claim: refused, told who holds it
        assert isinstance(held, DefaultServer) and held.pid == os.getpid()
    finally:
        claim.release()
    assert default_server(root) is None


def test_engine_http_on_a_free_port(tiny_model_dir: Path) -> None:
    """rl.Engine(http="HOST:0"): the URL it gives has the port the server bound."""
    with rl.Engine(str(tiny_model_dir), device="cpu", kv_tokens=1024, threads=1,
                   http="127.0.0.1:0") as engine:
        assert engine.http_url is not None and not engine.http_url.endswith(":0/v1")
        with urllib.request.urlopen(f"{engine.http_url}/models", timeout=30) as r:
            assert r.status == 200 and tiny_model_dir.name in r.read().decode()


def test_a_new_server_takes_over_from_a_killed_default(root: Path, tmp_path: Path,
                                                       tiny_model_dir: Path) -> None:
    """SIGKILL frees the role at once (the lock goes with its holder), while the killed
    server's frontend may still hold the socket for a moment (here: held stopped): the
    next server replaces it rather than failing with "in use"."""
    import signal

    with start_test_server(tmp_path / "a", tiny_model_dir) as killed:
        frontend = next(p for p in killed.child_pids
                        if b"frontend" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(frontend, signal.SIGSTOP)  # it cannot go away before the next one starts
        try:
            os.kill(killed.pid, signal.SIGKILL)
            killed.process.wait()
            with start_test_server(tmp_path / "b", tiny_model_dir,
                                   "--kv-tokens", "1024") as after:
                assert after.endpoint == default_endpoint(root)
                with rl.connect() as client:
                    assert client.kv_capacity == 1024
        finally:
            os.kill(frontend, signal.SIGKILL)
