"""``radixlm serve``: a server (engine, frontend, HTTP API) until Ctrl-C or SIGTERM.

Order, so that every mistake a user can make costs milliseconds, not a model load:
check every flag (endpoint rules, HTTP flags, key directory, model path, device name);
take the default server's role unless ``--endpoint`` was given (transport/discovery.py: the first
server keeps it, a second one serves on a private socket and says where); bind the HTTP
address and the client endpoint (listeners.py: a taken address is one line naming it);
only then start the processes and load the model. "ready" is printed once this process
serves: the HTTP readiness probe can only reach the socket bound here.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

import msgspec
from radixlm.runtime.cli.common import (
    StopRequested,
    say,
    setup_logging,
    stop_on_sigterm,
    write_endpoint_file,
)
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.frontend.tenants import GATEWAY_TOKEN
from radixlm.runtime.http.config import HttpConfig, HttpConfigError
from radixlm.runtime.http.launch import HttpStartError, start_http
from radixlm.runtime.http.main import http_asked, http_config, http_listen
from radixlm.runtime.server.child import stop_when_gone
from radixlm.runtime.server.exits import how_it_ended
from radixlm.runtime.server.launcher import (
    RunningServer,
    ServerStartError,
    check_config,
    connect_address,
    start_server,
)
from radixlm.runtime.server.listeners import Listener, listen_http
from radixlm.runtime.server.progress import starting_label
from radixlm.runtime.server.supervise import supervise
from radixlm.runtime.transport.channel import EndpointError, parse_client_endpoint
from radixlm.runtime.transport.curve_keys import AuthDirError, check_auth_dir
from radixlm.runtime.transport.discovery import (
    DefaultClaim,
    DefaultServer,
    RuntimeDirError,
    claim_default,
)

__all__ = ["run_serve"]

log = logging.getLogger("radixlm.serve")


def _checked_http(args: argparse.Namespace, config: EngineConfig) -> HttpConfig | None:
    """The HTTP API's config (engine endpoint filled in later), None without one."""
    listen = http_listen(args)
    if listen is None:
        return None
    if config.auth_dir and not http_asked(args):
        # A server of CurveZMQ tenants serves HTTP only when asked: on by default, a
        # loopback API without a key would let any local user in beside the keys.
        return None  # (said once the other checks have passed)
    fixed: dict[str, str] = {}
    if args.served_model_name is None and config.model == "default":
        fixed["served_model_name"] = "SmolLM2-135M-Instruct"  # "default" is accepted too
    return http_config(args, engine_endpoint="", listen=listen, **fixed)


def _check(config: EngineConfig) -> None:
    """What start_server would refuse, refused before anything is bound."""
    if config.auth_dir:
        check_auth_dir(Path(config.auth_dir))
    if config.endpoint:
        parse_client_endpoint(config.endpoint, authenticated=bool(config.auth_dir),
                              insecure=config.insecure)
    check_config(config)


def _claim(config: EngineConfig) -> tuple[EngineConfig, DefaultClaim | None]:
    """Take the default server's role when no --endpoint was given."""
    if config.endpoint:
        return config, None
    held = claim_default()
    if isinstance(held, DefaultServer):
        who = f"pid {held.pid}" if held.pid else "another process"
        say("serve", f"another server ({who}) is this user's default at {held.endpoint}; "
                     "this one serves at a private endpoint (printed when ready): give it "
                     "to clients with --endpoint or $RADIXLM_ENDPOINT")
        return config, None
    return msgspec.structs.replace(config, endpoint=held.endpoint), held


