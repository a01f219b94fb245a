"""Start-up: rl.Engine fails fast with the server's own message; no traceback for user
errors; runtime directories of killed servers are removed at the next start, and only
those whose owner is dead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import radixlm as rl
from radixlm.runtime.server.rundir import OWNER_FILE, remove_stale, write_owner

from tests.conftest import process_alive

CLI = [sys.executable, "-m", "radixlm.runtime.cli"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_dirs_of_dead_owners_are_removed(tmp_path: Path) -> None:
    dead, live, unowned, reused, other = (tmp_path / f"radixlm-{n}" for n in
                                          ("dead", "live", "unowned", "reused", "x"))
    for d in (dead, live, unowned, reused):
        d.mkdir()
    other = tmp_path / "someone-else"
    other.mkdir()
    write_owner(dead, _dead_pid())
    write_owner(live)  # this process: alive
    (other / OWNER_FILE).write_text(f"{_dead_pid()} 1\n")  # not ours by name
    # A live pid whose start time differs: the pid was reused, the owner is gone.
    (reused / OWNER_FILE).write_text(f"{os.getpid()} 1\n")
    removed = remove_stale(tmp_path)
    assert sorted(removed) == sorted([dead, reused])
    assert live.exists() and unowned.exists() and other.exists()
    assert not dead.exists() and not reused.exists()


def test_a_sigkilled_servers_dir_goes_at_the_next_start(tmp_path: Path, tiny_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    flags = ["--model", str(tiny_model_dir), "--device", "cpu", "--kv-tokens", "512",
             "--threads", "1", "--no-http"]

    def server_dirs() -> set[Path]:
        return {d for d in runtime.iterdir() if d.name.startswith("radixlm-")}

    def start(name: str) -> tuple[subprocess.Popen[bytes], Path]:
        endpoint_file = tmp_path / name
        before = server_dirs()
        proc = subprocess.Popen([*CLI, "serve", *flags, "--endpoint-file", str(endpoint_file)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.monotonic() + 240
        while not endpoint_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        (made,) = server_dirs() - before  # the server's private runtime directory
        return proc, made

    first, first_dir = start("first")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    deadline = time.monotonic() + 10
    while any(process_alive(p) for p in _pids_under(first_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first_dir.exists()  # SIGKILL: nothing cleaned up
    second, second_dir = start("second")
    try:
        assert not first_dir.exists() and second_dir.exists()
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(30)
    assert not second_dir.exists()


def _pids_under(directory: Path) -> list[int]:
    try:
        return [int((directory / OWNER_FILE).read_text().split()[0])]
    except OSError:
        return []


@pytest.mark.parametrize(("model", "flags", "expected"), [
    ("/no/such/model", {}, "not found"),
    (None, {"kv_tokns": 512}, "unknown keyword argument.s. kv_tokns"),
])
def test_engine_start_failure_is_immediate_and_says_why(tiny_model_dir: Path, model: str | None,
                                                        flags: dict[str, int], expected: str) -> None:
    started = time.monotonic()
    with pytest.raises(rl.EngineStartError, match=expected) as failed:
        rl.Engine(model or str(tiny_model_dir), device="cpu", startup_timeout=120, **flags)
    assert time.monotonic() - started < 60  # (was: the whole startup_timeout)
    assert "Traceback" not in str(failed.value)


def test_serve_prints_no_traceback_for_a_missing_model(tmp_path: Path) -> None:
    proc = subprocess.run([*CLI, "serve", "--model", str(tmp_path / "nope"), "--device", "cpu",
                           "--no-http"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "not found" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_default_cpu_pool_is_what_the_model_can_use(tiny_model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Not half of RAM: context length x max running requests (the tiny model: 256 x 64),
    and never more than CPU_MAX_BYTES of KV whatever the model."""
    import torch
    from radixlm.runtime.engine import pool_size
    from radixlm.runtime.model import ModelConfig, ModelRunner

    with rl.Engine(str(tiny_model_dir), device="cpu", threads=1) as engine:
        assert engine.kv_capacity == 256 * 64
    cfg = ModelConfig.from_dir(tiny_model_dir)
    monkeypatch.setattr(ModelRunner, "kv_bytes_per_token", staticmethod(lambda c, d: 2**20))
    monkeypatch.setattr(pool_size, "available_ram", lambda: 64 * 2**30)
    tokens = pool_size.kv_capacity(0, 0.5, cfg, torch.device("cpu"), torch.float32, 1,
                                   usable_tokens=10**6)
    assert tokens == pool_size.CPU_MAX_BYTES // 2**20
