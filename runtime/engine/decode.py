"""Decode scheduling: every running decode gets the slot of its next token this step
(while several clients decode, those the step budget takes: step_budget.py).

Its last page while it has room, else a new page, all allocated in one call. When the
pool cannot give them even after eviction and demoting idle sessions, the newest running
request is *retracted*: what it has computed goes into the tree as cache, its private
slots are freed and it requeues with its output kept, so resuming mostly hits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from radixlm.runtime.engine.batch import Scheduled
from radixlm.runtime.engine.cache_manager import CacheManager
from radixlm.runtime.engine.lifecycle import Endings
from radixlm.runtime.engine.state import ReqState
from radixlm.runtime.engine.step_budget import StepBudget
from radixlm.runtime.engine.table import RequestTable

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DecodeManager:
    """Slots for the running decodes' next tokens, retracting under pressure."""

    table: RequestTable
    kv: CacheManager
    endings: Endings
    budget: StepBudget

    def schedule(self, plan: list[Scheduled]) -> None:
        """Add the running decodes (all of them, or while several clients decode the rows
        the step budget allows) to `plan` with the slot of their next token."""
        running = self.table.running
        decoding = self.budget.select([r for r in running if r.state is ReqState.DECODING],
                                      [*running, *self.table.waiting])
        if not decoding:
            return
        kv = self.kv
        while True:
            needy = [r for r in decoding if r.num_tokens > r.alloc_len]
            need = kv.decode_need(needy)
            if need <= kv.available() or need <= kv.make_room(need):
                break
            victim = running[-1]
            if len(running) == 1:
                # Alone and still no room: pins and hard sessions hold the rest of the pool.
                log.warning("request %s stopped at %d tokens: the KV pool is full of "
                            "retained sessions/pins", victim.group.rid, len(victim.output))
                if victim.pending_end is not None:
                    self.endings.end_pending(victim)
                else:
                    self.endings.end(victim, ReqState.FINISHED, "length")
            else:
                self.endings.retract(victim)
            if victim in decoding:
                decoding.remove(victim)
        kv.grow_decodes(needy, need)
        for r in decoding:
            ext = r.num_tokens - r.kv_len
            # A tail row (pending_end) only computes its token's KV: no logits for it.
            plan.append(Scheduled(r, ext, ext if r.pending_end is not None else ext - 1))
