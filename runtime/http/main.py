"""``python -m radixlm.runtime.http``: the HTTP frontend process (uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence

from radixlm.runtime.http.config import (
    API_KEY_ENV,
    DEFAULT_LINK_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_MESSAGES,
    DEFAULT_MAX_PARTS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TOOLS,
    DEFAULT_RESPONSE_TTL_S,
    HttpConfig,
    HttpConfigError,
    check_bind,
    parse_listen,
    read_api_keys,
)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000  # vLLM's (llama-server's is 8080, SGLang's 30000)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: pick a free one), got {text!r}")
    return int(text)


def add_http_arguments(p: argparse.ArgumentParser, *, insecure: bool = True,
                       serve: bool = False) -> None:
    """The HTTP flags, shared by `radixlm serve` (`serve`: the API is on by default, at
    --host/--port, --no-http turns it off) and this module's own command line
    (`insecure`: also add --insecure, which `radixlm serve` has already)."""
    g = p.add_argument_group("HTTP (OpenAI-compatible API)")
    if serve:
        g.add_argument("--host", default=None,
                       help=f"address of the HTTP API; a non-loopback one needs --api-key "
                            f"(default: {DEFAULT_HOST})")
        g.add_argument("--port", type=_port, default=None,
                       help=f"port of the HTTP API; 0 = a free one (default: {DEFAULT_PORT})")
        g.add_argument("--no-http", action="store_true",
                       help="no HTTP API: serve the ZeroMQ protocol only")
        g.add_argument("--http", default=None, metavar="[HOST:]PORT",
                       help="the HTTP API's address in one flag (8000 = 127.0.0.1:8000)")
    else:
        g.add_argument("--http", default=None, metavar="[HOST:]PORT",
                       help="serve the OpenAI-compatible HTTP API here (e.g. 127.0.0.1:8000)")
        g.add_argument("--fd", type=int, default=None, metavar="FD",
                       help="serve this listening socket (bound by the parent) at --http")
        g.add_argument("--drain-timeout", type=float, default=HttpConfig.drain_timeout_s,
                       metavar="SECONDS",
                       help="on SIGTERM, how long in-flight requests may finish (a second "
                            "signal stops at once) (default: %(default)s)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every HTTP route but /health; "
                        "repeat it for several keys, each its own tenant (also read, one a "
                        f"line, from ${API_KEY_ENV})")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read API keys from this file, one a line ('#' comments)")
    g.add_argument("--metrics-require-key", action="store_true",
                   help="/metrics asks for an API key on loopback too (beyond loopback it "
                        "always does when keys are set)")
    if insecure:
        g.add_argument("--insecure", action="store_true",
                       help="allow a non-loopback --http address without an API key")
    g.add_argument("--response-ttl", type=float, default=DEFAULT_RESPONSE_TTL_S,
                   metavar="SECONDS",
                   help="idle time after which a stored response or chat session expires "
                        "(its id then gets 404) (default: %(default)s)")
    g.add_argument("--link-timeout", type=float, default=DEFAULT_LINK_TIMEOUT_S,
                   metavar="SECONDS",
                   help="fail requests with 503 once the server's frontend has not answered "
                        "the HTTP API's heartbeat for this long (default: %(default)s)")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body accepted (413 beyond) (default: %(default)s)")
    g.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                   help="largest request head (request line and headers) accepted; 431 "
                        "beyond, before the API key is looked at (default: %(default)s)")
    g.add_argument("--max-headers", type=int, default=DEFAULT_MAX_HEADERS,
                   help="most headers in one request (431 beyond) (default: %(default)s)")
    g.add_argument("--max-messages", type=int, default=DEFAULT_MAX_MESSAGES,
                   help="most messages (or input items) in one request (default: %(default)s)")
    g.add_argument("--max-tools", type=int, default=DEFAULT_MAX_TOOLS,
                   help="most tool definitions in one request (default: %(default)s)")
    g.add_argument("--max-parts", type=int, default=DEFAULT_MAX_PARTS,
                   help="most content parts and tool calls in one request, all messages "
                        "together (default: %(default)s)")
    g.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="output limit of requests that name none (default: what is left of "
                        "the context after the prompt)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id of /v1/models and of requests (default: the engine's)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a model directory whose tokenizer names tokens in logprobs and echoes "
                        "token-id prompts (without it: 'token_id:N')")


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
    host = DEFAULT_HOST if args.host is None else args.host.strip("[]")
    return ("127.0.0.1" if host == "localhost" else host), (
        DEFAULT_PORT if args.port is None else args.port)


def http_asked(args: argparse.Namespace) -> bool:
    """Whether the user asked for the HTTP API by a flag (not only by default)."""
    return any(getattr(args, f, None) is not None for f in ("http", "host", "port"))


def http_config(args: argparse.Namespace, engine_endpoint: str,
                listen: tuple[str, int] | None = None) -> HttpConfig:
    """The HttpConfig for parsed flags (raises HttpConfigError for a bad value); `listen`:
    the address, when not --http's."""
    host, port = listen if listen is not None else parse_listen(args.http)
    keys = read_api_keys(args.api_key, args.api_key_file, os.environ.get(API_KEY_ENV))
    check_bind(host, keys, args.insecure)
    if args.link_timeout <= 0:
        raise HttpConfigError("--link-timeout must be > 0")
    if args.response_ttl <= 0 or args.max_body_bytes <= 0 or (
            args.default_max_tokens is not None and args.default_max_tokens <= 0):
        raise HttpConfigError("--response-ttl, --max-body-bytes and --default-max-tokens must "
                              "be > 0")
    bounds = {"--max-header-bytes": args.max_header_bytes, "--max-headers": args.max_headers,
              "--max-messages": args.max_messages, "--max-tools": args.max_tools,
              "--max-parts": args.max_parts}
    if any(v <= 0 for v in bounds.values()):
        raise HttpConfigError(f"{', '.join(bounds)} must be > 0")
    return HttpConfig(engine_endpoint=engine_endpoint, host=host, port=port, api_keys=keys,
                      insecure=args.insecure, metrics_require_key=args.metrics_require_key,
                      gateway_token_file=getattr(args, "gateway_token_file", None),
                      server_key=getattr(args, "server_key", None),
                      client_key=getattr(args, "client_key", None), response_ttl_s=args.response_ttl,
                      max_body_bytes=args.max_body_bytes,
                      default_max_tokens=args.default_max_tokens,
                      max_header_bytes=args.max_header_bytes, max_headers=args.max_headers,
                      max_messages=args.max_messages, max_tools=args.max_tools,
                      max_parts=args.max_parts,
                      drain_timeout_s=getattr(args, "drain_timeout", HttpConfig.drain_timeout_s),
                      link_timeout_s=args.link_timeout,
                      served_model_name=args.served_model_name, tokenizer_dir=args.tokenizer)


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
    parser = argparse.ArgumentParser(
        prog="python -m radixlm.runtime.http", allow_abbrev=False,
        description="The OpenAI-compatible HTTP frontend of a running radixlm server.")
    parser.add_argument("--engine", required=True, metavar="ENDPOINT",
                        help="the server's protocol endpoint (ipc://... or tcp://...)")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="stop once this process has exited")
    parser.add_argument("--log-level", default="warning",
                        choices=("debug", "info", "warning", "error"))
    parser.add_argument("--server-key", default=None, metavar="PATH",
                        help="with an --auth-dir server: its public certificate (server.key)")
    parser.add_argument("--client-key", default=None, metavar="PATH",
                        help="with an --auth-dir server: the gateway's secret certificate "
                             "(its runtime directory's gateway.key_secret)")
    parser.add_argument("--gateway-token-file", default=None, metavar="PATH",
                        help="the server's gateway credential (its runtime directory's "
                             "gateway.token): each API key becomes its own tenant")
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
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s radixlm-http %(levelname)s %(name)s: %(message)s")
    if args.parent_pid is not None:
        from radixlm.runtime.server.child import stop_when_gone

        stop_when_gone(args.parent_pid)
    serve(config, args.log_level, args.fd)
    return 0
