"""Start a radixlm server: an engine process and a frontend process, supervised.

`start_server(config)` makes a private (0700) runtime directory for the ipc sockets,
binds the client endpoint itself (listeners.py: a taken address fails here, before any
process starts or any model loads), starts both processes (``python -m
radixlm.runtime.launcher ROLE ...``: plain subprocesses, so nothing of the caller's
``__main__`` is re-imported and no pickle is involved; the frontend adopts the bound
socket), and returns once the frontend serves and said so in the runtime directory
(rundir.py: the bound endpoint and the `Welcome`). A process that dies during start-up
raises `ServerStartError` with its error (each child writes a one-line summary to
``<runtime dir>/<role>.error`` before exiting; a user error, such as a model that is not
there or a device this machine lacks, has no traceback; others have one with
``--debug``). Runtime directories left behind by servers that were killed are removed
first.

Shutdown (`RunningServer.stop`, also on ``with`` exit): SIGTERM to every child, a grace
period, then SIGKILL; the runtime directory (sockets included) is removed. Children also
die with their parent: they ask Linux for ``PR_SET_PDEATHSIG`` (SIGTERM) as they start,
and exit at once if the parent is already gone. They run in sessions of their own, so a
Ctrl-C in the terminal reaches only the process that started them, which decides what it
means (`radixlm serve` stops; `radixlm chat` aborts a reply); they ignore SIGINT too.
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
from radixlm.runtime.listeners import Listener, listen_zmq
from radixlm.runtime.protocol import Welcome
from radixlm.runtime.rundir import READY_FILE, read_ready, remove_stale, write_owner

__all__ = [
    "RunningServer",
    "ServerStartError",
    "child_exit",
    "end_child",
    "stop_child",
    "wait_child",
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
KILL_WAIT_S = 5.0  # after SIGKILL: a child still there then is left to init, not waited on
_REAP_INTERVAL_S = 0.02
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
            code = child_exit(proc)
            if code is not None:
                return role, code
        return None

    def wait(self, poll_interval_s: float = 0.5) -> tuple[str, int]:
        """Block until a child exits; (role, exit code)."""
        while (exited := self.poll()) is None:
            time.sleep(poll_interval_s)
        return exited

    def drain(self, timeout_s: float) -> None:
        """Stop gracefully: SIGTERM the processes clients talk to (the frontend, the HTTP
        API), which take no new requests and exit once the running ones have finished, or
        at `timeout_s` (their --drain-timeout); then stop the engine."""
        front = {role: p for role, p in self.processes.items() if role != "engine"}
        for proc in front.values():
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s + STOP_GRACE_S
        for role, proc in front.items():
            end_child(proc, role, max(0.0, deadline - time.monotonic()), "did not drain in time")
        self.stop()

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
    preflight: bool = True,
    takeover: bool = False,
) -> RunningServer:
    """Start engine + frontend and wait until the frontend serves.

    `stdout`/`stderr` are passed to the children (None: inherit, so their logs show).
    `engine_command` replaces the engine process (benchmarks and tests run a stub engine):
    it is run with the spec file and this process's pid appended (see `load_spec`).
    `preflight`: refuse, before anything starts, a model path that does not exist or a
    device that cannot be named (`check_config`). `takeover`: the ipc path of
    ``config.endpoint`` is this server's whatever listens there (the default server's
    socket while this process holds its lock: a server still there was killed, and its
    frontend is about to go).
    Raises `ServerStartError` (children stopped, directory removed) on failure or timeout,
    `EndpointError` at once for an endpoint that cannot be bound.
    """
    if preflight:
        check_config(config)
    takeover_path = ipc_path(config.endpoint) if takeover else None
    if takeover_path is not None:
        with contextlib.suppress(FileNotFoundError):
            takeover_path.unlink()
    runtime_dir = make_runtime_dir()
    processes: dict[str, subprocess.Popen[bytes]] = {}
    listener: Listener | None = None
    try:
        write_owner(runtime_dir)
        remove_stale(runtime_dir.parent)
        endpoints = make_endpoints(config, runtime_dir)
        listener = listen_zmq(endpoints.client)
        endpoints = dataclasses.replace(endpoints, client=listener.address,
                                        client_fd=listener.fd)
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
                pass_fds=(listener.fd,) if role == "frontend" else (),
                start_new_session=True,  # a Ctrl-C in the terminal is the parent's to handle
            )
        listener.close()  # the frontend holds it now
        bound, welcome = _wait_ready(processes, runtime_dir, start_timeout_s)
        endpoints = dataclasses.replace(endpoints, client=bound)
    except BaseException:
        _stop_processes(processes, STOP_GRACE_S)
        if listener is not None:
            listener.close(unlink=True)  # bound here: ours to remove
        _remove_runtime_files(runtime_dir, "")
        raise
    log.info("serving %s at %s (context %d tokens, KV pool %d tokens, page size %d)",
             welcome.model, endpoints.client, welcome.context_length, welcome.kv_capacity,
             welcome.page_size)
    return RunningServer(config, endpoints, welcome, processes, runtime_dir)


# Devices `--device` may name (the index of cuda:N is checked by the engine).
_DEVICE_KINDS = ("auto", "cpu", "cuda", "mps")


def check_config(config: EngineConfig) -> None:
    """Refuse, in milliseconds and before anything starts, what a user can get wrong
    without a model loaded: a model path that does not exist, a device name that is none.
    (Whether the device exists is asked in the engine process, which imports torch.)"""
    model = config.model
    if model not in ("", "default") and not Path(model).expanduser().exists():
        raise ServerStartError(
            f"model {model!r} not found: give 'default', a .gguf file or an HF model "
            "directory (models are not downloaded)")
    kind, _, index = config.device.partition(":")
    if kind not in _DEVICE_KINDS or (index and (kind != "cuda" or not index.isdigit())):
        raise ServerStartError(f"unknown device {config.device!r}: give auto, cpu, cuda, "
                               "cuda:N or mps")


def device_problem(device: str) -> str | None:
    """Why `device` cannot run the engine here (None: it can). Imports torch."""
    import torch

    kind, _, index = device.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support (a CPU build)"
                   if torch.version.cuda is None else
                   "torch finds no CUDA device (driver, or CUDA_VISIBLE_DEVICES?)")
            return f"--device {device}: no CUDA device here: {why}; use --device cpu"
        count = torch.cuda.device_count()
        if index and int(index) >= count:
            return f"--device {device}: this machine has {count} CUDA device(s) (cuda:0..)"
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            return "--device mps: no Apple MPS device here (macOS on Apple silicon only); " \
                   "use --device cpu"
    return None


def keep_triton_out() -> None:
    """Make ``import triton`` fail in this process when no GPU driver is present: torch
    imports it when installed (xgrammar depends on it) though nothing on CPU uses it, and
    it costs start-up time (and, at exit, ~40 lines of nanobind leak reports)."""
    if not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/kfd")):
        sys.modules.setdefault("triton", None)  # type: ignore[arg-type]


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
            code = child_exit(proc)
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
        _signal(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for role, proc in processes.items():
        end_child(proc, role, max(0.0, deadline - time.monotonic()), "ignored SIGTERM")


# -- waiting on children -----------------------------------------------------------------
# Popen.poll/wait are not used on the parent side: Popen guards its waitpid with a lock
# that is left held for good when a signal handler raises (StopRequested on SIGTERM,
# KeyboardInterrupt on Ctrl-C) between its acquire and its try (measured on CPython
# 3.11: one in five signals that interrupt a loop of poll() calls). From then on poll()
# says "running" for ever and wait() blocks for ever: `radixlm serve`, signalled while
# its supervision loop was polling, waited out the drain and then hung in the wait after
# SIGKILL. These helpers ask the kernel themselves and bound every wait.


def child_exit(proc: subprocess.Popen[bytes]) -> int | None:
    """`proc`'s exit code (negative: the signal that killed it) once it has exited, else
    None. Signal-safe: the status is read without reaping (WNOWAIT) and recorded in
    ``proc.returncode`` before the child is reaped, so an exception between the two
    loses nothing (the zombie then waits for this process to exit)."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped by a Popen call elsewhere: it recorded the code
        return proc.returncode if proc.returncode is not None else 0
    if info is None:
        return None
    killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
    proc.returncode = -info.si_status if killed else info.si_status
    with contextlib.suppress(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)
    return proc.returncode


