"""Preemptible prefill: a long prompt chunk runs in time slices, and other work runs
between them. (On CPU one 2,048-token chunk is one forward of seconds; a newcomer's first
token used to wait for it.)

When a step's plan holds a prefill chunk of at least `prefill_slice_min_tokens` tokens
(under the program policy, 32 at most: prefill.py) and the model allows it
(`ModelRunner.sliceable`: the CPU torch backend; never under tensor parallelism, whose
workers replay whole steps, nor FlashInfer/CUDA; decodes and the fused batch-1 decode
path are never sliced), that chunk leaves the plan and becomes
*the slice*: a `SlicedPrefill` (model/sliced.py) advanced about `prefill_slice_ms` at a
time. The scheduler then alternates a step for everything else (the sliced request is
scheduled by nobody meanwhile) and one slice (under the program policy, while a program
ranked above the slice's own decodes, only its steps); with nothing else to do, slice
after slice. Between steps the serving loop takes new messages, so a newcomer is admitted
after at most one slice. When the chunk's last piece is done its logits go through the
normal outputs path (the chunk is inserted; sampling only after the prompt's last chunk).

The cache lifecycle is untouched: the chunk's slots were allocated when it was
scheduled, and `kv_len` advances only once it completes, so an abort, failure or
retraction mid-slice caches what the earlier chunks computed and frees this chunk's
slots, as for any request. `Request.slicing` marks the sliced request; lifecycle.Endings
clears it whenever a request leaves the running set, and the slice is then dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from radixlm.runtime.engine.batch import Scheduled
from radixlm.runtime.engine.options import SchedulerOptions
from radixlm.runtime.engine.state import ReqState

PROGRAM_SLICE_MIN_TOKENS = 32


@dataclass(eq=False)
class Slice:
    entry: Scheduled  # the chunk, as it was planned
    task: Any  # model.sliced.SlicedPrefill


class Slicer:
    """The scheduler's one slice in progress, and whose turn the next step is."""

    def __init__(self, model: object, opt: SchedulerOptions) -> None:
        self.opt = opt
        self.model = model
        self.enabled = opt.prefill_slice_ms > 0 and bool(getattr(model, "sliceable", False))
        # Under the program policy a prompt chunk of any length but the shortest runs in
        # slices, so that it never holds a decode step of a program ranked above its own.
        self.min_tokens = opt.prefill_slice_min_tokens if opt.policy != "program" else \
            min(opt.prefill_slice_min_tokens, PROGRAM_SLICE_MIN_TOKENS)
        self.current: Slice | None = None
        self.slice_next = False  # the next step advances the slice (others ran last)
        self.slices = 0  # slices run (stats, tests)

    @property
    def budget_s(self) -> float:
        return self.opt.prefill_slice_ms / 1000

    def check(self) -> None:
        """Drop the slice if its request left the running set (abort, failure,
        retraction: Endings cleared its mark)."""
        cur = self.current
        if cur is not None and not (cur.entry.req.slicing
                                    and cur.entry.req.state is ReqState.PREFILLING):
            self.current = None
            self.slice_next = False

    def due(self) -> bool:
        return self.current is not None and self.slice_next

    def take(self, plan: list[Scheduled]) -> None:
        """With no slice in progress, move the first long prefill chunk of `plan` out of
        it into a new slice."""
        if not self.enabled or self.current is not None:
            return
        for i, s in enumerate(plan):
            r = s.req
            if r.state is ReqState.PREFILLING and s.extend >= self.min_tokens:
                task = self.model.start_sliced(  # type: ignore[attr-defined]
                    r.tokens, r.slots, r.kv_len, s.extend, s.logits_from,
                    self.opt.prefill_slice_rows,
                )  # fmt: skip
                del plan[i]
                r.slicing = True
                self.current = Slice(s, task)
                self.slice_next = False
                return

    def advance(self) -> tuple[Scheduled, torch.Tensor] | None:
        """Run one slice; the chunk's plan entry and logits once it is complete (the
        slice is then over), else None."""
        cur = self.current
        assert cur is not None
        self.slices += 1
        self.slice_next = False
        logits = cur.task.advance(self.budget_s)
        if logits is None:
            return None
        cur.entry.req.slicing = False
        self.current = None
        return cur.entry, logits
