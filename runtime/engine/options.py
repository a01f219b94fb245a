"""The scheduler's knobs: one frozen object, derived from `EngineConfig` in one place.

The knobs a user sets are `EngineConfig`'s settings (`SETTINGS` names them): their
defaults and rules are those declared there (runtime/config.py), read here, never
written again. The others are the scheduler's own tuning, set only by tests and
benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, replace

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.settings import settings_of

# Scheduler option -> the EngineConfig setting it is.
SETTINGS = {"policy": "schedule_policy", "max_running": "max_running",
            "chunked_prefill": "chunked_prefill", "fair_step_factor": "fair_step_factor",
            "prefill_slice_ms": "prefill_slice_ms", "program_quantum": "program_quantum",
            "program_starve_s": "program_starve_s"}
_DECLARED = {s.name: s for s in settings_of(EngineConfig)}
_DEFAULT = EngineConfig()


@dataclass(frozen=True)
class SchedulerOptions:
    policy: str = _DEFAULT.schedule_policy
    max_running: int = _DEFAULT.max_running  # requests holding KV (prefilling + decoding)
    chunked_prefill: int = _DEFAULT.chunked_prefill  # prompt tokens per step, all requests
    program_quantum: int = _DEFAULT.program_quantum  # the program policy's (policy.Programs)
    program_starve_s: float = _DEFAULT.program_starve_s
    context_length: int = 4096  # prompt + output cap per sequence (context_length_for)
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
    fair_step_factor: float = _DEFAULT.fair_step_factor
    # Preemptible prefill (slicing.py): a prefill chunk of at least this many tokens runs
    # in slices of about this many ms (pieces of one layer over this many rows), other
    # work between them; 0 ms = off. Only where the model allows it (the CPU torch backend).
    prefill_slice_ms: float = _DEFAULT.prefill_slice_ms
    prefill_slice_min_tokens: int = 512
    prefill_slice_rows: int = 256
    tick_interval_s: float = 0.1  # SessionManager.tick period while busy
    check_invariants: bool = False  # assert the pool invariant after every step (tests)

    def __post_init__(self) -> None:
        for mine, name in SETTINGS.items():  # the rules declared for them
            problem = _DECLARED[name].problem(getattr(self, mine))
            if problem is not None:
                raise ValueError(f"{mine} {problem}")
        for name in ("context_length", "prefill_slice_min_tokens", "prefill_slice_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_config(
        cls, config: EngineConfig, context_length: int, **overrides
    ) -> SchedulerOptions:
        base = cls(context_length=context_length,
                   **{mine: getattr(config, name) for mine, name in SETTINGS.items()})
        return replace(base, **overrides) if overrides else base
