"""The `radixlm` command line (``radixlm = radixlm.runtime.cli:main``;
``python -m radixlm.runtime.cli`` works too).

    radixlm serve [-m M] [--port P] ...              run a server until Ctrl-C / SIGTERM
    radixlm generate "prompt" [--endpoint E | -m M] [--max-tokens N] [--raw]
    radixlm chat ...                                 the SDK's REPL (radixlm.sdk.repl)
    radixlm sessions [--endpoint E]                  list live sessions
    radixlm top [--endpoint E] [--once]              a live view of a running server
    radixlm keys DIR [--client NAME]                 CurveZMQ keys for serve --auth-dir
    radixlm protocol-schema                          JSON Schema of every wire message

Clients find a server without being told where (transport/discovery.py): ``--endpoint``, else
``$RADIXLM_ENDPOINT``, else this user's default server (the one ``radixlm serve`` without
``--endpoint`` runs). Nothing is matched by abbreviation; the peers' spellings of common
flags (vLLM, llama-server, SGLang) are aliases. Errors a user can cause are one line;
``--debug`` shows tracebacks.

Engine flags: `radixlm.runtime.cli.engine_flags`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from radixlm.runtime.cli.common import say
from radixlm.runtime.cli.engine_flags import (
    add_debug_argument,
    add_engine_arguments,
    config_from_args,
)
from radixlm.runtime.cli.state_flags import with_state
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.settings import add_settings, number
from radixlm.runtime.transport.curve import add_key_arguments

REPL_MODULE = "radixlm.sdk.repl"


class _VersionAction(argparse.Action):
    """``--version``: the package metadata is read only when asked (it costs start-up)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from radixlm import __version__

        print(f"radixlm {__version__}")  # on stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixlm", allow_abbrev=False,
        description="A local LLM engine with a radix prefix KV cache and persistent sessions.",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, allow_abbrev=False, **kwargs)  # no prefix matching

    serve = command(
        "serve", help="run a server (engine + frontend + HTTP API) until Ctrl-C or SIGTERM",
        description="Load a model and serve the radixlm protocol on a ZeroMQ endpoint and "
                    "the OpenAI-compatible HTTP API (127.0.0.1:8000 unless --port/--host/"
                    "--no-http say otherwise). Without --endpoint it becomes this user's "
                    "default server, which clients find by themselves, unless another "
                    "server already is.",
    )
    add_settings(serve, EngineConfig, only=("endpoint",))
    serve.add_argument("--endpoint-file", default=None, metavar="PATH",
                       help="once ready, write the endpoint (one line) to this file, for scripts")
    serve.add_argument("--parent-pid", type=number(int, ge=1), default=None, metavar="PID",
                       help="stop (as on SIGTERM) once process PID has exited; the SDK passes "
                            "its own pid, so an engine it started never outlives it")
    engine = add_engine_arguments(serve)
    from radixlm.runtime.http.main import add_http_arguments

    add_http_arguments(serve, serve=True, skip=engine)  # --insecure, --drain-timeout: shared
    from radixlm.runtime.router.cli import add_replicas_argument, add_router_arguments

    add_replicas_argument(serve)
    serve.set_defaults(run=cmd_serve)

    router = command(
        "router", help="one endpoint in front of running radixlm servers (replicas)",
        description="Serve the radixlm protocol in front of N radixlm servers, local or "
                    "remote: a session's messages go to the replica holding it, new work to "
                    "the longest estimated cached prefix balanced by load; a dead replica's "
                    "sessions are rebuilt elsewhere (docs/deployment.md).",
    )
    add_router_arguments(router)
    router.set_defaults(run=cmd_router)

    keys = command(
        "keys", help="make CurveZMQ keys for 'serve --auth-dir DIR'",
        description="Make the server's CurveZMQ key pair in DIR (unless it has one) and a key "
                    "pair per --client, each authorized at once. Give clients DIR/server.key "
                    "and their own DIR/clients/NAME.key_secret.",
    )
    keys.add_argument("dir", help="the auth directory (made 0700 if missing)")
    keys.add_argument("--client", action="append", default=[], metavar="NAME",
                      help="make and authorize a client key pair (repeatable; default: one "
                           "named 'client' when the directory has none)")
    keys.set_defaults(run=cmd_keys)

    gen = command(
        "generate", help="one-shot generation from the shell (streams the text to stdout)",
        description="Generate from a prompt, as a user message through the model's chat "
                    "template (--raw: a plain completion of the text). It uses the running "
                    "server named by --endpoint or $RADIXLM_ENDPOINT, else the default "
                    "server; with --model, or when no server runs, it starts one for this "
                    "request and stops it afterwards.",
    )
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--endpoint", default=None,
                     help="use the running server at this endpoint (default: "
                          "$RADIXLM_ENDPOINT, else the default server if one runs)")
    add_key_arguments(gen)
    gen.add_argument("--max-tokens", type=number(int, ge=0), default=128,
                     help="most tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=number(float, ge=0), default=0.0,
                     help="sampling temperature; 0 = greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="nucleus sampling mass in (0, 1] (default: %(default)s)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop string (repeatable); it is not printed")
    gen.add_argument("--system", default=None, metavar="TEXT",
                     help="a system message before the prompt (not with --raw)")
    gen.add_argument("--raw", action="store_true",
                     help="complete the prompt text as it is, without the chat template")
    gen.add_argument("--chat", action="store_true",
                     help="use the chat template (the default; a model without one gets the "
                          "plain text)")
    add_engine_arguments(gen, serve=False, log_level="warning", model_default=None)
    gen.set_defaults(run=cmd_generate)

    sessions = command(
        "sessions", help="list live sessions of a running server",
        description="List live sessions: id prefix, length, idle time, retention.",
    )
    _add_client_arguments(sessions)
    sessions.set_defaults(run=cmd_sessions)

    top = command(
        "top", help="a live view of a running server (sessions, load, throughput, cache)",
        description="Show a running server's sessions, running and waiting requests, "
                    "tokens/s, cache hit rate and KV pool, refreshed in place.",
    )
    _add_client_arguments(top)
    top.add_argument("--interval", type=number(float, gt=0), default=1.0, metavar="SECONDS",
                     help="refresh period; rates are measured over it (default: %(default)s)")
    top.add_argument("--once", action="store_true",
                     help="print one snapshot (rates over one --interval) and exit")
    top.set_defaults(run=cmd_top)

    schema = command(
        "protocol-schema", help="print the JSON Schema of every wire message",
        description="Print the JSON Schema (draft 2020-12) of every client and server message "
                    "(deterministic; docs/protocol.schema.json is this output).",
    )
    schema.set_defaults(run=cmd_protocol_schema)

    chat = command(
        "chat", help=f"interactive chat (the SDK's REPL, {REPL_MODULE}; only when installed)",
        description=f"Interactive chat, provided by the SDK's {REPL_MODULE}. Arguments after "
                    "'chat' are passed to it (try 'radixlm chat --help').",
        add_help=False,
    )
    chat.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the REPL")
    return parser


def _add_client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default=None,
                   help="the server's client endpoint (default: $RADIXLM_ENDPOINT, else the "
                        "default server)")
    add_key_arguments(p)
    p.add_argument("--timeout", type=number(float, gt=0), default=10.0, metavar="SECONDS",
                   help="how long to wait for the server's answers (default: %(default)s)")
    add_debug_argument(p)