def run_serve(args: argparse.Namespace, config: EngineConfig) -> int:
    setup_logging(config.log_level)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    if args.parent_pid is not None:
        stop_when_gone(args.parent_pid)
    try:
        http = _checked_http(args, config)
        _check(config)
    except HttpConfigError as e:
        say("serve", str(e))
        return 2
    except (EndpointError, AuthDirError, ServerStartError) as e:
        say("serve", str(e))
        return 1
    if config.auth_dir and http is None and not args.no_http:
        log.info("no HTTP API with --auth-dir unless asked (--http, --host or --port)")
    claim: DefaultClaim | None = None
    http_socket: Listener | None = None
    server: RunningServer | None = None
    try:
        config, claim = _claim(config)
        if http is not None:
            http_socket = listen_http(http.host, http.port)
            http = msgspec.structs.replace(http, port=http_socket.port)
        http_url = f"http://{_url_host(http.host)}:{http.port}/v1" if http else ""
        if claim is not None:
            claim.publish(DefaultServer(os.getpid(), claim.endpoint, http_url))
        # A line at once: the engine's own log lines (imports, weights, tokenizer, pool)
        # follow as each stage ends.
        if sys.stderr.isatty():  # piped stderr keeps start-up errors to their one line
            say("serve", f"{starting_label(config.model or 'default')}: loading the model")
        server = start_server(config, start_timeout_s=args.start_timeout, preflight=False,
                              takeover=claim is not None)
        if http is not None:
            http = msgspec.structs.replace(
                http, engine_endpoint=connect_address(server.endpoint),
                gateway_token_file=str(server.runtime_dir / GATEWAY_TOKEN))
            if config.auth_dir:  # the gateway's own CurveZMQ key, authorized by the frontend
                http = msgspec.structs.replace(
                    http, server_key=os.path.join(config.auth_dir, "server.key"),
                    client_key=str(server.runtime_dir / "gateway.key_secret"))
            server.processes["http"] = start_http(http, log_level=config.log_level,
                                                  listener=http_socket, keep_listener=True)
            say("serve", f"HTTP API at {http_url}")
        if claim is not None:
            claim.publish(DefaultServer(os.getpid(), server.endpoint, http_url, ready=True))
            say("serve", f"ready at {server.endpoint} (the default server: clients find it "
                         "without --endpoint)")
        else:
            say("serve", f"ready at {server.endpoint}")
        if args.endpoint_file:
            write_endpoint_file(args.endpoint_file, server.endpoint)
        respawn = {}
        if http is not None and http_socket is not None:
            started_http, socket_kept = http, http_socket
            respawn["http"] = lambda: start_http(started_http, log_level=config.log_level,
                                                 listener=socket_kept, keep_listener=True)
        role, code = supervise(server, respawn)  # a dead child is started again
        say("serve", f"the {role} process {how_it_ended(code)}; stopping")
        return 1
    except (ServerStartError, EndpointError, RuntimeDirError, HttpStartError) as e:
        say("serve", str(e))
        return 1
    except (KeyboardInterrupt, StopRequested) as e:
        why = "SIGTERM" if isinstance(e, StopRequested) else "Ctrl-C"
        if server is not None:
            _drain(server, config.drain_timeout_s, why)
        # The last word of the log says why it stopped (rl.Engine reports that line).
        say("serve", f"stopped on {why}")
        return 0  # start_server has stopped what it started if it was interrupted
    finally:
        if http_socket is not None:
            http_socket.close()
        if server is not None:
            server.stop()  # (removes the client socket: the default one too)
        if claim is not None:
            claim.release()
        if args.endpoint_file:
            with contextlib.suppress(OSError):
                os.unlink(args.endpoint_file)


def _drain(server: RunningServer, timeout_s: float, why: str) -> None:
    """Let running requests finish (up to `timeout_s`); a second signal stops at once."""
    say("serve", f"{why}: taking no new requests, finishing the running ones (up to "
                 f"{timeout_s:g} s; {why} again stops at once)")
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.drain(timeout_s)
    except (KeyboardInterrupt, StopRequested):
        say("serve", "stopping at once")
        server.stop(grace_s=0.0)


def _url_host(host: str) -> str:
    """The host a URL on this machine names for a server listening on `host`."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host
