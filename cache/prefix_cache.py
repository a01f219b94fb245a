"""PrefixCache: the radix tree and the page allocator behind one facade.

This is what the scheduler drives through the seed's §4.2 lifecycle: match → lock →
alloc (only the uncached suffix; evicting unlocked leaves first when short) → insert
(free the duplicates it reports) → unlock → free what never joined the tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np
from radixlm.cache.allocator import PageAllocator
from radixlm.cache.errors import OutOfSlots
from radixlm.cache.node import TreeNode
from radixlm.cache.policy import EvictionPolicy
from radixlm.cache.radix import OnEvict, RadixCache, Tokens
from radixlm.cache.results import CacheSizes, InsertResult, MatchResult
from radixlm.cache.tokens import EMPTY


class PrefixCache:
    def __init__(
        self,
        capacity_tokens: int,
        page_size: int = 1,
        policy: str | EvictionPolicy = "lru",
        clock: Callable[[], float] = time.monotonic,
        on_evict: OnEvict | None = None,
    ) -> None:
        self.allocator = PageAllocator(capacity_tokens, page_size)
        self.tree = RadixCache(page_size, policy, clock)
        self.capacity = self.allocator.capacity
        self.page_size = self.allocator.page_size
        self.on_evict = on_evict  # host-tier hook, called for every evicted node
        # Hot path: bind the tree's methods directly (shadowing the documented
        # delegates below) so each lifecycle step costs one call, not two.
        self.match = self.tree.match  # type: ignore[method-assign]
        self.insert = self.tree.insert  # type: ignore[method-assign]
        self.lock = self.tree.lock  # type: ignore[method-assign]
        self.unlock = self.tree.unlock  # type: ignore[method-assign]
        self.free = self.allocator.free  # type: ignore[method-assign]

    # Tree operations, delegated (see RadixCache for the contracts).
    def match(self, tokens: Tokens, namespace: Hashable = None) -> MatchResult:
        return self.tree.match(tokens, namespace)

    def insert(
        self,
        tokens: Tokens,
        slots: np.ndarray | Sequence[int],
        namespace: Hashable = None,
        priority: int = 0,
    ) -> InsertResult:
        return self.tree.insert(tokens, slots, namespace, priority)

    def lock(self, node: TreeNode) -> None:
        self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.unlock(node)

    def set_priority(self, node: TreeNode, priority: int) -> None:
        self.tree.set_priority(node, priority)

    def path_slots(self, node: TreeNode, start: int = 0, end: int | None = None) -> np.ndarray:
        return self.tree.path_slots(node, start, end)

    # Slots.
    def alloc(self, n_tokens: int) -> np.ndarray:
        """Slots for `n_tokens` new tokens (whole pages: ceil(n/P)*P slots).

        When too few pages are free, unlocked leaves are evicted (policy order) first.
        Raises OutOfSlots when even evicting everything evictable is not enough; the cache
        is left consistent (whatever was evicted stays free).
        """
        allocator = self.allocator
        short = -(-n_tokens // self.page_size) - allocator.free_pages
        if short > 0:
            self.evict(short * self.page_size)
            if allocator.free_pages * self.page_size < n_tokens:
                raise OutOfSlots(
                    n_tokens,
                    allocator.free_size,
                    self.tree.evictable_size,
                    self.tree.protected_size,
                    self.capacity,
                )
        return allocator.alloc(n_tokens)

    def free(self, slots: np.ndarray | Sequence[int]) -> None:
        """Return slots that are not in the tree (a request's private or duplicate ones)."""
        self.allocator.free(slots)

    def evict(self, n_tokens: int) -> int:
        """Evict at least `n_tokens` tokens (if that many are evictable) into the free list;
        returns how many were freed."""
        try:
            freed = self.tree.evict(n_tokens, self.on_evict)
        except BaseException as e:  # the hook failed: still free what left the tree
            self.allocator.free_trusted(getattr(e, "evicted_slots", EMPTY))
            raise
        self.allocator.free_trusted(freed)
        return len(freed)

    def sizes(self) -> CacheSizes:
        tree = self.tree
        return CacheSizes(
            self.capacity, self.allocator.free_size, tree.evictable_size, tree.protected_size
        )

    def reset(self) -> None:
        """Empty tree, every slot free. Only valid with no request running."""
        self.tree.reset()
        self.allocator.reset()

    def check_integrity(self, private: int = 0) -> None:
        """Tree and allocator checks, then free + evictable + protected + private ==
        capacity, and no cached slot is on the free list. `private` is the number of
        slots running requests hold outside the tree."""
        self.tree.check_integrity()
        self.allocator.check_integrity()
        s = self.sizes()
        if s.free + s.evictable + s.protected + private != s.capacity:
            raise AssertionError(
                f"PrefixCache integrity: free {s.free} + evictable {s.evictable} + protected "
                f"{s.protected} + private {private} != capacity {s.capacity}"
            )
        cached = _tree_slots(self.tree)
        if len(cached):
            if cached.min() < 0 or cached.max() >= self.capacity:
                raise AssertionError("PrefixCache integrity: a cached slot is out of range")
            psize = self.page_size
            if self.allocator._is_free[cached // psize].any():
                raise AssertionError("PrefixCache integrity: a cached slot is also free")

    def __repr__(self) -> str:
        s = self.sizes()
        return (
            f"PrefixCache(capacity={s.capacity}, page_size={self.page_size}, free={s.free}, "
            f"evictable={s.evictable}, protected={s.protected})"
        )


def _tree_slots(tree: RadixCache) -> np.ndarray:
    parts = []
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        if node.length:
            parts.append(node.value)
        stack.extend(node.children.values())
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
