"""Host-memory KV tier: evicted pieces of demoted sessions' histories, kept in RAM.

When the tree evicts a node that lies on a demoted session's history, the session
manager copies that node's K/V from the device pool into a `HostKVPool` first
(`save`). The segment is keyed by content — namespace, the exact tokens above it, its
own tokens — so any session whose history runs through it (the demoted one, or a fork
of it) can have it copied back instead of recomputed (`find` + `load`). The tier is
bounded: when full, the least recently used segments are dropped (the deepest pieces
of a history are evicted first and so are also the oldest here, which keeps what
remains a usable chain from the cached prefix down).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np
from radixlm.cache import HostKVPool, KVPool, PageAllocator
from radixlm.cache.pages import align_down
from radixlm.runtime.engine.sessions.retention import common_prefix_len

log = logging.getLogger(__name__)


def _prefix_key(namespace: Hashable, prefix: np.ndarray) -> tuple[Hashable, int, bytes]:
    # A 128-bit digest of the exact tokens above a segment: collisions are negligible,
    # and the segment's own tokens are compared exactly on lookup.
    digest = hashlib.blake2b(prefix.tobytes(), digest_size=16).digest()
    return namespace, len(prefix), digest


@dataclass(eq=False)
class HostSegment:
    """A run of page-aligned tokens whose K/V sits in the host pool at `host_slots`."""

    key: tuple[Hashable, int, bytes]  # (namespace, prefix_len, digest of the prefix)
    tokens: np.ndarray
    host_slots: np.ndarray
    in_use: bool = field(default=False)  # being restored: not dropped to make room

    @property
    def prefix_len(self) -> int:
        return self.key[1]


@dataclass(frozen=True)
class HostRun:
    """Part of a host segment a restore uses: its first `n_tokens` tokens."""

    segment: HostSegment
    n_tokens: int


class HostTier:
    """A bounded LRU store of KV segments in host memory, keyed by their token path."""

    def __init__(self, device_pool: KVPool, capacity_tokens: int,
                 on_evict: Callable[[HostSegment], None] | None = None) -> None:
        page = device_pool.page_size
        capacity = align_down(capacity_tokens, page)
        if capacity <= 0:
            raise ValueError(
                f"host_kv_tokens ({capacity_tokens}) must hold at least one page of {page}"
            )
        self.device_pool = device_pool
        self.page_size = page
        self.pool = HostKVPool.like(device_pool, capacity)
        self.allocator = PageAllocator(capacity, page)
        self.capacity = capacity
        self.on_evict = on_evict  # told of a segment dropped for room (the disk tier)
        self._lru: OrderedDict[int, HostSegment] = OrderedDict()  # oldest first
        self._by_prefix: dict[tuple[Hashable, int, bytes], list[HostSegment]] = {}

    @property
    def used(self) -> int:
        """Tokens held in host memory."""
        return self.capacity - self.allocator.free_size

    @property
    def num_segments(self) -> int:
        return len(self._lru)

    # ---------------------------------------------------------------- save
    def save(
        self,
        namespace: Hashable,
        prefix: np.ndarray,
        tokens: np.ndarray,
        device_slots: np.ndarray,
    ) -> bool:
        """Copy the K/V of `tokens` (at `device_slots`, below `prefix`) to host memory.

        Returns False when it cannot fit even after dropping every idle segment.
        """
        n = len(tokens)
        if n == 0 or n % self.page_size:
            return False
        key = _prefix_key(namespace, prefix)
        for seg in self._by_prefix.get(key, ()):
            if len(seg.tokens) >= n and np.array_equal(seg.tokens[:n], tokens):
                self._lru.move_to_end(id(seg))  # already here (saved before)
                return True
        if not self._make_room(n):
            return False
        host_slots = self.allocator.alloc(n)
        # A private copy: tree slot arrays are read-only, which torch warns about.
        self.pool.copy_from_device(self.device_pool, np.array(device_slots), host_slots)
        seg = HostSegment(key, tokens.copy(), host_slots)
        self._lru[id(seg)] = seg
        self._by_prefix.setdefault(key, []).append(seg)
        return True

    def _make_room(self, n: int) -> bool:
        if n > self.capacity:
            return False
        while self.allocator.free_size < n:
            victim = next((s for s in self._lru.values() if not s.in_use), None)
            if victim is None:
                return False
            if self.on_evict is not None:
                self.on_evict(victim)
            self._drop(victim)
        return True

    # ------------------------------------------------------------- restore
    def find(self, namespace: Hashable, history: np.ndarray, start: int) -> list[HostRun]:
        """The chain of segments continuing `history[:start]` along `history`.

        Each step takes the segment under the exact prefix `history[:pos]` that shares
        the most (page-aligned) tokens with `history[pos:]`.
        """
        runs: list[HostRun] = []
        pos = start
        page = self.page_size
        while pos < len(history):
            best: HostSegment | None = None
            best_n = 0
            for seg in self._by_prefix.get(_prefix_key(namespace, history[:pos]), ()):
                n = common_prefix_len(seg.tokens, history[pos:])
                n = align_down(n, page)
                if n > best_n:
                    best, best_n = seg, n
            if best is None:
                break
            runs.append(HostRun(best, best_n))
            pos += best_n
        return runs

    def reserve(self, runs: list[HostRun], in_use: bool) -> None:
        """Mark (or unmark) segments a restore is about to read, so that saves made by the
        evictions of its own device allocation cannot drop them."""
        for run in runs:
            run.segment.in_use = in_use

    def load(self, runs: list[HostRun], device_slots: np.ndarray) -> None:
        """Copy the runs' K/V into `device_slots` (in order), then free those segments:
        the device has them again, and an eviction would save them anew."""
        host = np.concatenate([r.segment.host_slots[: r.n_tokens] for r in runs])
        self.pool.copy_to_device(self.device_pool, host, device_slots)
        for run in runs:
            run.segment.in_use = False
            self._drop(run.segment)

    # ---------------------------------------------------------------- drop
    def prune(self, histories: list[tuple[Hashable, np.ndarray]]) -> int:
        """Drop the segments that none of `histories` (namespace, tokens) runs through:
        nobody could restore them any more. Returns tokens freed."""
        freed = 0
        for seg in list(self._lru.values()):
            if not seg.in_use and not any(self._on_path(seg, ns, h) for ns, h in histories):
                freed += len(seg.tokens)
                self._drop(seg)
        return freed

    def runs_through(self, seg: HostSegment, namespace: Hashable, history: np.ndarray) -> bool:
        """Whether `history` (in `namespace`) runs through `seg`."""
        return self._on_path(seg, namespace, history)

    def _on_path(self, seg: HostSegment, namespace: Hashable, history: np.ndarray) -> bool:
        p = seg.prefix_len
        if len(history) - p < self.page_size or seg.key[0] != namespace:
            return False
        if common_prefix_len(seg.tokens, history[p:]) < self.page_size:
            return False
        return _prefix_key(namespace, history[:p]) == seg.key

    def clear(self) -> None:
        for seg in list(self._lru.values()):
            self._drop(seg)

    def _drop(self, seg: HostSegment) -> None:
        del self._lru[id(seg)]
        bucket = self._by_prefix[seg.key]
        bucket.remove(seg)
        if not bucket:
            del self._by_prefix[seg.key]
        self.allocator.free(seg.host_slots)

    def __repr__(self) -> str:
        return f"HostTier(capacity={self.capacity}, used={self.used}, segments={len(self._lru)})"
