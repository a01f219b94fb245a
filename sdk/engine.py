"""`rl.Engine`: start a local engine (``radixlm serve`` in a subprocess) and connect to it.

    with rl.Engine() as engine:              # the embedded SmolLM2-135M-Instruct
        print(engine.generate("Hello", max_tokens=8).text)

    engine = rl.Engine("path/to/model", kv_tokens=8192, device="cpu")   # flags of `serve`

    engine = rl.Engine(http="127.0.0.1:8000")   # also the OpenAI-compatible HTTP API:
    openai.OpenAI(base_url=engine.http_url, api_key="unused")

The server listens on an ipc socket in a private (0700) directory of its own (no HTTP
API unless ``http=`` asks for one). It runs in a session of its own, so a Ctrl-C in the
terminal reaches only this program: a call it interrupts is aborted in the engine, and
the engine keeps serving the next one. It stops when the Engine is closed, when it is
garbage collected, or when this program exits (even if killed: ``--parent-pid``); a call
made after it died fails at once with `EngineDeadError` carrying its exit code and the
end of its log. While it starts, a spinner shows on stderr when stderr is a terminal.
Errors name keyword arguments as they were given (``kv_tokens=10``, not ``--kv-tokens``).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from radixlm.runtime.config import START_TIMEOUT_S, EngineConfig
from radixlm.runtime.http.config import HttpConfig
from radixlm.runtime.server.children import child_exit, stop_child
from radixlm.runtime.server.exits import how_it_ended
from radixlm.runtime.server.progress import Spinner, starting_label
from radixlm.runtime.settings import settings_of
from radixlm.sdk.errors import EngineDeadError, EngineStartError
from radixlm.sdk.server_args import ServerArgs, engine_options
from radixlm.sdk.sync import Client

__all__ = ["Engine", "EngineProcess", "Runtime", "engine_flags"]

_STOP_GRACE_S = 10.0
_LOG_TAIL_LINES = 15
_UP_LINES = ("radixlm serve: ready at", "radixlm serve: HTTP API at")  # not a reason to stop
_FLAG = re.compile(r"--([a-z][a-z0-9-]*)")
_HTTP_LINE = re.compile(r"^radixlm serve: HTTP API at (\S+)$", re.M)
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_ARGUMENT = re.compile(r"argument --([a-z][a-z0-9-]*)(?:/[-\w]+)*: ")  # argparse's


@functools.cache
def _declared() -> tuple[dict[str, str], dict[str, str]]:
    """The settings `radixlm serve` declares (`radixlm.runtime.settings`): the flag of
    every keyword `rl.Engine` takes for one, and the keyword that names each flag."""
    flag_of: dict[str, str] = {}
    keyword_of: dict[str, str] = {}
    for s in (*settings_of(EngineConfig), *settings_of(HttpConfig)):
        if s.flag is None:
            continue
        for keyword in s.keywords:
            flag_of.setdefault(keyword, s.flag)
        for flag in s.declared.flags:
            keyword_of.setdefault(flag.lstrip("-"), s.keyword)
    return flag_of, keyword_of


def keyword_words(text: str, options: dict[str, Any] | None = None) -> str:
    """A server's message in the words of `rl.Engine`'s caller: a flag and the value it
    was given as that keyword (``--kv-tokens 10`` -> ``kv_tokens=10`` for
    ``kv_tokens=10`` in `options`), other flags as keyword names (``--kv-tokens`` ->
    ``kv_tokens``); argparse's "unrecognized arguments" names the unknown keywords."""
    text = _ARGUMENT.sub(lambda m: _keyword(m.group(1)) + ": ", text)
    unknown = _UNRECOGNIZED.search(text)
    if unknown is not None:
        names = [_keyword(a[2:]) for a in unknown.group(1).split() if a.startswith("--")]
        return (f"unknown keyword argument(s) {', '.join(names)}: rl.Engine takes the "
                "flags of `radixlm serve` (see `radixlm serve --help`) as keywords")
    for key, value in (options or {}).items():
        flag = engine_flags({key: value})
        if len(flag) == 2:  # "--flag value", as the server repeats it
            text = text.replace(" ".join(flag), f"{key}={value!r}")
    return _FLAG.sub(lambda m: _keyword(m.group(1)), text)


def _keyword(flag: str) -> str:
    return _declared()[1].get(flag, flag.replace("-", "_"))


