"""Start a radixlm server: an engine process and a frontend process, supervised.

`start_server(config)` makes a private (0700) runtime directory for the ipc sockets,
starts both processes (``python -m radixlm.runtime.launcher ROLE ...``: plain
subprocesses, so nothing of the caller's ``__main__`` is re-imported and no pickle is
involved), and returns once the frontend has bound its client socket and said so in the
runtime directory (rundir.py: the bound endpoint, with the port the system picked for
port 0, and the `Welcome`). A process that dies during start-up raises `ServerStartError`
with its error (each child writes a one-line summary to ``<runtime dir>/<role>.error``
before exiting; a user error, such as a model that is not there, logs no traceback).
Runtime directories left behind by servers that were killed are removed first.

Shutdown (`RunningServer.stop`, also on ``with`` exit): SIGTERM to every child, a grace
period, then SIGKILL; the runtime directory (sockets included) is removed. Children also
die with their parent: they ask Linux for ``PR_SET_PDEATHSIG`` (SIGTERM) as they start,
and exit at once if the parent is already gone. Ctrl-C reaches the whole foreground
process group, so children ignore SIGINT and leave the stopping order to the parent.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from radixlm.runtime.channel import (
    ipc_endpoint,
    ipc_path,
    make_runtime_dir,
    parse_client_endpoint,
)
from radixlm.runtime.config import Endpoints, EngineConfig
from radixlm.runtime.curve_keys import check_auth_dir
from radixlm.runtime.protocol import Welcome
from radixlm.runtime.rundir import read_ready, remove_stale, write_owner

__all__ = [
    "RunningServer",
    "ServerStartError",
    "connect_address",
    "die_with_parent",
    "load_spec",
    "stop_when_gone",
    "make_endpoints",
    "start_server",
]

log = logging.getLogger("radixlm.launcher")

ROLES = ("engine", "frontend")
DEFAULT_START_TIMEOUT_S = 600.0  # first start of the default model converts its GGUF
STOP_GRACE_S = 5.0
_PROBE_INTERVAL_S = 0.1


class ServerStartError(RuntimeError):
    """The server did not come up; the message says which process failed and why."""


# -- the parent side ---------------------------------------------------------------------


@dataclasses.dataclass
class RunningServer:
    """Handle on a started server. `endpoint` is what clients connect to."""

    config: EngineConfig
    endpoints: Endpoints
    welcome: Welcome
    processes: dict[str, subprocess.Popen[bytes]]
    runtime_dir: Path

    @property
    def endpoint(self) -> str:
        return self.endpoints.client

    @property
    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self.processes.items()}

    def poll(self) -> tuple[str, int] | None:
        """(role, exit code) of a child that has exited, else None."""
        for role, proc in self.processes.items():
            code = proc.poll()
            if code is not None:
                return role, code
        return None

    def wait(self, poll_interval_s: float = 0.5) -> tuple[str, int]:
        """Block until a child exits; (role, exit code)."""
        while (exited := self.poll()) is None:
            time.sleep(poll_interval_s)
        return exited

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every child (SIGTERM, then SIGKILL after `grace_s`) and remove the sockets."""
        _stop_processes(self.processes, grace_s)
        _remove_runtime_files(self.runtime_dir, self.endpoints.client)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_endpoints(config: EngineConfig, runtime_dir: Path) -> Endpoints:
    if config.auth_dir:
        check_auth_dir(Path(config.auth_dir))
    if config.endpoint:
        checked = parse_client_endpoint(config.endpoint, authenticated=bool(config.auth_dir),
                                        insecure=config.insecure)
        client = checked.address
        if checked.public:
            log.warning(
                "*** %s listens %s%s ***", client,
                "on EVERY network interface" if checked.wildcard else "beyond this machine",
                "; clients must present an authorized CurveZMQ key" if config.auth_dir else
                " WITHOUT AUTHENTICATION (--insecure): anyone who can reach it can use it")
    else:
        client = ipc_endpoint(runtime_dir, "client")
    return Endpoints(
        client=client,
        to_engine=ipc_endpoint(runtime_dir, "engine"),
        to_frontend=ipc_endpoint(runtime_dir, "frontend"),
        runtime_dir=str(runtime_dir),
    )


