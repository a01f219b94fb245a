"""Every start-up failure a user can cause is one line that says what to do, with no
traceback (``--debug`` shows one), and an address that is taken is found before the
model loads -- by the process that says "ready", so a taken port never gives a false
"ready" (another server answering the readiness probe)."""

from __future__ import annotations

import http.server
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import radixlm as rl

CLI = [sys.executable, "-m", "radixlm.runtime.cli"]


def _run(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _one_line(proc: subprocess.CompletedProcess[str], *expected: str) -> str:
    """The command failed with exactly one line on stderr, holding `expected`."""
    assert proc.returncode != 0, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture
def private_endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/s"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port where another HTTP server listens and answers /health with 200: what made
    `radixlm serve --http` print a false "ready"."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        yield other.server_address[1]
    finally:
        other.shutdown()
        other.server_close()


def test_a_taken_http_port_is_one_line_before_anything_starts(
        taken_port: int, tiny_model_dir: Path, private_endpoint: str) -> None:
    proc = _run("serve", "-m", str(tiny_model_dir), "--device", "cpu", "--port", str(taken_port),
                "--endpoint", private_endpoint)
    _one_line(proc, f"127.0.0.1:{taken_port}", "already in use", "--port")
    assert proc.returncode == 1
    # Refused before any process started: no engine log, no model loaded, no "ready".
    assert "radixlm-engine" not in proc.stderr and "ready at" not in proc.stderr


def test_a_taken_zeromq_endpoint_is_one_line_before_anything_starts(tiny_model_dir: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _run("serve", "-m", str(tiny_model_dir), "--device", "cpu", "--no-http",
                    "--endpoint", f"tcp://127.0.0.1:{port}")
    _one_line(proc, f"tcp://127.0.0.1:{port}", "already in use")
    assert "radixlm-engine" not in proc.stderr


@pytest.mark.parametrize(("flags", "expected"), [
    (["--model", "/no/such/model"], ["'/no/such/model' not found"]),
    (["--device", "gpu"], ["unknown device 'gpu'", "cuda:N"]),
    (["--device", "cuda:x"], ["unknown device 'cuda:x'"]),
    (["--endpoint", "localhost:5555"], ["must start with ipc:// or tcp://"]),
    (["--endpoint", "tcp://0.0.0.0:5555"], ["--auth-dir", "--insecure"]),
    (["--auth-dir", "/no/such/keys"], ["cannot read the server key", "radixlm keys"]),
    (["--host", "0.0.0.0"], ["refusing to serve HTTP on 0.0.0.0", "--api-key"]),
    (["--no-http", "--port", "1"], ["--no-http contradicts --port"]),
])
def test_mistakes_found_without_a_model_are_one_line_at_once(
        flags: list[str], expected: list[str], tiny_model_dir: Path) -> None:
    proc = _run("serve", "-m", str(tiny_model_dir), "--device", "cpu", *flags, timeout=60)
    _one_line(proc, *expected)
    assert "radixlm-engine" not in proc.stderr


def test_a_file_that_is_no_model_is_one_line(tmp_path: Path, private_endpoint: str) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    proc = _run("serve", "-m", str(text), "--device", "cpu", "--no-http", "--endpoint",
                private_endpoint)
    _one_line(proc, "engine process exited", "is a file but not a .gguf model")


def test_a_context_beyond_the_model_is_one_line(tiny_model_dir: Path, private_endpoint: str) -> None:
    proc = _run("serve", "-m", str(tiny_model_dir), "--device", "cpu", "--no-http",
                "--endpoint", private_endpoint, "--max-model-len", "100000")
    _one_line(proc, "--context-length 100000 is beyond the model's 256 positions",
              "--allow-long-context")


@pytest.mark.skipif("_cuda()", reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_missing_cuda_device_is_one_line(device: str, tiny_model_dir: Path,
                                           private_endpoint: str) -> None:
    proc = _run("serve", "-m", str(tiny_model_dir), "--device", device, "--no-http",
                "--endpoint", private_endpoint)
    _one_line(proc, f"--device {device}: no CUDA device here", "--device cpu")


@pytest.mark.skipif(sys.platform == "darwin", reason="MPS may be there")
def test_a_missing_mps_device_is_one_line(tiny_model_dir: Path, private_endpoint: str) -> None:
    proc = _run("generate", "hi", "-m", str(tiny_model_dir), "--device", "mps")
    _one_line(proc, "--device mps: no Apple MPS device here")


def test_debug_shows_the_traceback(tmp_path: Path, private_endpoint: str) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    proc = _run("serve", "-m", str(text), "--device", "cpu", "--no-http", "--endpoint",
                private_endpoint, "--debug")
    assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr


def _said_besides(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> list[str]:
    """What the SDK wrote besides raising: stderr, and log records of warning and above
    (which Python prints to stderr when the program configured no logging)."""
    records = [r.getMessage() for r in caplog.records
               if r.name.startswith("radixlm") and r.levelno >= logging.WARNING]
    err = capfd.readouterr().err
    return records + ([err] if err else [])


def test_engine_errors_are_raised_once_in_the_callers_words(
        tiny_model_dir: Path, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(rl.EngineStartError) as failed:
        rl.Engine(str(tiny_model_dir), device="cpu", kv_tokens=10, startup_timeout=120)
    message = str(failed.value)
    assert "kv_tokens=10 is below the smallest KV pool" in message, message
    assert "--kv-tokens" not in message and "Traceback" not in message
    assert _said_besides(caplog, capfd) == []  # raised, not also written out


@pytest.mark.skipif("_cuda()", reason="this machine has CUDA")
def test_engine_on_a_missing_device_says_so_in_keywords(tiny_model_dir: Path) -> None:
    with pytest.raises(rl.EngineStartError, match=r"device='cuda': no CUDA device here"):
        rl.Engine(str(tiny_model_dir), device="cuda", startup_timeout=120)


def test_a_dead_engine_is_raised_once(tiny_model_dir: Path, capfd: pytest.CaptureFixture[str],
                                      caplog: pytest.LogCaptureFixture) -> None:
    import os
    import signal

    engine = rl.Engine(str(tiny_model_dir), device="cpu", kv_tokens=1024, threads=1)
    try:
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(rl.EngineDeadError):
            engine.generate("hi", max_tokens=200, ignore_eos=True)
    finally:
        engine.close()
    assert _said_besides(caplog, capfd) == []


def test_triton_stays_out_of_tests_and_cpu_engines(server) -> None:  # noqa: ANN001
    """It is installed (xgrammar depends on it) but nothing on CPU uses it; imported, it
    costs start-up time and prints ~40 lines of nanobind leak reports at exit."""
    import os

    if os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/kfd"):
        pytest.skip("a GPU driver is present: triton may be used")
    assert sys.modules.get("triton", None) is None  # (the tests have imported torch)
    for pid in server.child_pids:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtriton" not in maps and "/triton/" not in maps, pid
