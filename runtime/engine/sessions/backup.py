"""The host tier's glue to sessions: back up evicted history, restore it for a turn.

Subscribed to the cache's evictions: an evicted node on a session's cached history (a
demoted one, or the unlocked tail of a capped one) is copied to the `HostTier` first
(host_tier.py: keyed by namespace + exact prefix + tokens, so forks share it). A turn of
such a session gets its device match extended by what the tier kept (`restore`); a
segment no session's history runs through any more is dropped (`prune`).
"""

from __future__ import annotations

import logging

import numpy as np
from radixlm.cache import EvictedSegment, OutOfSlots, PrefixCache
from radixlm.cache.pages import align_down
from radixlm.runtime.engine.sessions.host_tier import HostTier
from radixlm.runtime.engine.sessions.records import Records, Session
from radixlm.runtime.engine.sessions.retention import common_prefix_len

log = logging.getLogger(__name__)


class HostBackup:
    """The sessions' use of one `HostTier`."""

    def __init__(self, records: Records, cache: PrefixCache, tier: HostTier) -> None:
        self.records = records
        self.cache = cache
        self.tier = tier
        cache.subscribe_evict(self.on_evict)

    def on_evict(self, seg: EvictedSegment) -> None:
        """Back up the part of an evicted node that lies on a session's cached history."""
        p, page = seg.prefix_len, self.cache.page_size
        want = 0
        for s in self.records.sessions.values():
            # Only unlocked history can be evicted: skip fully held sessions at once.
            if s.kv_len == s.held_len or s.namespace != seg.namespace or s.kv_len - p < page:
                continue
            h = s.wanted
            if np.array_equal(h[:p], seg.prefix_tokens):
                want = max(want, common_prefix_len(seg.tokens, h[p:]))
        want = align_down(want, page)
        if want:
            self.tier.save(seg.namespace, seg.prefix_tokens, seg.tokens[:want], seg.slots[:want])

    def restore(self, s: Session, cached_len: int) -> np.ndarray | None:
        """Copy back the history the tier kept after `cached_len` (the prompt's device
        match, already locked by the caller): the device slots now holding the K/V of
        `history[cached_len : cached_len + len(slots)]`, or None (nothing kept, or the
        pool cannot hold the restore: those tokens are recomputed)."""
        if cached_len >= s.kv_len:
            return None
        tier = self.tier
        runs = tier.find(s.namespace, s.wanted, cached_len)
        total = sum(r.n_tokens for r in runs)
        if total == 0:
            return None
        tier.reserve(runs, True)
        try:
            slots = self.cache.alloc(total)
        except OutOfSlots:
            tier.reserve(runs, False)
            log.info("session %s: no room to restore %d tokens, recomputing", s.id[:8], total)
            return None
        tier.load(runs, slots)
        log.debug("session %s: restored %d tokens from host memory", s.id[:8], total)
        return slots

    def prune(self) -> None:
        """Drop the segments no session's cached history runs through."""
        if self.tier.num_segments:
            self.tier.prune([(s.namespace, s.wanted) for s in self.records.sessions.values()])
