"""SIGTERM drains (issue 24): `radixlm serve` stops taking new requests, lets the running
ones finish (up to --drain-timeout; those still running then fail with a message that
says so), closes sessions and exits 0; a second signal stops it at once.

The running request is held in place by stopping the engine process (SIGSTOP) while the
signal arrives, so "running" never depends on how fast the tiny model decodes."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from radixlm.runtime.protocol import (
    Done,
    Error,
    ErrorCode,
    Generate,
    Input,
    SamplingParams,
)
from radixlm.runtime.raw_client import RawClient, ServerError

from tests.conftest import start_test_server
from tests.test_trust_liveness import role_pid

pytestmark = pytest.mark.timeout(180)
MAX_TOKENS = 40


def _wait_exit(proc, timeout_s: float) -> int:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while (code := proc.poll()) is None:
        assert time.monotonic() < deadline, "the server did not exit"
        time.sleep(0.05)
    return code


def _start(client: RawClient) -> None:
    client.send(Generate(rid="long", input=Input(text="Once upon a time"), stream=True,
                         sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))


def _until_end(client: RawClient) -> Done | Error:
    while True:
        reply = client.recv_for("long", 60)
        if isinstance(reply, (Done, Error)):
            return reply


def test_sigterm_lets_running_requests_finish(tmp_path: Path, tiny_model_dir: Path) -> None:
    with start_test_server(tmp_path, tiny_model_dir, "--drain-timeout", "60") as server, \
            server.client(timeout_s=60) as running:
        engine = role_pid(server.pid, "engine")
        _start(running)
        os.kill(engine, signal.SIGSTOP)  # the request waits in the engine, unfinished
        try:
            time.sleep(0.3)
            server.process.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert server.process.poll() is None, "it stopped without draining"
            with pytest.raises(ServerError) as refused, \
                    server.client(timeout_s=30) as late:  # new work is refused meanwhile
                late.generate("hello", max_tokens=2)
            assert refused.value.error.code == ErrorCode.ENGINE_UNAVAILABLE
            assert "stopping" in refused.value.error.message
        finally:
            os.kill(engine, signal.SIGCONT)
        end = _until_end(running)
        assert isinstance(end, Done) and len(end.token_ids) == MAX_TOKENS, end
        assert _wait_exit(server.process, 60) == 0
        log = server.log()
        assert "taking no new requests" in log and "stopped on SIGTERM" in log, log


def test_the_drain_timeout_fails_what_still_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    with start_test_server(tmp_path, tiny_model_dir, "--drain-timeout", "1") as server, \
            server.client(timeout_s=60) as running:
        engine = role_pid(server.pid, "engine")
        _start(running)
        os.kill(engine, signal.SIGSTOP)
        try:
            time.sleep(0.3)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            end = _until_end(running)
            assert isinstance(end, Error) and end.code == ErrorCode.ENGINE_UNAVAILABLE, end
            assert "stopped (SIGTERM) before this request finished" in end.message, end
            assert "--drain-timeout" in end.message
            assert time.monotonic() - started < 30
        finally:
            os.kill(engine, signal.SIGCONT)
        assert _wait_exit(server.process, 60) == 0


def test_a_second_signal_stops_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    with start_test_server(tmp_path, tiny_model_dir, "--drain-timeout", "120") as server, \
            server.client(timeout_s=60) as running:
        engine = role_pid(server.pid, "engine")
        _start(running)
        os.kill(engine, signal.SIGSTOP)
        try:
            time.sleep(0.3)
            server.process.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            assert server.process.poll() is None  # draining
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            _wait_exit(server.process, 30)
            assert time.monotonic() - started < 15
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGCONT)
        assert "stopping at once" in server.log()
