"""Waiting on child processes, signal-safe and bounded (the launcher's children, the
SDK's server process).

Popen.poll/wait are not used on the parent side: Popen guards its waitpid with a lock
that is left held for good when a signal handler raises (StopRequested on SIGTERM,
KeyboardInterrupt on Ctrl-C) between its acquire and its try (measured on CPython
3.11: one in five signals that interrupt a loop of poll() calls). From then on poll()
says "running" for ever and wait() blocks for ever: `radixlm serve`, signalled while
its supervision loop was polling, waited out the drain and then hung in the wait after
SIGKILL. These helpers ask the kernel themselves and bound every wait.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time

__all__ = ["KILL_WAIT_S", "STOP_GRACE_S", "child_exit", "end_child", "signal_child", "stop_child", "wait_child"]

log = logging.getLogger("radixlm.launcher")

STOP_GRACE_S = 5.0
KILL_WAIT_S = 5.0  # after SIGKILL: a child still there then is left to init, not waited on
_REAP_INTERVAL_S = 0.02


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
    signal_child(proc, signal.SIGKILL)
    if wait_child(proc, KILL_WAIT_S) is None:
        log.warning("the %s process (pid %d) is still there %.0f s after SIGKILL; not "
                    "waiting for it", role, proc.pid, KILL_WAIT_S)


def stop_child(proc: subprocess.Popen[bytes], role: str = "http",
               grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM `proc`, SIGKILL after `grace_s`; bounded (`end_child`)."""
    signal_child(proc, signal.SIGTERM)
    end_child(proc, role, grace_s, "ignored SIGTERM")


def signal_child(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Signal `proc` unless it has exited (a reaped pid may be another process's now)."""
    if child_exit(proc) is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)
