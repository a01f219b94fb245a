"""`radixlm serve` keeps its processes up: a frontend, engine or HTTP process that dies is
started again and the server goes on serving (durable sessions resumed, in-flight
requests of a dead engine failed with a message that says so); a role that keeps dying
stops the server instead of looping for ever (`supervise`, against a fake server)."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from radixlm.runtime.protocol import (
    CloseSession,
    Error,
    ErrorCode,
    Generate,
    Input,
    OpenSession,
    ResumeSession,
    SamplingParams,
    SessionOpened,
)
from radixlm.runtime.server.supervise import MAX_RESTARTS, WINDOW_S, supervise
from radixlm.runtime.transport.raw_client import RawClient

from tests.conftest import assert_pool_clean, process_alive, start_test_server
from tests.http_helpers import free_port
from tests.server.test_engine_liveness import role_pid

RESTART_S = 120.0


def wait_for(what: str, check, timeout_s: float = RESTART_S):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
            if value:
                return value
        except (AssertionError, OSError, TimeoutError):
            pass
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.1)


def serves(endpoint: str) -> bool:
    with RawClient(endpoint, timeout_s=5) as c:
        return c.generate(Input(text="hello"), max_tokens=2, temperature=0.0).finish_reason == "length"


@pytest.mark.parametrize("role", ["frontend", "engine"])
def test_a_killed_process_is_started_again_and_durable_sessions_resume(
        tmp_path: Path, tiny_model_dir: Path, role: str) -> None:
    with start_test_server(tmp_path, tiny_model_dir, "--state-dir", str(tmp_path / "state"),
                           "--page-size", "1") as server:
        with server.client() as c:
            opened = c.call(OpenSession(rid="o", durable=True, input=Input(text="Remember 42.")))
            assert isinstance(opened, SessionOpened) and opened.durable
            if role == "engine":  # a request running when it dies fails, saying why
                c.send(Generate(rid="long", input=Input(text="go"), sampling=SamplingParams(
                    max_tokens=200, temperature=0.0, ignore_eos=True)))
            old = role_pid(server.process.pid, role)
            os.kill(old, signal.SIGKILL)
            if role == "engine":
                failed = c.recv_for("long", timeout_s=RESTART_S)
                while not isinstance(failed, Error):
                    failed = c.recv_for("long", timeout_s=RESTART_S)
                assert failed.code == ErrorCode.ENGINE_UNAVAILABLE
                assert "restarted" in failed.message or "not answered" in failed.message
        new = wait_for(f"a new {role}", lambda: role_pid(server.process.pid, role) != old
                       and role_pid(server.process.pid, role))
        assert process_alive(new) and server.process.poll() is None
        wait_for("the server answering again", lambda: serves(server.endpoint))
        with server.client() as c:
            back = wait_for("the session resumable", lambda: isinstance(
                r := c.request(ResumeSession(rid=c.new_rid("r"), session=opened.session)),
                SessionOpened) and r)
            assert back.length == opened.length
            done = c.generate(Input(text=" And?"), session=opened.session, max_tokens=2,
                              temperature=0.0)
            assert done.session_length == done.usage.prompt_tokens + 2  # history + append + 2
            assert done.usage.prompt_tokens > opened.length
            c.call(CloseSession(rid="c", session=opened.session))
            assert_pool_clean(c)
        assert f"the {role} process was killed by signal 9" in server.log_path.read_text()


def test_a_killed_http_process_is_started_again(tmp_path: Path, tiny_model_dir: Path) -> None:
    port = free_port()
    with start_test_server(tmp_path, tiny_model_dir, "--port", str(port)) as server:
        url = f"http://127.0.0.1:{port}/health"
        assert urllib.request.urlopen(url, timeout=10).status == 200
        old = next(p for p in server.child_pids
                   if b"radixlm.runtime.http" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(old, signal.SIGKILL)
        wait_for("the HTTP API again", lambda: urllib.request.urlopen(url, timeout=2).status == 200)
        assert server.process.poll() is None


class FakeServer:
    """`RunningServer`'s `wait`/`processes`/`spawn` for `supervise`: a role dies at each
    `wait`, as the list says."""

    def __init__(self, deaths: list[str]) -> None:
        self.deaths = deaths
        self.processes: dict[str, object] = {}
        self.started: list[str] = []

    def wait(self) -> tuple[str, int]:
        return self.deaths.pop(0), -9

    def spawn(self, role: str) -> str:
        self.started.append(role)
        return role


def test_a_role_that_keeps_dying_stops_the_server_and_others_restart() -> None:
    now = [0.0]
    server = FakeServer(["frontend", "engine", "frontend", "frontend", "frontend", "frontend"])
    role, code = supervise(server, clock=lambda: now[0])  # type: ignore[arg-type]
    assert (role, code) == ("frontend", -9)
    assert server.started == ["frontend", "engine", "frontend", "frontend"]  # 4th death: stop
    assert MAX_RESTARTS == 3
    now[0] = 0.0
    server = FakeServer(["engine"] * 10)
    clock = iter(range(0, 10 * int(WINDOW_S), int(WINDOW_S)))  # one death a window: fine

    def tick() -> float:
        return float(next(clock))

    with pytest.raises(IndexError):  # (the fake runs out of deaths: it never gave up)
        supervise(server, clock=tick)  # type: ignore[arg-type]
    assert server.started == ["engine"] * 10
