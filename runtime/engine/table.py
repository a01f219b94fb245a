"""What the scheduler holds between steps: its request queues and cumulative counters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from radixlm.runtime.engine.request import Request, RequestGroup
from radixlm.runtime.engine.state import LIVE_WITH_KV, ReqState, advance
from radixlm.runtime.engine.timings import Latencies
from radixlm.runtime.grammar.compiler import CompilingGrammar


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
    latency: Latencies = field(default_factory=Latencies)  # per-request timings


class RequestTable:
    """Every live request, in the queue its state says, and the groups by their key.

    The table is the queues' one owner and `move` the one place requests change state
    and queue together (the managers read the queues, never change them):

    - `compiling`: WAITING, holding nothing, held back: their group's grammar still
      compiling or its history still being read from the disk tier (`add` puts them
      there, `release` moves them to `waiting` once that is done);
    - `waiting`: WAITING, holding nothing; admission order is decided each step by the
      policy (prefill.py), and `move(r, PREFILLING)` admits one;
    - `running`: PREFILLING or DECODING, holding KV, in admission order (the last is the
      newest, the first to retract: `move(r, RETRACTED)` then `move(r, WAITING)`);
    - a terminal state (FINISHED, ABORTED) leaves every queue.
    """

    def __init__(self) -> None:
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._compiling: list[Request] = []
        self._groups: dict[int, RequestGroup] = {}
        self._admitted = False  # `_waiting` still lists requests admitted since

    # ----------------------------------------------------------------- views
    @property
    def running(self) -> Sequence[Request]:
        return self._running

    @property
    def waiting(self) -> Sequence[Request]:
        if self._admitted:  # (admissions leave the list once, not one scan each)
            self._waiting = [r for r in self._waiting if r.state is ReqState.WAITING]
            self._admitted = False
        return self._waiting

    @property
    def compiling(self) -> Sequence[Request]:
        return self._compiling

    @property
    def groups(self) -> Mapping[int, RequestGroup]:
        return self._groups

    def private_tokens(self) -> int:
        """Slots running requests hold outside the tree."""
        return sum(r.private for r in self._running)

    # ----------------------------------------------------------------- moves
    def add(self, g: RequestGroup, held: bool = False) -> None:
        """A new group: its branches wait (for their grammar first, if it compiles, or
        whatever else holds them back: `held`)."""
        self._groups[g.key] = g
        queue = self._compiling if held or isinstance(g.grammar, CompilingGrammar) else self._waiting
        queue.extend(g.branches)

    def release(self, g: RequestGroup) -> None:
        """`g`'s grammar compiled (its history read): its branches join the waiting queue."""
        for b in g.branches:
            if b in self._compiling:
                self._compiling.remove(b)
                self._waiting.append(b)

    def move(self, r: Request, new: ReqState) -> None:
        """Change `r`'s state (`state.advance`: illegal transitions raise) and its queue
        with it."""
        old = r.state
        advance(r, new)
        if new is ReqState.PREFILLING and old is ReqState.WAITING:
            self._running.append(r)
            self._admitted = True
        elif new is ReqState.WAITING:  # a retracted request resumes later
            self._waiting.append(r)
        elif new in (ReqState.RETRACTED, ReqState.FINISHED, ReqState.ABORTED):
            if old in LIVE_WITH_KV:
                self._running.remove(r)
            elif old is ReqState.WAITING:
                # `_waiting` itself: the `waiting` view, after an admission, first drops
                # requests no longer WAITING, this one included now (a waiting request
                # aborted in the step that admitted another failed INTERNAL, "list.remove").
                (self._compiling if r in self._compiling else self._waiting).remove(r)

    def drop_group(self, g: RequestGroup) -> None:
        """Every branch of `g` is terminal: forget it."""
        self._groups.pop(g.key, None)
