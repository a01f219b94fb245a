"""Starting the HTTP frontend as a child process of `radixlm serve`, and waiting for it.

`radixlm serve` binds the HTTP address itself before anything starts (listeners.py) and
hands the listening socket to the child: the readiness probe can only reach this server.
The child is given its whole config as one typed `HttpSpec` on its stdin (``python -m
radixlm.runtime.http --spec-stdin``): no flags to re-serialise, and the API keys never in
an argv or an environment."""

from __future__ import annotations

import contextlib
import http.client
import os
import subprocess
import sys
import time

import msgspec
from radixlm.runtime.http.config import API_KEY_ENV, HttpConfig, HttpSpec
from radixlm.runtime.http.main import SPEC_FLAG
from radixlm.runtime.server.children import child_exit, stop_child
from radixlm.runtime.server.listeners import Listener

_PROBE_INTERVAL_S = 0.1


class HttpStartError(RuntimeError):
    """The HTTP frontend did not come up (the message says why)."""


def child_command() -> list[str]:
    return [sys.executable, "-m", "radixlm.runtime.http", SPEC_FLAG]


def start_http(config: HttpConfig, *, log_level: str = "warning",
               timeout_s: float = 60.0, listener: Listener | None = None,
               keep_listener: bool = False) -> subprocess.Popen[bytes]:
    """Start the HTTP frontend on `listener` (bound at ``config.host``/``config.port``;
    the child takes it over; with `keep_listener` this process keeps its copy too, to
    start another child on it) and return once /health answers."""
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)  # the keys it serves are the spec's
    fd = listener.fd if listener is not None else None
    spec = HttpSpec(config, parent_pid=os.getpid(), log_level=log_level, fd=fd)  # type: ignore[arg-type]
    proc = subprocess.Popen(child_command(), env=env, stdin=subprocess.PIPE,
                            pass_fds=() if fd is None else (fd,),
                            start_new_session=True)  # Ctrl-C is the parent's to handle
    if listener is not None and not keep_listener:
        listener.close()  # the child holds it now
    try:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError), proc.stdin:  # died at once: said below
            proc.stdin.write(msgspec.json.encode(spec))
        wait_ready(config.host, config.port, proc, timeout_s)
    except BaseException:
        stop_child(proc)
        raise
    return proc


def wait_ready(host: str, port: int, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    probe_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    while True:
        if proc is not None and child_exit(proc) is not None:
            raise HttpStartError(f"the HTTP frontend exited with code {proc.returncode} "
                                 "during start-up (see its log above)")
        try:
            conn = http.client.HTTPConnection(probe_host, port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            raise HttpStartError(f"the HTTP frontend did not answer on {host}:{port} within "
                                 f"{timeout_s:.0f} s")
        time.sleep(_PROBE_INTERVAL_S)
