"""Plain result records returned by the cache (NamedTuples: cheap to build, unpackable)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from radixlm.cache.node import TreeNode


class MatchResult(NamedTuple):
    """Handle from `match`: the node ending the cached prefix, its length, its slots.

    A match is not a reservation: `lock(node)` before relying on `slots`.
    """

    node: TreeNode
    length: int
    slots: np.ndarray  # int64 [length], read-only (copy it to modify)


class InsertResult(NamedTuple):
    """Outcome of `insert`: how many (page-aligned) tokens were already cached, and the
    node that ends the inserted sequence (lock it to keep the sequence)."""

    cached_len: int
    node: TreeNode


class EvictedSegment(NamedTuple):
    """One tree node as it is evicted, handed to `on_evict` before it is removed.

    `tokens`/`slots` are the node's own edge; `prefix_tokens` are the tokens on the path
    above it (length `prefix_len`), so a host tier can re-key the segment.
    """

    namespace: Hashable
    prefix_len: int
    tokens: np.ndarray
    slots: np.ndarray
    prefix_tokens: np.ndarray


class CacheSizes(NamedTuple):
    """Token counts of a `PrefixCache`; `private` is what running requests hold outside the
    tree (capacity - free - evictable - protected)."""

    capacity: int
    free: int
    evictable: int
    protected: int

    @property
    def private(self) -> int:
        return self.capacity - self.free - self.evictable - self.protected
