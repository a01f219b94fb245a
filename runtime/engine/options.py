"""The scheduler's knobs: one frozen object, derived from `EngineConfig` in one place."""

from __future__ import annotations

from dataclasses import dataclass, replace

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.policy import check_policy


@dataclass(frozen=True)
class SchedulerOptions:
    policy: str = "lpm"
    max_running: int = 64  # requests holding KV (prefilling + decoding)
    chunked_prefill: int = 2048  # prompt tokens computed per step, over all requests
    context_length: int = 4096  # prompt + output cap per sequence
    # In-batch dedup: hold a request while one still prefilling shares at least this many
    # uncached tokens with it (SGLang's threshold), then let it hit the cache.
    dedup_min_tokens: int = 32
    max_matched_waiting: int = 128  # prefix-aware policies fall back to FCFS above this
    # Admission reserves room for running requests' future tokens: remaining max_tokens
    # times this ratio, which decays while nothing is retracted and jumps back after a
    # retraction (SGLang's new_token_ratio).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001  # per step
    reserve_clip: int = 4096  # a request's future tokens counted at most this many
    # While several clients decode, a step takes at most the rows whose measured time stays
    # within this many one-row steps (step_budget.py); 0 = whole batches always.
    fair_step_factor: float = 2.0
    # Preemptible prefill (slicing.py): a prefill chunk of at least this many tokens runs
    # in slices of about this many ms (pieces of one layer over this many rows), other
    # work between them; 0 ms = off. Only where the model allows it (the CPU torch backend).
    prefill_slice_ms: float = 25.0
    prefill_slice_min_tokens: int = 512
    prefill_slice_rows: int = 256
    tick_interval_s: float = 0.1  # SessionManager.tick period while busy
    check_invariants: bool = False  # assert the pool invariant after every step (tests)

    def __post_init__(self) -> None:
        check_policy(self.policy)
        for name in ("max_running", "chunked_prefill", "context_length",
                     "prefill_slice_min_tokens", "prefill_slice_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_slice_ms < 0:
            raise ValueError(f"prefill_slice_ms must be >= 0, got {self.prefill_slice_ms}")
        if not (self.fair_step_factor == 0 or self.fair_step_factor >= 1):
            raise ValueError(f"fair_step_factor must be 0 (off) or >= 1, got {self.fair_step_factor}")

    @classmethod
    def from_config(
        cls, config: EngineConfig, context_length: int, **overrides
    ) -> SchedulerOptions:
        base = cls(
            policy=config.schedule_policy,
            max_running=config.max_running,
            chunked_prefill=config.chunked_prefill,
            context_length=context_length,
            fair_step_factor=config.fair_step_factor,
            prefill_slice_ms=config.prefill_slice_ms,
        )
        return replace(base, **overrides) if overrides else base
