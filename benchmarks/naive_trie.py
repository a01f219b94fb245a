"""Baseline for bench_cache.py: a naive per-token trie with the same lifecycle API as
RadixCache (page_size 1, LRU). One node per token, Python loops per token on every
walk and every lock; the set of evictable leaves is kept incrementally (as SGLang does)
and heapified on each eviction call."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class NaiveNode:
    __slots__ = ("parent", "children", "token", "slot", "ref", "last_access", "depth")

    def __init__(self, parent: NaiveNode | None, token: int, slot: int, depth: int) -> None:
        self.parent = parent
        self.children: dict[int, NaiveNode] = {}
        self.token = token
        self.slot = slot
        self.ref = 0
        self.last_access = 0
        self.depth = depth


class NaiveMatch(NamedTuple):
    node: NaiveNode
    length: int
    slots: np.ndarray


class NaiveInsert(NamedTuple):
    cached_len: int
    node: NaiveNode


class NaiveTrie:
    def __init__(self) -> None:
        self.root = NaiveNode(None, -1, -1, 0)
        self.evictable_size = 0
        self.protected_size = 0
        self.leaves: set[NaiveNode] = set()  # unlocked leaves
        self._tick = 0

    def match(self, tokens: Sequence[int], namespace: object = None) -> NaiveMatch:
        self._tick += 1
        node = self.root
        slots: list[int] = []
        for t in np.asarray(tokens).tolist():
            child = node.children.get(t)
            if child is None:
                break
            child.last_access = self._tick
            slots.append(child.slot)
            node = child
        return NaiveMatch(node, len(slots), np.array(slots, dtype=np.int64))

    def insert(
        self, tokens: Sequence[int], slots: Sequence[int], namespace: object = None
    ) -> NaiveInsert:
        self._tick += 1
        toks = np.asarray(tokens).tolist()
        vals = np.asarray(slots).tolist()
        node = self.root
        i = 0
        for t in toks:
            child = node.children.get(t)
            if child is None:
                break
            child.last_access = self._tick
            node = child
            i += 1
        cached = i
        if i < len(toks):
            self.leaves.discard(node)
            for t, s in zip(toks[i:], vals[i : len(toks)], strict=True):
                child = NaiveNode(node, t, s, node.depth + 1)
                child.last_access = self._tick
                node.children[t] = child
                node = child
            self.evictable_size += len(toks) - i
            self.leaves.add(node)
        return NaiveInsert(cached, node)

    def path_slots(self, node: NaiveNode, start: int, end: int) -> np.ndarray:
        """Slots of positions [start, end) on the path ending at `node`."""
        out: list[int] = []
        while node is not self.root and node.depth > start:
            if node.depth <= end:
                out.append(node.slot)
            node = node.parent  # type: ignore[assignment]
        out.reverse()
        return np.array(out, dtype=np.int64)

    def lock(self, node: NaiveNode) -> None:
        if node is self.root:
            return
        self.leaves.discard(node)
        while node is not self.root:
            if node.ref == 0:
                self.evictable_size -= 1
                self.protected_size += 1
            node.ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: NaiveNode) -> None:
        if node is self.root:
            return
        if node.ref == 1 and not node.children:
            self.leaves.add(node)
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self.evictable_size += 1
                self.protected_size -= 1
            node = node.parent  # type: ignore[assignment]

    def evict(self, n_tokens: int, on_evict: object = None) -> np.ndarray:
        heap = [(n.last_access, id(n), n) for n in self.leaves]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < n_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.token]
            self.leaves.discard(node)
            freed.append(node.slot)
            self.evictable_size -= 1
            if parent is not self.root and not parent.children and parent.ref == 0:
                self.leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return np.array(freed, dtype=np.int64)
