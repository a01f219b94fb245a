"""The engine's configuration: one frozen object, built in one place (the CLI or
`rl.Engine`) and passed explicitly to every process that needs it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything `radixlm serve` can be told. msgspec so it crosses process boundaries."""

    model: str = "default"  # HF directory, GGUF file, or "default" (SmolLM2-135M-Instruct)
    endpoint: str = ""  # client endpoint; "" = ipc:// in a private 0700 runtime dir
    device: str = "auto"  # "auto" (cuda if present), "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (CPU: a GGUF's blocks as stored, else float32; CUDA: bfloat16), "float32", "bfloat16", "float16", or a quantized format (as quantize)
    quantize: str = "none"  # CPU weight-only quantization: "none", "int8", "int4", "gguf"
    attention: str = "auto"  # "auto", "torch", "flashinfer"
    page_size: int = 1
    kv_tokens: int = 0  # KV pool capacity in tokens; 0 = derive from kv_memory_fraction
    kv_memory_fraction: float = 0.5  # of free device memory (CUDA) or of RAM (CPU), capped
    kv_dtype: str = "auto"  # KV pool elements: "auto" (CPU + quantized weights: float16, else the model's dtype), "float16", "bfloat16", "float32"
    schedule_policy: str = "lpm"  # fcfs | lpm | dfs-weight | shortest-prefill-first | program
    max_running: int = 64  # running-request cap
    chunked_prefill: int = 2048  # prefill token budget per step
    context_length: int = 0  # 0 = the model's max_position_embeddings
    allow_long_context: bool = False  # allow context_length beyond the model's positions (warned)
    retained_cap: int = 0  # cap on retained (pinned + session) tokens; 0 = half the pool
    max_retained_per_tenant: int = 0  # a tenant's quota of the cap; 0 = an equal share
    grammar_timeout_s: float = 60.0  # a request's wait for its grammar to compile
    default_session_ttl_s: float = 0.0  # 0 = no idle TTL unless a session asks for one
    host_kv_tokens: int = 0  # host-memory KV tier capacity (tokens); 0 = off
    # The state directory (runtime/state/): "" = none (nothing outlives the processes).
    # `radixlm serve` opens and locks it and passes the path on.
    state_dir: str = ""
    disk_kv_bytes: int = 0  # the disk KV tier's bound; 0 = a tenth of the free space, <= 20 GiB
    durable_session_expiry_s: float = 30 * 86400.0  # a detached durable session idle this long is closed
    threads: int = 0  # torch intra-op threads on CPU; 0 = torch default
    tensor_parallel_size: int = 1  # ranks one model is split over (runtime/distributed/); 1 = off
    omp_wait_policy: str = "passive"  # the engine's OMP_WAIT_POLICY ("passive" | "active" | "" = OpenMP's default); the environment's wins
    log_level: str = "info"
    debug: bool = False  # tracebacks for start-up errors too (`--debug`)
    seed: int = 0
    # Trust boundary of the client endpoint (the frontend enforces these).
    auth_dir: str = ""  # CurveZMQ keys ('radixlm keys'); "" = no authentication
    insecure: bool = False  # allow a public TCP endpoint without auth_dir
    max_message_bytes: int = 4 * 2**20  # largest client frame; libzmq drops the connection
    engine_timeout_s: float = 60.0  # engine silent this long -> in-flight requests fail
    drain_timeout_s: float = 30.0  # SIGTERM: running requests may finish for this long
    max_inflight_per_client: int = 0  # generate requests one client may have in flight; 0 = no cap
    max_priority: int = 0  # a request's priority is clamped to this
    fair_step_factor: float = 2.0  # several clients decoding: a step within this many one-row steps; 0 = off
    prefill_slice_ms: float = 25.0  # a long prefill chunk (CPU torch backend) runs in slices of ~this, other work between; 0 = off


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