def engine_flags(options: dict[str, Any]) -> list[str]:
    """``radixlm serve`` flags for keyword options: a declared setting's keyword (its
    field name, or another it declares) becomes its flag (``kv_tokens=4096`` ->
    ``--kv-tokens 4096``, ``default_session_ttl_s=30`` -> ``--session-ttl 30``); any
    other name is passed on as a flag of that spelling (``http=...`` -> ``--http ...``),
    for `serve` to take or refuse. ``True`` gives a bare flag, ``False``/``None``
    nothing."""
    flag_of = _declared()[0]
    argv: list[str] = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        argv.append(flag_of.get(key) or "--" + key.replace("_", "-"))
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
        self.options = dict(options)
        self.dir = _private_dir()
        self.endpoint = endpoint or f"ipc://{self.dir / 'engine.sock'}"
        self.log_path = self.dir / "engine.log"
        # --parent-pid: the server stops itself if this process dies without closing it
        # (SIGKILL, a crash), so an engine never outlives the program that started it.
        # No HTTP API unless asked for (`radixlm serve` serves one by default).
        no_http = [] if options.get("http") else ["--no-http"]
        # No state directory unless asked for (`state_dir=`): a program's own engine is
        # its own, not the user's default server's state.
        no_state = [] if options.get("state_dir") else ["--no-state"]
        command = [python, "-m", "radixlm.runtime.cli", "serve", "--model", model,
                   "--endpoint", self.endpoint, "--parent-pid", str(os.getpid()),
                   *no_http, *no_state, *engine_flags(options)]
        with open(self.log_path, "wb") as log:
            # A session of its own: the terminal's Ctrl-C is this program's, not the engine's.
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

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
        code = child_exit(self.proc)
        if code is None:
            return None
        tail = self.log_tail()
        # `radixlm serve` says why it stopped in one line; else show the end of its log.
        # Its last line that is not news of being up ("ready at", "HTTP API at").
        summary = [line for line in tail.splitlines() if line.startswith("radixlm serve:")
                   and not line.startswith(_UP_LINES)]
        what = f"the server process (radixlm serve, pid {self.proc.pid}) {how_it_ended(code)}"
        if summary:  # it names the process that failed (engine or frontend) and why
            message = summary[-1].removeprefix("radixlm serve: ")
            return f"{what}: {keyword_words(message, self.options)}"
        usage = [line for line in tail.splitlines() if "error: " in line]
        if usage:  # argparse refused a keyword: "radixlm serve: error: ..."
            return f"{what}: {keyword_words(usage[-1].partition('error: ')[2], self.options)}"
        return what + (
            f"; the end of its log:\n{tail}" if tail else "")

    def status(self) -> str:
        """The server's last log message, shortened (shown while it starts)."""
        lines = self.log_tail(1).splitlines()
        if not lines:
            return ""
        message = lines[-1].rpartition(": ")[2] if " radixlm" in lines[-1] else lines[-1]
        return message[:80]

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """SIGTERM (the server stops its children), SIGKILL after `grace_s`; remove the dir."""
        # Not Popen.wait: a Ctrl-C landing inside it can leave Popen's lock held for good
        # (runtime/server/children.py), and then a later wait never returns.
        stop_child(self.proc, "server", grace_s)
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
    its ``.../v1`` base URL; ``api_key=`` sets its key). ``state_dir=DIR`` keeps durable
    sessions, pins and their KV there across restarts (none by default: docs/deployment.md).
    `server_args`: SGLang's `ServerArgs` (see `radixlm.sdk.server_args`).
    """

    def __init__(
        self,
        model: str = "default",
        *,
        startup_timeout: float = START_TIMEOUT_S,
        heartbeat_timeout: float = 60.0,
        endpoint: str | None = None,
        server_args: ServerArgs | None = None,
        **engine_flags: Any,
    ) -> None:
        if "model_path" in engine_flags:  # SGLang's name for it
            model = engine_flags.pop("model_path")
        if server_args is not None:  # SGLang's: its model and options, then these
            model = server_args.model_path
            engine_flags = {**engine_options(server_args.options), **engine_flags}
        self.process = EngineProcess(model, engine_flags, endpoint)
        # Registered before the client's finalizer, so at exit it runs after it.
        self._process_finalizer = weakref.finalize(self, self.process.stop)
        try:
            with Spinner(starting_label(model), status=self.process.status):
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
            try:
                self.http_url = _wait_http(startup_timeout, self.process)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Disconnect, then stop the engine process (idempotent)."""
        super().close()
        self._process_finalizer()

    shutdown = close  # SGLang's Runtime.shutdown()

    @property
    def pid(self) -> int:
        """The engine server's process id."""
        return self.process.pid


def _wait_http(timeout_s: float, process: EngineProcess) -> str:
    """The HTTP API's base URL, once the server says it serves it (``radixlm serve:
    HTTP API at URL``, with the port it bound: port 0 works)."""
    deadline = time.monotonic() + timeout_s
    while (reason := process.exit_reason()) is None:
        said = _HTTP_LINE.search(process.log_tail(50))
        if said is not None:
            return said.group(1)
        if time.monotonic() > deadline:
            raise EngineStartError(f"the HTTP API did not start within {timeout_s:.0f} s")
        time.sleep(0.05)
    raise EngineStartError(f"the HTTP API did not start: {reason}")


def Runtime(model_path: str = "default", log_level: str | None = None,  # noqa: N802 - SGLang's name
            launch_timeout: float = START_TIMEOUT_S, **kwargs: Any) -> Engine:
    """SGLang's ``sgl.Runtime(model_path=..., **server_args)``: an `Engine`. SGLang's
    server arguments are translated (`radixlm.sdk.server_args`); `launch_timeout` is the
    Engine's `startup_timeout`."""
    known = {k: kwargs.pop(k) for k in ("heartbeat_timeout", "endpoint") if k in kwargs}
    return Engine(model_path, startup_timeout=launch_timeout, **known,
                  **engine_options({"log_level": log_level, **kwargs}))
