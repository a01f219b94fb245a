"""``python -m radixlm.runtime.http``: the HTTP frontend process (uvicorn).

Users attach it to a running server with flags (``--engine ENDPOINT --http HOST:PORT``);
`radixlm serve` starts it with ``--spec-stdin`` and writes its typed `HttpSpec` to its
stdin (launch.py), so its config is never re-serialised as flags."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Collection, Sequence
from typing import Any

import msgspec
from radixlm.runtime.http.config import (
    API_KEY_ENV,
    HTTP,
    HttpConfig,
    HttpConfigError,
    HttpSpec,
    check_bind,
    parse_listen,
    read_api_keys,
)
from radixlm.runtime.settings import LOG_LEVELS, add_settings, config_from_args

SPEC_FLAG = "--spec-stdin"  # radixlm serve's own HTTP child: an `HttpSpec` on stdin
_DEFAULT = HttpConfig(engine_endpoint="")


# Settings whose flags only this module's own command line has: radixlm serve gives its
# child the gateway's credentials itself, and its --drain-timeout is the server's.
_ATTACHING = ("server_key", "client_key", "gateway_token_file", "drain_timeout_s")


def add_http_arguments(p: argparse.ArgumentParser, *, serve: bool = False,
                       skip: Collection[str] = ()) -> None:
    """The HTTP flags (generated from `HttpConfig`'s declarations, less `skip`: those the
    command has already), shared by `radixlm serve` (`serve`: the API is on by default,
    at --host/--port; --no-http turns it off) and this module's own command line (the
    API at --http, the engine's credentials as flags)."""
    g = p.add_argument_group(HTTP)
    if serve:  # "not given" (None) is what tells the default address from an asked one
        add_settings(p, HttpConfig, only=("host", "port"), defaults={"host": None, "port": None})
        g.add_argument("--no-http", action="store_true",
                       help="no HTTP API: serve the ZeroMQ protocol only")
        g.add_argument("--http", default=None, metavar="[HOST:]PORT",
                       help="the HTTP API's address in one flag (8000 = 127.0.0.1:8000)")
    else:
        add_settings(p, HttpConfig, only=_ATTACHING[:3])
        g.add_argument("--http", default=None, metavar="[HOST:]PORT",
                       help="serve the OpenAI-compatible HTTP API here (e.g. 127.0.0.1:8000)")
        g.add_argument("--fd", type=int, default=None, metavar="FD",
                       help="serve this listening socket (bound by the parent) at --http")
        add_settings(p, HttpConfig, only=_ATTACHING[3:])
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every HTTP route but /health; "
                        "repeat it for several keys, each its own tenant (also read, one a "
                        f"line, from ${API_KEY_ENV})")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read API keys from this file, one a line ('#' comments)")
    add_settings(p, HttpConfig, skip={*skip, "host", "port", *_ATTACHING})


def http_listen(args: argparse.Namespace) -> tuple[str, int] | None:
    """Where `radixlm serve`'s HTTP API listens: --http, or --host/--port, or the default;
    None with --no-http (raises HttpConfigError for flags that contradict each other)."""
    given = [f for f, v in (("--http", args.http), ("--host", args.host),
                            ("--port", args.port)) if v is not None]
    if args.no_http:
        if given:
            raise HttpConfigError(f"--no-http contradicts {', '.join(given)}")
        return None
    if args.http is not None:
        if args.host is not None or args.port is not None:
            raise HttpConfigError("give --http [HOST:]PORT or --host/--port, not both")
        return parse_listen(args.http)
    host = _DEFAULT.host if args.host is None else args.host.strip("[]")
    return ("127.0.0.1" if host == "localhost" else host), (
        _DEFAULT.port if args.port is None else args.port)


def http_asked(args: argparse.Namespace) -> bool:
    """Whether the user asked for the HTTP API by a flag (not only by default)."""
    return any(getattr(args, f, None) is not None for f in ("http", "host", "port"))


def http_config(args: argparse.Namespace, engine_endpoint: str,
                listen: tuple[str, int] | None = None, **fixed: Any) -> HttpConfig:
    """The HttpConfig for parsed flags (raises HttpConfigError for a bad value); `listen`:
    the address, when not --http's; `fixed`: values the command decided."""
    host, port = listen if listen is not None else parse_listen(args.http)
    keys = read_api_keys(args.api_key, args.api_key_file, os.environ.get(API_KEY_ENV))
    check_bind(host, keys, args.insecure)
    return config_from_args(args, HttpConfig, engine_endpoint=engine_endpoint, host=host,
                            port=port, api_keys=keys, **fixed)


def serve(config: HttpConfig, log_level: str = "warning", fd: int | None = None) -> None:
    """Run the HTTP frontend until SIGTERM/SIGINT (on listening socket `fd` when given)."""
    import uvicorn
    from radixlm.runtime.http.app import build_app
    from radixlm.runtime.http.head_limits import limited_protocol

    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    server = uvicorn.Server(uvicorn.Config(
        build_app(config), host=config.host, port=config.port, loop=loop,
        http=limited_protocol(config.max_header_bytes, config.max_headers),
        lifespan="on", log_level=log_level, access_log=log_level == "debug",
        timeout_graceful_shutdown=config.drain_timeout_s,  # a second signal: at once
    ))
    server.run(sockets=None if fd is None else [socket.socket(fileno=fd)])
    if not server.started:
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == [SPEC_FLAG]:
        return _serve_spec(sys.stdin.buffer.read())
    parser = argparse.ArgumentParser(
        prog="python -m radixlm.runtime.http", allow_abbrev=False,
        description="The OpenAI-compatible HTTP frontend of a running radixlm server.")
    parser.add_argument("--engine", required=True, metavar="ENDPOINT",
                        help="the server's protocol endpoint (ipc://... or tcp://...)")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="stop once this process has exited")
    parser.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    add_http_arguments(parser)
    args = parser.parse_args(argv)
    if args.http is None:
        parser.error("--http HOST:PORT is required")
    try:
        config = http_config(args, args.engine)
        if len(config.api_keys) > 1 and config.gateway_token_file is None:
            raise HttpConfigError(
                "several API keys are several tenants, which needs the server's gateway "
                "credential: --gateway-token-file RUNTIME_DIR/gateway.token (radixlm serve "
                "--http passes it)")
    except HttpConfigError as e:
        print(f"radixlm http: {e}", file=sys.stderr)
        return 2
    return _run(HttpSpec(config, args.parent_pid, args.log_level, args.fd))


def load_http_spec(data: bytes) -> HttpSpec:
    """The spec `radixlm serve` wrote (launch.py), typed and every setting checked;
    `HttpConfigError` for one that is not."""
    try:
        return msgspec.json.decode(data, type=HttpSpec)
    except msgspec.ValidationError as e:
        raise HttpConfigError(f"a bad spec on stdin: {e}") from None


def _serve_spec(data: bytes) -> int:
    try:
        spec = load_http_spec(data)
    except HttpConfigError as e:
        print(f"radixlm http: {e}", file=sys.stderr)
        return 2
    return _run(spec)


def _run(spec: HttpSpec) -> int:
    logging.basicConfig(level=spec.log_level.upper(),
                        format="%(asctime)s radixlm-http %(levelname)s %(name)s: %(message)s")
    if spec.parent_pid is not None:
        from radixlm.runtime.server.child import stop_when_gone

        stop_when_gone(spec.parent_pid)
    serve(spec.config, spec.log_level, spec.fd)
    return 0
