"""Liveness end to end: a stopped engine (SIGSTOP) turns into engine_unavailable for
every request in flight within --engine-timeout, and new ones are refused the same way
while the frontend keeps answering; the engine coming back (SIGCONT) serves again. A
dead frontend is named in the SDK's error."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import radixlm as rl
from radixlm.runtime.protocol import (
    Error,
    ErrorCode,
    Generate,
    GetStats,
    Input,
    SamplingParams,
    Tokenize,
    Tokens,
)
from radixlm.runtime.transport.errors import EngineError

from tests.conftest import ServerHandle, assert_pool_clean, child_cmdlines, start_test_server

TIMEOUT_S = 2.0


def role_pid(server_pid: int, role: str) -> int:
    for pid, cmdline in child_cmdlines(server_pid).items():
        if b"radixlm.runtime.server.child" in cmdline and role.encode() in cmdline:
            return pid
    raise AssertionError(f"no {role} process under {server_pid}")


@pytest.fixture
def watched_server(tmp_path: Path, tiny_model_dir: Path) -> Iterator[ServerHandle]:
    with start_test_server(tmp_path, tiny_model_dir, "--engine-timeout", str(TIMEOUT_S)) as s:
        yield s


def test_a_stopped_engine_fails_requests_then_comes_back(watched_server: ServerHandle) -> None:
    engine = role_pid(watched_server.pid, "engine")
    with watched_server.client(timeout_s=30) as client:
        os.kill(engine, signal.SIGSTOP)
        try:
            started = time.monotonic()
            client.send(Generate(rid="g", input=Input(text="hello"), stream=True,
                                 sampling=SamplingParams(max_tokens=50)))
            client.send(GetStats(rid="s"))
            replies = {}
            while len(replies) < 2:
                reply = client.recv()
                if isinstance(reply, Error):
                    replies[reply.rid] = reply
            elapsed = time.monotonic() - started
            assert {r.code for r in replies.values()} == {ErrorCode.ENGINE_UNAVAILABLE}
            assert "not answered" in replies["s"].message
            assert elapsed < TIMEOUT_S + 10
            tokens = client.call(Tokenize(rid="t", input=Input(text="hi")))  # the frontend lives
            assert isinstance(tokens, Tokens)
            with pytest.raises(EngineError) as refused:  # new requests: refused at once
                client.call(GetStats(rid="s2"))
            assert refused.value.code == ErrorCode.ENGINE_UNAVAILABLE
        finally:
            os.kill(engine, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:  # back once the engine answers the frontend's next probe
            try:
                client.call(GetStats(rid=f"s{time.monotonic()}"))
                break
            except EngineError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        done = client.generate(Input(text="hello"), max_tokens=3, temperature=0.0)
        assert done.finish_reason == "length"
        assert_pool_clean(client)


def test_sdk_gets_engine_unavailable(watched_server: ServerHandle) -> None:
    engine = role_pid(watched_server.pid, "engine")
    with rl.connect(watched_server.endpoint, heartbeat_timeout=60) as client:
        os.kill(engine, signal.SIGSTOP)
        try:
            with pytest.raises(rl.EngineUnavailableError, match="engine process"):
                client.generate("hello", max_tokens=5)
        finally:
            os.kill(engine, signal.SIGCONT)


def test_a_killed_frontend_is_named_and_started_again(tiny_model_dir: Path) -> None:
    """The server outlives its frontend (runtime/server/supervise.py): the log names the
    dead process and its signal, and a new connection is served again."""
    with rl.Engine(str(tiny_model_dir), device="cpu", kv_tokens=512, threads=1) as engine:
        old = role_pid(engine.pid, "frontend")
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                with rl.connect(engine.process.endpoint) as again:
                    assert again.generate("hello", max_tokens=2).text is not None
                break
            except rl.EngineError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert role_pid(engine.pid, "frontend") != old
        assert "the frontend process was killed by signal 9 (SIGKILL); starting it again" \
            in engine.process.log_tail(200)
