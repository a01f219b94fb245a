"""PrefixCache: the radix tree and the page allocator behind one facade.

This is what the scheduler drives through the request lifecycle: match → lock → alloc
(only the uncached suffix; evicting unlocked leaves first when short) → insert (free the
duplicates it reports) → unlock → free what never joined the tree.

Callers see the cache only through this facade: sizes (`evictable_size`, `available`,
`sizes()`), an eviction `epoch` (bumped whenever cached nodes may have left the tree,
so a caller can tell whether a match it holds may be stale), and eviction hooks
registered with `subscribe_evict` (the host-memory tier backs evicted history up there).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np
from radixlm.cache.allocator import PageAllocator
from radixlm.cache.errors import OutOfSlots
from radixlm.cache.node import TreeNode
from radixlm.cache.pages import div_ceil
from radixlm.cache.policy import EvictionPolicy
from radixlm.cache.radix import OnEvict, RadixCache, Tokens
from radixlm.cache.results import CacheSizes, EvictedSegment, InsertResult, MatchResult
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
        self.epoch = 0  # bumped by every eviction and reset: older matches may be stale
        self._evict_hooks: list[OnEvict] = []
        self._on_evict: OnEvict | None = None
        if on_evict is not None:
            self.subscribe_evict(on_evict)
        # The tree's operations, bound directly so each lifecycle step costs one call
        # (see RadixCache for their contracts).
        tree = self.tree
        self.match: Callable[[Tokens, Hashable], MatchResult] = tree.match
        self.cached_len: Callable[[Tokens, Hashable], int] = tree.cached_len
        self.insert: Callable[..., InsertResult] = tree.insert
        self.lock: Callable[[TreeNode], None] = tree.lock
        self.unlock: Callable[[TreeNode], None] = tree.unlock
        self.set_priority: Callable[[TreeNode, int], None] = tree.set_priority
        self.path_slots: Callable[..., np.ndarray] = tree.path_slots
        self.free: Callable[[np.ndarray | Sequence[int]], None] = self.allocator.free

    # Eviction hooks.
    def subscribe_evict(self, hook: OnEvict) -> Callable[[], None]:
        """Call `hook` with every node as it is evicted (before it leaves the tree);
        returns the function that unsubscribes it. A hook that raises stops that
        eviction (the node stays cached; what was already evicted is freed)."""
        self._evict_hooks.append(hook)
        self._bind_hooks()
        return lambda: self._unsubscribe(hook)

    def _unsubscribe(self, hook: OnEvict) -> None:
        if hook in self._evict_hooks:
            self._evict_hooks.remove(hook)
            self._bind_hooks()

    def _bind_hooks(self) -> None:
        hooks = tuple(self._evict_hooks)
        if not hooks:
            self._on_evict = None
        elif len(hooks) == 1:
            self._on_evict = hooks[0]
        else:

            def fan_out(seg: EvictedSegment) -> None:
                for hook in hooks:
                    hook(seg)

            self._on_evict = fan_out

    # Sizes.
    @property
    def evictable_size(self) -> int:
        """Cached tokens no one holds: eviction may free them."""
        return self.tree.evictable_size

    def available(self) -> int:
        """Slots an allocation can get now: free plus evictable."""
        return self.allocator.free_size + self.tree.evictable_size

    # Slots.
    def alloc(self, n_tokens: int) -> np.ndarray:
        """Slots for `n_tokens` new tokens (whole pages: ceil(n/P)*P slots).

        When too few pages are free, unlocked leaves are evicted (policy order) first.
        Raises OutOfSlots when even evicting everything evictable is not enough; the cache
        is left consistent (whatever was evicted stays free).
        """
        allocator = self.allocator
        short = div_ceil(n_tokens, self.page_size) - allocator.free_pages
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
        if n_tokens <= 0 or not self.tree.evictable_size:
            return 0
        return self._free_evicted(lambda: self.tree.evict(n_tokens, self._on_evict))

    def flush(self, namespaces: Callable[[Hashable], bool] | None = None) -> int:
        """Evict everything evictable (locked content stays), or only what lies in the
        namespaces `namespaces` accepts; returns tokens freed."""
        if namespaces is None:
            return self.evict(self.tree.evictable_size)
        return self._free_evicted(lambda: self.tree.evict_namespaces(namespaces, self._on_evict))

    def _free_evicted(self, evict: Callable[[], np.ndarray]) -> int:
        """Run one tree eviction and free its slots (also those a failing hook left)."""
        self.epoch += 1
        try:
            freed = evict()
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
        self.epoch += 1
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
            if self.allocator.any_free(cached):
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
