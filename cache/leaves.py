"""The set of evictable leaves, kept incrementally as a heap with lazy invalidation.

Eviction must not scan the tree: every node that becomes an unlocked leaf is pushed
once (`push`), and entries that went stale (the node got locked, gained a child, was
removed or re-pushed) are dropped when they surface. A node's live entry is the one whose
sequence number equals `node.heap_seq`. Keys that grew since the push (the node was
used again) are re-pushed with the fresh key when popped, so touches cost nothing here.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from radixlm.cache.node import TreeNode

_MIN_COMPACT = 1024


class LeafHeap:
    __slots__ = ("_heap", "_seq", "_key", "_limit")

    def __init__(self, key: Callable[[TreeNode], Any]) -> None:
        self._heap: list[tuple[Any, int, TreeNode]] = []
        self._seq = 0
        self._key = key
        self._limit = _MIN_COMPACT

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        """(Re)register `node` as an evictable leaf with its current key."""
        self._seq = seq = self._seq + 1
        node.heap_seq = seq
        heap = self._heap
        heapq.heappush(heap, (self._key(node), seq, node))
        if len(heap) > self._limit:
            self._compact()

    def pop(self) -> TreeNode | None:
        """The evictable leaf with the smallest current key, or None when there is none.

        The node is left in the tree; the caller removes it (it is no longer in the heap).
        """
        heap = self._heap
        key_fn = self._key
        while heap:
            key, seq, node = heapq.heappop(heap)
            if seq != node.heap_seq or node.ref_count or node.children or node.parent is None:
                continue  # stale: the node changed state since this entry was pushed
            cur = key_fn(node)
            if cur != key:  # used since it was pushed: back in line with its new key
                self._seq = seq = self._seq + 1
                node.heap_seq = seq
                heapq.heappush(heap, (cur, seq, node))
                continue
            node.heap_seq = -1
            return node
        return None

    def live_entries(self) -> dict[int, TreeNode]:
        """seq -> node of the entries that are still current (for integrity checks)."""
        return {seq: node for _, seq, node in self._heap if seq == node.heap_seq}

    def clear(self) -> None:
        self._heap.clear()
        self._limit = _MIN_COMPACT

    def _compact(self) -> None:
        # Stale entries pile up when nodes are locked and unlocked without evictions;
        # drop them in one O(n) pass, amortised by doubling the limit.
        heap = [
            e
            for e in self._heap
            if e[1] == e[2].heap_seq
            and not e[2].ref_count
            and not e[2].children
            and e[2].parent is not None
        ]
        heapq.heapify(heap)
        self._heap = heap
        self._limit = max(_MIN_COMPACT, 2 * len(heap))
