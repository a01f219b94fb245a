"""Starting the HTTP frontend as a child process of `radixlm serve`, and waiting for it.

`radixlm serve` binds the HTTP address itself before anything starts (listeners.py) and
hands the listening socket to the child: the readiness probe can only reach this server."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time

from radixlm.runtime.http.config import API_KEY_ENV, HttpConfig
from radixlm.runtime.server.children import child_exit, stop_child
from radixlm.runtime.server.listeners import Listener

_PROBE_INTERVAL_S = 0.1


class HttpStartError(RuntimeError):
    """The HTTP frontend did not come up (the message says why)."""


def child_command(config: HttpConfig, parent_pid: int, log_level: str,
                  fd: int | None = None) -> list[str]:
    host = f"[{config.host}]" if ":" in config.host else config.host
    command = [
        sys.executable, "-m", "radixlm.runtime.http", "--engine", config.engine_endpoint,
        "--http", f"{host}:{config.port}", "--parent-pid", str(parent_pid),
        *(["--fd", str(fd)] if fd is not None else []),
        "--log-level", log_level, "--response-ttl", str(config.response_ttl_s),
        "--max-body-bytes", str(config.max_body_bytes),
        "--max-header-bytes", str(config.max_header_bytes),
        "--max-headers", str(config.max_headers), "--max-messages", str(config.max_messages),
        "--max-tools", str(config.max_tools), "--max-parts", str(config.max_parts),
        "--drain-timeout", str(config.drain_timeout_s),
        "--link-timeout", str(config.link_timeout_s),
    ]
    if config.default_max_tokens is not None:
        command += ["--default-max-tokens", str(config.default_max_tokens)]
    if config.insecure:
        command.append("--insecure")
    if config.metrics_require_key:
        command.append("--metrics-require-key")
    if config.gateway_token_file:
        command += ["--gateway-token-file", config.gateway_token_file]
    if config.server_key and config.client_key:
        command += ["--server-key", config.server_key, "--client-key", config.client_key]
    if config.served_model_name:
        command += ["--served-model-name", config.served_model_name]
    return command


def start_http(config: HttpConfig, *, log_level: str = "warning",
               timeout_s: float = 60.0, listener: Listener | None = None,
               keep_listener: bool = False) -> subprocess.Popen[bytes]:
    """Start the HTTP frontend (the key travels in its environment, not its argv) on
    `listener` (bound at ``config.host``/``config.port``; the child takes it over; with
    `keep_listener` this process keeps its copy too, to start another child on it) and
    return once /health answers."""
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)
    if config.api_keys:
        env[API_KEY_ENV] = "\n".join(config.api_keys)
    fd = listener.fd if listener is not None else None
    proc = subprocess.Popen(child_command(config, os.getpid(), log_level, fd), env=env,
                            stdin=subprocess.DEVNULL, pass_fds=() if fd is None else (fd,),
                            start_new_session=True)  # Ctrl-C is the parent's to handle
    if listener is not None and not keep_listener:
        listener.close()  # the child holds it now
    try:
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
