"""Eviction policies: each maps a leaf to a sort key; the smallest key is evicted first.

Keys are plain ints where possible (cheaper to compare in the heap than tuples): the
access tick is < 2**48, so `(major << 48) + tick` orders by `major`, then by recency.
A policy's key for a node may only grow as the node is used (touches raise the tick and
hit count); the tree re-checks keys lazily when it pops a leaf. Lowering a key (e.g.
`set_priority` to a smaller value) is handled by the tree pushing a fresh entry.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from radixlm.cache.node import TreeNode

TICK_BITS = 48


@runtime_checkable
class EvictionPolicy(Protocol):
    name: str

    def key(self, node: TreeNode) -> Any:
        """Sort key of an evictable leaf; smaller is evicted first."""
        ...


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    @staticmethod
    def key(node: TreeNode) -> int:
        return node.access_tick


class LFUPolicy:
    """Fewest matches first; least recently used among equals."""

    name = "lfu"

    @staticmethod
    def key(node: TreeNode) -> int:
        return (node.hit_count << TICK_BITS) + node.access_tick


class PriorityPolicy:
    """Lowest priority first (higher priority is kept longer); LRU among equals."""

    name = "priority"

    @staticmethod
    def key(node: TreeNode) -> int:
        return (node.priority << TICK_BITS) + node.access_tick


POLICIES: dict[str, type] = {p.name: p for p in (LRUPolicy, LFUPolicy, PriorityPolicy)}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from its name ("lru", "lfu", "priority") or an object."""
    if isinstance(policy, str):
        try:
            return POLICIES[policy.lower()]()
        except KeyError:
            raise ValueError(
                f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}"
            ) from None
    if not callable(getattr(policy, "key", None)):
        raise TypeError(f"eviction policy {policy!r} has no key(node) method")
    return policy
