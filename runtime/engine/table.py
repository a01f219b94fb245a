"""What the scheduler holds between steps: its request queues and cumulative counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.runtime.engine.request import Request, RequestGroup


@dataclass
class Counters:
    """Cumulative figures for stats, logs and benchmarks."""

    steps: int = 0
    forward_s: float = 0.0
    prompt_tokens: int = 0  # full prompts admitted (first admission only)
    cached_tokens: int = 0  # of those, prefix-cache hits
    computed_tokens: int = 0  # prompt tokens actually run through the model (incl. resumes)
    generated_tokens: int = 0
    jumped_tokens: int = 0  # appended by jump-forward, without a decode step each
    retractions: int = 0
    preemptions: int = 0  # of those, for another client's fair share of running slots
    finished: int = 0


@dataclass
class RequestTable:
    """Every live request: `waiting` (no KV; admission order is decided each step by
    the policy), `compiling` (no KV; waiting for a grammar), `running` (holding KV, in admission order: the last is the newest, the
    first to retract) and the groups by their frontend key."""

    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    groups: dict[int, RequestGroup] = field(default_factory=dict)
    # Waiting for their grammar to compile (no KV, not admitted until it is ready).
    compiling: list[Request] = field(default_factory=list)

    def unqueue(self, r: Request) -> None:
        """Take a request without KV out of its queue."""
        (self.compiling if r in self.compiling else self.waiting).remove(r)

    def private_tokens(self) -> int:
        """Slots running requests hold outside the tree."""
        return sum(r.private for r in self.running)