def wait_child(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """`child_exit` once `proc` has exited, or None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (code := child_exit(proc)) is None and time.monotonic() < deadline:
        time.sleep(min(_REAP_INTERVAL_S, max(0.0, deadline - time.monotonic())))
    return code


def end_child(proc: subprocess.Popen[bytes], role: str, timeout_s: float, why: str) -> None:
    """Wait up to `timeout_s` for `proc` to exit, then SIGKILL it and wait `KILL_WAIT_S`
    more at most (a process the kernel cannot kill at once is left to init)."""
    if wait_child(proc, timeout_s) is not None:
        return
    log.warning("the %s process (pid %d) %s; killing it", role, proc.pid, why)
    _signal(proc, signal.SIGKILL)
    if wait_child(proc, KILL_WAIT_S) is None:
        log.warning("the %s process (pid %d) is still there %.0f s after SIGKILL; not "
                    "waiting for it", role, proc.pid, KILL_WAIT_S)


def stop_child(proc: subprocess.Popen[bytes], role: str = "http",
               grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM `proc`, SIGKILL after `grace_s`; bounded (`end_child`)."""
    _signal(proc, signal.SIGTERM)
    end_child(proc, role, grace_s, "ignored SIGTERM")


def _signal(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Signal `proc` unless it has exited (a reaped pid may be another process's now)."""
    if child_exit(proc) is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)


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


class DeviceError(ValueError):
    """The device the user named is not on this machine."""


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _run_role(role: str, config: EngineConfig, endpoints: Endpoints) -> None:
    if role == "engine":
        t_import = time.perf_counter()
        if not config.device.startswith("cuda"):
            keep_triton_out()
        problem = device_problem(config.device)
        if problem is not None:
            raise DeviceError(problem)
        from radixlm.runtime.engine.engine_main import run_engine

        # The first stage of a start (torch alone takes ~2 s); the engine logs the others.
        # DEBUG: an engine that then fails to start keeps its error to one line.
        logging.getLogger("radixlm.engine").debug(
            "imports (torch, the engine) in %.2fs", time.perf_counter() - t_import)
        run_engine(config, endpoints)
    else:
        from radixlm.runtime.frontend import run_frontend

        run_frontend(config, endpoints)


def child_main(argv: Sequence[str] | None = None) -> int:
    """``python -m radixlm.runtime.launcher ROLE SPEC PARENT_PID`` (started by start_server)."""
    parser = argparse.ArgumentParser(prog="radixlm.runtime.launcher", allow_abbrev=False,
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
        _report(args.role, config, endpoints, e)
        return 1
    return 0


def _report(role: str, config: EngineConfig, endpoints: Endpoints, e: BaseException) -> None:
    """Say once why a child failed: the one-line summary goes to ``<role>.error``, which
    the parent reports (`ServerStartError`); this process's log repeats it only when the
    parent may not be told (the server was serving already). A user error carries no
    traceback; anything else has one with ``--debug``."""
    role_log = logging.getLogger(f"radixlm.{role}")
    user_error = isinstance(e, _USER_ERRORS)
    summary = str(e) if user_error else f"{type(e).__name__}: {e}"
    serving = (Path(endpoints.runtime_dir) / READY_FILE).exists()
    if config.debug:
        role_log.error("%s", traceback.format_exc())
    elif serving or not endpoints.runtime_dir:
        role_log.error("%s", summary if user_error else
                       f"{summary} (run with --debug for the traceback)")
    error_file = Path(endpoints.runtime_dir) / f"{role}.error"
    with contextlib.suppress(OSError):
        error_file.write_text(summary + "\n", encoding="utf-8")


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: with torch loaded it takes seconds, and a
    server process has closed its sockets and has nothing else to finalise."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(child_main())
