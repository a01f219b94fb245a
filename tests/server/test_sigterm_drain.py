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
from collections.abc import Callable, Iterator
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
from radixlm.runtime.transport.errors import EngineError
from radixlm.runtime.transport.raw_client import RawClient

from tests.conftest import ServerHandle, start_test_server
from tests.server.test_engine_liveness import role_pid
from tests.server.test_fault_reports import wait_exit

pytestmark = pytest.mark.timeout(180)
MAX_TOKENS = 40


def _start(client: RawClient) -> None:
    client.send(Generate(rid="long", input=Input(text="Once upon a time"), stream=True,
                         sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))


def _until_end(client: RawClient) -> Done | Error:
    while True:
        reply = client.recv_for("long", 60)
        if isinstance(reply, (Done, Error)):
            return reply


@contextlib.contextmanager
def _held_request(tmp_path: Path, model: Path, drain_timeout: str
                  ) -> Iterator[tuple[ServerHandle, RawClient, Callable[[], None]]]:
    """A server with one generation running, held unfinished by a stopped engine: let
    it go with the callable (at the latest, when the block ends)."""
    with start_test_server(tmp_path, model, "--drain-timeout", drain_timeout) as server, \
            server.client(timeout_s=60) as running:
        engine = role_pid(server.pid, "engine")
        _start(running)
        os.kill(engine, signal.SIGSTOP)

        def release() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGCONT)

        try:
            time.sleep(0.3)
            yield server, running, release
        finally:
            release()


def test_sigterm_lets_running_requests_finish(tmp_path: Path, tiny_model_dir: Path) -> None:
    with _held_request(tmp_path, tiny_model_dir, "60") as (server, running, release):
        server.process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert server.process.poll() is None, "it stopped without draining"
        with pytest.raises(EngineError) as refused, \
                server.client(timeout_s=30) as late:  # new work is refused meanwhile
            late.generate("hello", max_tokens=2)
        assert refused.value.code == ErrorCode.ENGINE_UNAVAILABLE
        assert "stopping" in refused.value.message
        release()
        end = _until_end(running)
        assert isinstance(end, Done) and len(end.token_ids) == MAX_TOKENS, end
        assert wait_exit(server.process, 60) == 0
    log = server.log()
    assert "taking no new requests" in log and "stopped on SIGTERM" in log, log


def test_the_drain_timeout_fails_what_still_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    with _held_request(tmp_path, tiny_model_dir, "1") as (server, running, _):
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        end = _until_end(running)
        assert isinstance(end, Error) and end.code == ErrorCode.ENGINE_UNAVAILABLE, end
        assert "stopped (SIGTERM) before this request finished" in end.message, end
        assert "--drain-timeout" in end.message
        assert time.monotonic() - started < 30
    assert wait_exit(server.process, 60) == 0


def test_a_second_signal_stops_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    with _held_request(tmp_path, tiny_model_dir, "120") as (server, _running, _):
        server.process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert server.process.poll() is None  # draining
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        wait_exit(server.process, 30)
        assert time.monotonic() - started < 15
    assert "stopping at once" in server.log()
