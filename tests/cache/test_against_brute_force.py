"""Stateful property test: RadixCache against the brute-force ReferenceCache.

Random match / insert / lock / unlock / evict / set_priority sequences over two
namespaces; after every step match lengths, slot identity, sizes and the tree's own
integrity check must agree with the reference. Sequences are built by extending earlier
ones so that prefixes are shared (and edges split) even with 16-token pages.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import numpy as np
from cache_reference import ReferenceCache
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from radixlm.cache import RadixCache
from radixlm.cache.node import TreeNode

NAMESPACES = [None, "tenant-b"]


class RadixMachine(RuleBasedStateMachine):
    PAGE_SIZE = 1

    def __init__(self) -> None:
        super().__init__()
        self.ref = ReferenceCache(self.PAGE_SIZE)
        self.seqs: list[tuple[object, list[int]]] = []  # sequences seen, to extend
        self.held: list[tuple[TreeNode, object, tuple[int, ...]]] = []  # our locks
        self.next_slot = itertools.count(1000)
        self.clock_t = 0.0

    def clock(self) -> float:
        self.clock_t += 1.0
        return self.clock_t

    @initialize(policy=st.sampled_from(["lru", "lfu", "priority"]))
    def setup(self, policy: str) -> None:
        self.tree = RadixCache(self.PAGE_SIZE, policy, clock=self.clock)

    # ---------------------------------------------------------------- helpers
    def draw_tokens(self, data: st.DataObject) -> tuple[object, list[int]]:
        p = self.PAGE_SIZE
        max_len = 6 * p + 3
        alphabet = st.integers(0, 3)
        if self.seqs and data.draw(st.booleans(), label="extend"):
            ns, base = data.draw(st.sampled_from(self.seqs), label="base")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            tail = data.draw(st.lists(alphabet, max_size=max(0, max_len - cut)), label="tail")
            # an occasional foreign namespace checks isolation on identical tokens
            if data.draw(st.integers(0, 9), label="ns-flip") == 0:
                ns = NAMESPACES[1 - NAMESPACES.index(ns)]
            return ns, base[:cut] + tail
        ns = data.draw(st.sampled_from(NAMESPACES), label="ns")
        return ns, data.draw(st.lists(alphabet, max_size=max_len), label="tokens")

    def check_match(self, ns: object, tokens: list[int]):
        res = self.tree.match(np.asarray(tokens, dtype=np.int64), namespace=ns)
        want = self.ref.match_len(tokens, ns)
        assert res.length == want, (res.length, want)
        assert res.slots.dtype == np.int64
        assert res.slots.tolist() == self.ref.slots(tokens, ns, want)
        if want:
            assert res.node.depth == want
            assert self.tree.path_tokens(res.node).tolist() == tokens[:want]
            assert self.tree.path_slots(res.node).tolist() == res.slots.tolist()
        else:
            assert res.node is self.tree.root
        return res

    # ------------------------------------------------------------------ rules
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        ns, tokens = self.draw_tokens(data)
        self.seqs.append((ns, tokens))
        slots = [next(self.next_slot) for _ in tokens]  # fresh: duplicates just drop
        priority = data.draw(st.integers(0, 3), label="priority")
        as_list = data.draw(st.booleans(), label="as-list")
        toks = tokens if as_list else np.asarray(tokens, dtype=np.int64)
        res = self.tree.insert(toks, slots, namespace=ns, priority=priority)
        want = self.ref.insert(tokens, slots, ns)
        assert res.cached_len == want, (res.cached_len, want)
        n = self.ref.aligned(len(tokens))
        if n:
            assert res.node.depth == n
            assert self.tree.path_tokens(res.node).tolist() == tokens[:n]
            if data.draw(st.booleans(), label="lock-after-insert"):
                self.tree.lock(res.node)
                self.ref.locks[(ns, tuple(tokens[:n]))] += 1
                self.held.append((res.node, ns, tuple(tokens[:n])))
        else:
            assert res.node is self.tree.root

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data: st.DataObject, lock: bool) -> None:
        ns, tokens = self.draw_tokens(data)
        res = self.check_match(ns, tokens)
        if lock and res.length:
            self.tree.lock(res.node)
            key = (ns, tuple(tokens[: res.length]))
            self.ref.locks[key] += 1
            self.held.append((res.node, *key))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.held) - 1), label="which")
        node, ns, seq = self.held.pop(i)
        self.tree.unlock(node)
        self.ref.locks[(ns, seq)] -= 1

    @precondition(lambda self: self.held)
    @rule(data=st.data(), priority=st.integers(0, 5))
    def set_priority(self, data: st.DataObject, priority: int) -> None:
        node, _, _ = data.draw(st.sampled_from(self.held), label="which")
        self.tree.set_priority(node, priority)

    @rule(n=st.integers(0, 40))
    def evict(self, n: int) -> None:
        evictable_before, _ = self.ref.sizes()
        freed = self.tree.evict(n)
        assert freed.dtype == np.int64
        self.ref.remove_slots(freed.tolist())
        assert len(freed) >= min(n, evictable_before)
        if len(freed) < n:
            assert self.ref.sizes()[0] == 0, "evict stopped early with evictable tokens left"

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def rematch_known(self, data: st.DataObject) -> None:
        ns, tokens = data.draw(st.sampled_from(self.seqs), label="known")
        self.check_match(ns, tokens)

    # ------------------------------------------------------------- invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.check_integrity()
        evictable, protected = self.ref.sizes()
        assert self.tree.evictable_size == evictable
        assert self.tree.protected_size == protected
        assert self.tree.total_size == self.ref.total


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Page1(RadixMachine):
    PAGE_SIZE = 1


class Page4(RadixMachine):
    PAGE_SIZE = 4


class Page16(RadixMachine):
    PAGE_SIZE = 16


TestRadixPage1 = Page1.TestCase
TestRadixPage1.settings = SETTINGS
TestRadixPage4 = Page4.TestCase
TestRadixPage4.settings = SETTINGS
TestRadixPage16 = Page16.TestCase
TestRadixPage16.settings = SETTINGS
