"""Faults tell what happened (issue 24): a server stopped by SIGTERM says so (not its
last "ready at" line), a process killed by a signal is named with the signal, and a
client whose server went away is not told it dropped an oversized frame."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import radixlm as rl
from radixlm.runtime.server.exits import how_it_ended

from tests.conftest import start_test_server
from tests.server.test_engine_liveness import role_pid

pytestmark = pytest.mark.timeout(180)


def test_exit_words() -> None:
    assert how_it_ended(-9) == "was killed by signal 9 (SIGKILL)"
    assert how_it_ended(-15) == "was killed by signal 15 (SIGTERM)"
    assert how_it_ended(128 + 15) == "stopped on SIGTERM (exit code 143)"
    assert how_it_ended(1) == "exited with code 1"
    assert how_it_ended(0) == "exited with code 0"


def wait_exit(proc, timeout_s: float = 60.0) -> int:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while (code := proc.poll()) is None:
        assert time.monotonic() < deadline, "the server did not exit"
        time.sleep(0.05)
    return code


def test_a_server_stopped_by_sigterm_says_so(tiny_model_dir: Path) -> None:
    with rl.Engine(str(tiny_model_dir), device="cpu", kv_tokens=512, threads=1) as engine:
        assert engine.generate("hello", max_tokens=2)
        os.kill(engine.pid, signal.SIGTERM)
        wait_exit(engine.process.proc)
        reason = engine.process.exit_reason()
        assert reason is not None and "SIGTERM" in reason, reason
        assert "ready at" not in reason, reason


def test_a_killed_engine_is_named_with_its_signal_and_started_again(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    with start_test_server(tmp_path, tiny_model_dir) as server, \
            rl.connect(server.endpoint) as client:
        assert client.generate("hello", max_tokens=2)
        old = role_pid(server.pid, "engine")
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:  # requests fail while it restarts (engine_unavailable), then pass
            try:
                assert client.generate("hello", max_tokens=2)
                break
            except rl.EngineError as e:
                assert "max-message-bytes" not in str(e) and "larger than" not in str(e)
                assert time.monotonic() < deadline, e
                time.sleep(0.2)
        assert server.process.poll() is None and role_pid(server.pid, "engine") != old
        log = server.log()
        assert "the engine process was killed by signal 9 (SIGKILL); starting it again" in log