# -- commands --------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas != 1:
        from radixlm.runtime.router.cli import serve_replicas

        return serve_replicas(args, with_state(config_from_args(args), args))
    from radixlm.runtime.cli.serve import run_serve

    return run_serve(args, with_state(config_from_args(args), args))


def cmd_router(args: argparse.Namespace) -> int:
    from radixlm.runtime.router.cli import cmd_router as run

    return run(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from radixlm.runtime.cli.generate import run_generate

    return run_generate(args, config_from_args(args, endpoint=""))  # its --endpoint: a server to use


def cmd_keys(args: argparse.Namespace) -> int:
    from radixlm.runtime.transport.curve_keys import AUTHORIZED, AuthDirError, create_keys

    directory = Path(args.dir)
    clients = args.client
    if not clients and not any((directory / AUTHORIZED).glob("*.key")):
        clients = ["client"]
    try:
        made = create_keys(directory, clients)
    except (AuthDirError, OSError) as e:
        print(f"radixlm keys: {e}", file=sys.stderr)
        return 1
    print(f"server public key: {directory / 'server.key'} (give it to clients)")
    for secret in made:
        print(f"client key: {secret} (give it to that client only; authorized)")
    print(f"serve with: radixlm serve --auth-dir {directory} --endpoint tcp://HOST:PORT")
    return 0


def _client_of(args: argparse.Namespace, command: str) -> tuple[str, dict[int, Any]] | int:
    """The running server's endpoint (--endpoint, $RADIXLM_ENDPOINT or the default server)
    and the key options for it; else the exit code, after saying why (2: bad key flags,
    1: no server)."""
    from radixlm.runtime.cli.common import find_server, key_options
    from radixlm.runtime.transport.probe import NoServerError

    options = key_options(args, command)
    if options is None:
        return 2
    try:
        return find_server(args.endpoint), options
    except NoServerError as e:
        say(command, e.message)
        return 1


def _with_server(args: argparse.Namespace, command: str,
                 run: Callable[[str, dict[int, Any]], int]) -> int:
    """``run(endpoint, key options)`` against the server `command` talks to; one line
    and exit 1 for a server that fails to answer."""
    from radixlm.runtime.transport.endpoints import EndpointError
    from radixlm.runtime.transport.errors import EngineError

    found = _client_of(args, command)
    if isinstance(found, int):
        return found
    try:
        return run(*found)
    except EngineError as e:
        say(command, f"{e.code}: {e.message}")
        return 1
    except (EndpointError, TimeoutError) as e:
        say(command, str(e))
        return 1


def cmd_sessions(args: argparse.Namespace) -> int:
    from radixlm.runtime.protocol import ListSessions, SessionList
    from radixlm.runtime.transport.raw_client import RawClient

    def run(endpoint: str, options: dict[int, Any]) -> int:
        # Sessions belong to the client that opened them: ask for the operator's view
        # ("all"), in which other clients' ids come back as prefixes that open nothing.
        with RawClient(endpoint, name="radixlm-cli", timeout_s=args.timeout,
                       options=options) as client:
            reply = client.call(ListSessions(rid="sessions", all=True), SessionList)
        print(format_sessions(reply))
        return 0

    return _with_server(args, "sessions", run)


def cmd_top(args: argparse.Namespace) -> int:
    from radixlm.runtime.cli.top import run_top

    return _with_server(args, "top", lambda endpoint, options: run_top(
        endpoint, options=options, timeout_s=args.timeout, interval_s=args.interval,
        once=args.once))


def format_sessions(reply: Any) -> str:
    from radixlm.runtime.cli.top import session_table

    return "\n".join(session_table(reply.sessions))


def cmd_protocol_schema(args: argparse.Namespace) -> int:
    from radixlm.runtime.protocol_schema import protocol_schema_json

    sys.stdout.write(protocol_schema_json())
    return 0


def cmd_chat(argv: list[str]) -> int:
    # The CLI lives in the runtime and never imports the SDK unless asked for its REPL.
    if importlib.util.find_spec(REPL_MODULE) is None:
        print(f"radixlm chat: this install has no {REPL_MODULE} (the SDK's REPL)", file=sys.stderr)
        return 2
    repl = importlib.import_module(REPL_MODULE)
    return int(repl.main(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["chat"]:  # everything after it, --help included, belongs to the REPL
        return cmd_chat(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line, unless asked for the traceback
        if getattr(args, "debug", False):
            raise
        print(f"radixlm {args.command}: {type(e).__name__}: {e} (run with --debug for the "
              "traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
