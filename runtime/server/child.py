"""One process of a radixlm server, as the launcher starts it: ``python -m
radixlm.runtime.server.child ROLE SPEC PARENT_PID`` (`child_main`). It dies with its
parent, ignores SIGINT (Ctrl-C is the launching process's to handle), exits 128+N on
SIGTERM, and says once why it failed (``<runtime dir>/<role>.error``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from radixlm.runtime.config import Endpoints, EngineConfig
from radixlm.runtime.server.environment import device_problem, keep_triton_out
from radixlm.runtime.server.rundir import READY_FILE
from radixlm.runtime.server.spec import ROLES, load_spec

log = logging.getLogger("radixlm.launcher")


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


def _announce_engine(endpoints: Endpoints) -> str:
    """Tell the frontend a new engine process is starting (`EngineBoot`), before the
    imports and the model load that take seconds; returns its boot id."""
    import zmq
    from radixlm.runtime.engine.wire import EngineBoot, encode

    boot = secrets.token_hex(8)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    try:
        sock.connect(endpoints.to_frontend)
        sock.send(encode(EngineBoot(boot=boot)))
    finally:
        sock.close(linger=1000)  # (a frontend not bound yet: a first start, nothing to tell)
        ctx.term()
    return boot


def _run_role(role: str, config: EngineConfig, endpoints: Endpoints) -> None:
    if role == "engine":
        boot = _announce_engine(endpoints) if endpoints.to_frontend else ""
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
        run_engine(config, endpoints, boot=boot)
    else:
        from radixlm.runtime.frontend import run_frontend

        run_frontend(config, endpoints)


def child_main(argv: Sequence[str] | None = None) -> int:
    """``python -m radixlm.runtime.server.child ROLE SPEC PARENT_PID`` (started by start_server)."""
    parser = argparse.ArgumentParser(prog="radixlm.runtime.server.child", allow_abbrev=False,
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
