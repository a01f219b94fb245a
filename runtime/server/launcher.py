"""Start a radixlm server: an engine process and a frontend process, supervised.

`start_server(config)` makes a private (0700) runtime directory for the ipc sockets,
binds the client endpoint itself (listeners.py: a taken address fails here, before any
process starts or any model loads), starts both processes (``python -m
radixlm.runtime.server.child ROLE ...``: plain subprocesses, so nothing of the caller's
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

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from radixlm.runtime.config import START_TIMEOUT_S, Endpoints, EngineConfig
from radixlm.runtime.protocol import Welcome
from radixlm.runtime.server.children import (
    STOP_GRACE_S,
    child_exit,
    end_child,
    signal_child,
)
from radixlm.runtime.server.environment import engine_environment
from radixlm.runtime.server.listeners import Listener, listen_zmq
from radixlm.runtime.server.rundir import read_ready, remove_stale, write_owner
from radixlm.runtime.server.spec import ROLES, encode_spec
from radixlm.runtime.state.location import StateDir, StateDirError, open_state_dir
from radixlm.runtime.transport.channel import (
    ipc_endpoint,
    ipc_path,
    make_runtime_dir,
    parse_client_endpoint,
)
from radixlm.runtime.transport.curve_keys import check_auth_dir

__all__ = [
    "RunningServer",
    "ServerStartError",
    "connect_address",
    "make_endpoints",
    "start_server",
]

log = logging.getLogger("radixlm.launcher")

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
    state: StateDir | None = None  # the state directory, locked for the server's life
    spawn: Spawner | None = None  # starts a role's process again (supervise.py)
    listener: Listener | None = None  # the client socket, kept for a restarted frontend

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
            signal_child(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s + STOP_GRACE_S
        for role, proc in front.items():
            end_child(proc, role, max(0.0, deadline - time.monotonic()), "did not drain in time")
        self.stop()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop every child (SIGTERM, then SIGKILL after `grace_s`), remove the sockets and
        let the state directory go."""
        _stop_processes(self.processes, grace_s)
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        _remove_runtime_files(self.runtime_dir, self.endpoints.client)
        if self.state is not None:
            self.state.close()

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
    start_timeout_s: float = START_TIMEOUT_S,
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
    config, state = _open_state(config)
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
        spec.write_bytes(encode_spec(config, endpoints))
        spec.chmod(stat.S_IRUSR | stat.S_IWUSR)
        spawn = Spawner(config, spec, listener.fd, stdout, stderr, engine_command)
        for role in ROLES:
            processes[role] = spawn(role)
        # The launcher keeps its copy of the listening socket: a frontend that dies is
        # started again on it (runtime/server/supervise.py), and clients reconnect there.
        bound, welcome = _wait_ready(processes, runtime_dir, start_timeout_s)
        endpoints = dataclasses.replace(endpoints, client=bound)
    except BaseException:
        _stop_processes(processes, STOP_GRACE_S)
        if listener is not None:
            listener.close(unlink=True)  # bound here: ours to remove
        _remove_runtime_files(runtime_dir, "")
        if state is not None:
            state.close()
        raise
    log.info("serving %s at %s (context %d tokens, KV pool %d tokens, page size %d)",
             welcome.model, endpoints.client, welcome.context_length, welcome.kv_capacity,
             welcome.page_size)
    return RunningServer(config, endpoints, welcome, processes, runtime_dir, state, spawn,
                         listener)


@dataclasses.dataclass
class Spawner:
    """Starts one of a server's processes (again, after it died: the same command)."""

    config: EngineConfig
    spec: Path
    listener_fd: int
    stdout: Any = None
    stderr: Any = None
    engine_command: Sequence[str] | None = None

    def __call__(self, role: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "radixlm.runtime.server.child", role]
        if role == "engine" and self.engine_command is not None:
            command = list(self.engine_command)
        return subprocess.Popen(
            [*command, str(self.spec), str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=self.stdout, stderr=self.stderr,
            env=engine_environment(self.config) if role == "engine" else None,
            pass_fds=(self.listener_fd,) if role == "frontend" else (),
            start_new_session=True,  # a Ctrl-C in the terminal is the parent's to handle
        )


def _open_state(config: EngineConfig) -> tuple[EngineConfig, StateDir | None]:
    """Open and lock `config.state_dir` for this server; one that cannot be used is said
    in one line and the server starts without state."""
    if not config.state_dir:
        return config, None
    try:
        state = open_state_dir(config.state_dir)
    except StateDirError as e:
        log.error("%s: serving without state (sessions and stored responses end with the "
                  "server)", e)
        return msgspec.structs.replace(config, state_dir=""), None
    log.debug("state directory %s", state.path)  # (the engine says what it found there)
    return msgspec.structs.replace(config, state_dir=str(state.path)), state


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
        signal_child(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for role, proc in processes.items():
        end_child(proc, role, max(0.0, deadline - time.monotonic()), "ignored SIGTERM")


def _remove_runtime_files(runtime_dir: Path, client_endpoint: str) -> None:
    shutil.rmtree(runtime_dir, ignore_errors=True)
    path = ipc_path(client_endpoint)  # a user-chosen ipc path outside the runtime dir
    if path is not None:
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
        except OSError:
            pass


# -- the child side ----------------------------------------------------------------------

