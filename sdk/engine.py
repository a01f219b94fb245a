"""`rl.Engine`: start a local engine (``radixlm serve`` in a subprocess) and connect to it.

    with rl.Engine() as engine:              # the embedded SmolLM2-135M-Instruct
        print(engine.generate("Hello", max_tokens=8).text)

    engine = rl.Engine("path/to/model", kv_tokens=8192, device="cpu")   # flags of `serve`

    engine = rl.Engine(http="127.0.0.1:8000")   # also the OpenAI-compatible HTTP API:
    openai.OpenAI(base_url=engine.http_url, api_key="unused")

The server listens on an ipc socket in a private (0700) directory of its own. It stops
when the Engine is closed, when it is garbage collected, or at interpreter exit; a call
made after it died fails at once with `EngineDeadError` carrying its exit code and the
end of its log.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from radixlm.sdk.errors import EngineDeadError, EngineStartError
from radixlm.sdk.sync import Client

__all__ = ["Engine", "EngineProcess", "Runtime", "engine_flags"]

_STOP_GRACE_S = 10.0
_LOG_TAIL_LINES = 15
# Keyword names that differ from the `serve` flag (EngineConfig field -> flag).
_FLAG_NAMES = {"default_session_ttl_s": "session-ttl", "session_ttl_s": "session-ttl"}


def engine_flags(options: dict[str, Any]) -> list[str]:
    """``radixlm serve`` flags for keyword options: ``kv_tokens=4096`` -> ``--kv-tokens 4096``;
    ``True`` gives a bare flag, ``False``/``None`` nothing."""
    argv: list[str] = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + _FLAG_NAMES.get(key, key.replace("_", "-"))
        argv.append(flag)
        if value is not True:
            argv.append(str(value))
    return argv


def _private_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    parent = base if base and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK) else None
    path = Path(tempfile.mkdtemp(prefix="radixlm-sdk-", dir=parent))  # mkdtemp: mode 0700
    return path


class EngineProcess:
    """A ``radixlm serve`` subprocess with its own private directory and log file."""

    def __init__(self, model: str, options: dict[str, Any], endpoint: str | None = None,
                 python: str = sys.executable) -> None:
        self.dir = _private_dir()
        self.endpoint = endpoint or f"ipc://{self.dir / 'engine.sock'}"
        self.log_path = self.dir / "engine.log"
        # --parent-pid: the server stops itself if this process dies without closing it
        # (SIGKILL, a crash), so an engine never outlives the program that started it.
        command = [python, "-m", "radixlm.runtime.cli", "serve", "--model", model,
                   "--endpoint", self.endpoint, "--parent-pid", str(os.getpid()),
                   *engine_flags(options)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def exit_reason(self) -> str | None:
        """None while the process runs; else its exit code and the end of its log."""
        code = self.proc.poll()
        if code is None:
            return None
        tail = self.log_tail()
        # `radixlm serve` says why it stopped in one line; else show the end of its log.
        summary = [line for line in tail.splitlines() if line.startswith("radixlm serve:")]
        what = f"the server process (radixlm serve, pid {self.proc.pid}) exited with code {code}"
        if summary:  # it names the process that failed (engine or frontend) and why
            return f"{what}: {summary[-1]}"
        return what + (
            f"; the end of its log:\n{tail}" if tail else "")

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """SIGTERM (the server stops its children), SIGKILL after `grace_s`; remove the dir."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Engine(Client):
    """A local engine in a subprocess, with a synchronous client attached.

    `model`: ``"default"`` (SmolLM2-135M-Instruct), an HF directory or a ``.gguf`` file.
    `engine_flags`: any ``radixlm serve`` flag as a keyword (``kv_tokens=8192``,
    ``device="cpu"``, ``page_size=16``...). `startup_timeout`: seconds to wait for the
    model to load. The process is watched, so calls fail within a second of its exit;
    `heartbeat_timeout` only covers a process that is alive but stopped answering. Use it
    as a context manager, or call `close` (alias `shutdown`).
    ``http="HOST:PORT"`` also serves the OpenAI-compatible HTTP API there (`http_url` is
    its ``.../v1`` base URL; ``api_key=`` sets its key).
    """

    def __init__(
        self,
        model: str = "default",
        *,
        startup_timeout: float = 600.0,
        heartbeat_timeout: float = 60.0,
        endpoint: str | None = None,
        **engine_flags: Any,
    ) -> None:
        self.process = EngineProcess(model, engine_flags, endpoint)
        # Registered before the client's finalizer, so at exit it runs after it.
        self._process_finalizer = weakref.finalize(self, self.process.stop)
        try:
            super().__init__(self.process.endpoint, connect_timeout=startup_timeout,
                             heartbeat_timeout=heartbeat_timeout,
                             liveness=self.process.exit_reason)
        except EngineDeadError as e:
            reason = self.process.exit_reason() or f"{e.message}\n{self.process.log_tail()}"
            self._process_finalizer()
            raise EngineStartError(f"could not start the engine for {model!r}: {reason}") from None
        except BaseException:
            self._process_finalizer()
            raise
        self.http_url: str | None = None
        if engine_flags.get("http"):
            host, _, port = str(engine_flags["http"]).rpartition(":")
            host = {"localhost": "127.0.0.1", "0.0.0.0": "127.0.0.1"}.get(host, host)
            try:
                _wait_http(host.strip("[]"), int(port), startup_timeout, self.process)
            except BaseException:
                self.close()
                raise
            self.http_url = f"http://{host}:{port}/v1"

    def close(self) -> None:
        """Disconnect, then stop the engine process (idempotent)."""
        super().close()
        self._process_finalizer()

    shutdown = close  # SGLang's Runtime.shutdown()

    @property
    def pid(self) -> int:
        """The engine server's process id."""
        return self.process.pid


def _wait_http(host: str, port: int, timeout_s: float, process: EngineProcess) -> None:
    """Until the HTTP API accepts connections: it starts just after the protocol endpoint,
    and listens only once its engine connection is up."""
    deadline = time.monotonic() + timeout_s
    while (reason := process.exit_reason()) is None:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise EngineStartError(f"the HTTP API did not answer on {host}:{port} "
                                       f"within {timeout_s:.0f} s") from None
            time.sleep(0.1)
    raise EngineStartError(f"the HTTP API did not start: {reason}")


def Runtime(model_path: str = "default", **kwargs: Any) -> Engine:  # noqa: N802 - SGLang's name
    """SGLang's ``sgl.Runtime(model_path=...)``: an `Engine`."""
    return Engine(model_path, **kwargs)