def start_server(
    config: EngineConfig,
    *,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    stdout: Any = None,
    stderr: Any = None,
    engine_command: Sequence[str] | None = None,
) -> RunningServer:
    """Start engine + frontend and wait until a client handshake succeeds.

    `stdout`/`stderr` are passed to the children (None: inherit, so their logs show).
    `engine_command` replaces the engine process (benchmarks and tests run a stub engine):
    it is run with the spec file and this process's pid appended (see `load_spec`).
    Raises `ServerStartError` (children stopped, directory removed) on failure or timeout.
    """
    runtime_dir = make_runtime_dir()
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        write_owner(runtime_dir)
        remove_stale(runtime_dir.parent)
        endpoints = make_endpoints(config, runtime_dir)
        spec = runtime_dir / "spec.json"
        spec.write_bytes(_encode_spec(config, endpoints))
        spec.chmod(stat.S_IRUSR | stat.S_IWUSR)
        for role in ROLES:
            command = [sys.executable, "-m", "radixlm.runtime.launcher", role]
            if role == "engine" and engine_command is not None:
                command = list(engine_command)
            processes[role] = subprocess.Popen(
                [*command, str(spec), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                env=engine_environment(config) if role == "engine" else None,
            )
        bound, welcome = _wait_ready(processes, runtime_dir, start_timeout_s)
        endpoints = dataclasses.replace(endpoints, client=bound)
    except BaseException:
        _stop_processes(processes, STOP_GRACE_S)
        # A user-chosen socket path is ours to remove only once our frontend may own it.
        _remove_runtime_files(runtime_dir, config.endpoint if processes else "")
        raise
    log.info("serving %s at %s (context %d tokens, KV pool %d tokens, page size %d)",
             welcome.model, endpoints.client, welcome.context_length, welcome.kv_capacity,
             welcome.page_size)
    return RunningServer(config, endpoints, welcome, processes, runtime_dir)


def engine_environment(config: EngineConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The engine process's environment: this one's, plus OMP_WAIT_POLICY from
    `config.omp_wait_policy` unless the user set OpenMP's waiting already (OMP_WAIT_POLICY
    or GOMP_SPINCOUNT in the environment win). It must be set before the engine imports
    torch (libgomp reads it once), hence here.

    Why passive by default: spinning OpenMP threads (between a step's parallel regions,
    and while idle) only pay when each thread owns a core; the engine shares them with its
    frontend, its clients and whatever else runs. (The fused decode step's own barriers
    spin briefly whatever this says: kernels/qmatmul.c, `team_wait`.)
    Measured on 2 cores (SmolLM2 Q4_1, batch-1 decode, tok/s): quiet machine, libgomp's
    default 88-97 vs passive 78-90 (within run-to-run noise); with one other busy
    process, 21-27 vs 48-55."""
    env = dict(os.environ if base is None else base)
    policy = config.omp_wait_policy
    if policy and "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["OMP_WAIT_POLICY"] = policy
    return env


def connect_address(endpoint: str) -> str:
    """Where a local client connects for a server bound at `endpoint`."""
    return endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:")


def _wait_ready(processes: dict[str, subprocess.Popen[bytes]], runtime_dir: Path,
                timeout_s: float) -> tuple[str, Welcome]:
    """The bound client endpoint and the Welcome, once the frontend has written them;
    fail fast if a child dies first."""
    deadline = time.monotonic() + timeout_s
    while (ready := read_ready(runtime_dir)) is None:
        for role, proc in processes.items():
            code = proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"the {role} process exited with code {code} during start-up: "
                    f"{_child_error(runtime_dir, role)}"
                )
        if time.monotonic() > deadline:
            raise ServerStartError(
                f"the server did not become ready within {timeout_s:.0f} s (see its log)")
        time.sleep(_PROBE_INTERVAL_S)
    return ready.endpoint, ready.welcome


def _child_error(runtime_dir: Path, role: str) -> str:
    path = runtime_dir / f"{role}.error"
    try:
        return path.read_text(encoding="utf-8").strip() or "no error recorded (see its log)"
    except OSError:
        return "no error recorded (killed by a signal? see its log)"


def _stop_processes(processes: dict[str, subprocess.Popen[bytes]], grace_s: float) -> None:
    for proc in processes.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for role, proc in processes.items():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("the %s process (pid %d) ignored SIGTERM; killing it", role, proc.pid)
            proc.kill()
            proc.wait()


def _remove_runtime_files(runtime_dir: Path, client_endpoint: str) -> None:
    shutil.rmtree(runtime_dir, ignore_errors=True)
    path = ipc_path(client_endpoint)  # a user-chosen ipc path outside the runtime dir
    if path is not None:
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
        except OSError:
            pass


def _encode_spec(config: EngineConfig, endpoints: Endpoints) -> bytes:
    return json.dumps({
        "config": msgspec.to_builtins(config),
        "endpoints": dataclasses.asdict(endpoints),
    }).encode()


def load_spec(path: str | os.PathLike[str]) -> tuple[EngineConfig, Endpoints]:
    """The config and endpoints a child process was started with."""
    spec = json.loads(Path(path).read_bytes())
    return msgspec.convert(spec["config"], EngineConfig), Endpoints(**spec["endpoints"])


# -- the child side ----------------------------------------------------------------------


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        sys.exit(1)


def stop_when_gone(pid: int, interval_s: float = 0.5) -> threading.Thread:
    """SIGTERM this process once `pid` has exited (`radixlm serve --parent-pid`).

    Polled from a daemon thread rather than PR_SET_PDEATHSIG, which fires when the
    *thread* that started us exits and so would stop an engine an SDK user started from a
    worker thread. When `pid` is our parent, its death shows as a new parent pid (that
    also covers a dead parent left unreaped); otherwise `kill(pid, 0)` is asked."""
    watch_parent = os.getppid() == pid

    def alive() -> bool:
        if watch_parent:
            return os.getppid() == pid
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def watch() -> None:
        while alive():
            time.sleep(interval_s)
        log.warning("process %d is gone: stopping", pid)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name=f"watch-{pid}", daemon=True)
    thread.start()
    return thread


# Start-up failures that are the user's to fix (a model path that is not there, a file
# that is not a model, an endpoint that cannot be bound): one line, no traceback.
_USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _run_role(role: str, config: EngineConfig, endpoints: Endpoints) -> None:
    if role == "engine":
        from radixlm.runtime.engine.engine_main import run_engine

        run_engine(config, endpoints)
    else:
        from radixlm.runtime.frontend import run_frontend

        run_frontend(config, endpoints)


def child_main(argv: Sequence[str] | None = None) -> int:
    """``python -m radixlm.runtime.launcher ROLE SPEC PARENT_PID`` (started by start_server)."""
    parser = argparse.ArgumentParser(prog="radixlm.runtime.launcher",
                                     description="internal: one process of a radixlm server")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("spec", type=Path, help="JSON file with the config and the endpoints")
    parser.add_argument("parent_pid", type=int, help="the launcher's pid (children die with it)")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    config, endpoints = load_spec(args.spec)
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s radixlm-{args.role} %(levelname)s %(name)s: %(message)s",
    )
    try:
        _run_role(args.role, config, endpoints)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    except BaseException as e:
        role_log = logging.getLogger(f"radixlm.{args.role}")
        if isinstance(e, _USER_ERRORS):  # the user's to fix: the message says what
            role_log.error("%s", e)
            role_log.debug("%s", traceback.format_exc())
        else:
            role_log.error("%s", traceback.format_exc())
        error_file = Path(endpoints.runtime_dir) / f"{args.role}.error"
        with contextlib.suppress(OSError):
            error_file.write_text(f"{type(e).__name__}: {e}\n", encoding="utf-8")
        return 1
    return 0


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: with torch loaded it takes seconds, and a
    server process has closed its sockets and has nothing else to finalise."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(child_main())
