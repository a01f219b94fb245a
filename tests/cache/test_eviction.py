"""Eviction: only unlocked leaves, policy order (LRU, LFU, priority), cascading parents,
the on_evict hook, and cost proportional to what is evicted."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from radixlm.cache import EvictedSegment, RadixCache
from radixlm.cache.policy import LRUPolicy


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def evict_order(tree: RadixCache) -> list[list[int]]:
    """Evict everything one node at a time; the full token paths in eviction order."""
    order: list[list[int]] = []

    def hook(seg: EvictedSegment) -> None:
        order.append(seg.prefix_tokens.tolist() + seg.tokens.tolist())

    while tree.evict(1, on_evict=hook).size:
        pass
    return order


def fresh(policy: str = "lru", page_size: int = 1) -> RadixCache:
    return RadixCache(page_size, policy, clock=FakeClock())


def test_evict_takes_only_unlocked_leaves_and_cascades_to_parents() -> None:
    tree = fresh()
    tree.insert([1, 2, 3, 4], [0, 1, 2, 3])
    tree.insert([1, 2, 5, 6], [4, 5, 6, 7])
    locked = tree.insert([7, 8], [8, 9]).node
    tree.lock(locked)
    freed = tree.evict(100)
    # both [1,2]-branches go, then [1,2] itself once it is a leaf; [7,8] is locked.
    # (slots 4, 5 were the second insert's duplicates of [1,2]: never in the tree)
    assert sorted(freed.tolist()) == [0, 1, 2, 3, 6, 7]
    assert tree.total_size == tree.protected_size == 2
    assert tree.match([7, 8]).length == 2
    tree.check_integrity()
    tree.unlock(locked)
    assert tree.evict(1).tolist() == [8, 9]  # whole nodes: at least n tokens
    assert tree.total_size == 0


def test_internal_node_of_locked_path_survives_pressure() -> None:
    tree = fresh()
    tree.insert([1, 2, 3], [0, 1, 2])
    leaf = tree.insert([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]).node
    tree.insert([1, 2, 9], [5, 6, 7])  # [1,2] becomes internal, [9] a sibling leaf
    tree.lock(leaf)
    assert sorted(tree.evict(100).tolist()) == [7]  # only the unlocked [9] leaf
    assert tree.match([1, 2, 3, 4, 5]).slots.tolist() == [0, 1, 2, 3, 4]
    tree.check_integrity()


def test_lru_order_follows_last_access() -> None:
    tree = fresh("lru")
    for i, seq in enumerate(([1, 1], [2, 2], [3, 3])):
        tree.insert(seq, [2 * i, 2 * i + 1])
    tree.match([1, 1])  # most recent now
    assert evict_order(tree) == [[2, 2], [3, 3], [1, 1]]


def test_lfu_order_follows_hit_count_then_recency() -> None:
    tree = fresh("lfu")
    for i, seq in enumerate(([1, 1], [2, 2], [3, 3])):
        tree.insert(seq, [2 * i, 2 * i + 1])
    for _ in range(3):
        tree.match([1, 1])
    tree.match([3, 3])
    # [2,2] never hit; [3,3] once; [1,1] three times
    assert evict_order(tree) == [[2, 2], [3, 3], [1, 1]]


def test_priority_order_and_lru_within_a_priority() -> None:
    tree = fresh("priority")
    tree.insert([1, 1], [0, 1], priority=5)
    tree.insert([2, 2], [2, 3], priority=0)
    tree.insert([3, 3], [4, 5], priority=0)
    tree.insert([4, 4], [6, 7], priority=9)
    tree.match([2, 2])  # [3,3] is now the older of the two priority-0 leaves
    assert evict_order(tree) == [[3, 3], [2, 2], [1, 1], [4, 4]]


def test_set_priority_can_raise_and_lower() -> None:
    tree = fresh("priority")
    a = tree.insert([1, 1], [0, 1]).node
    b = tree.insert([2, 2], [2, 3], priority=20).node  # queued with a high key
    tree.set_priority(a, 10)
    tree.set_priority(b, -1)  # lowered: must now go first despite its queued entry
    assert evict_order(tree) == [[2, 2], [1, 1]]


def test_set_priority_applies_to_the_whole_path() -> None:
    tree = fresh("priority")
    tree.insert([1, 2, 3], [0, 1, 2])
    leaf = tree.insert([1, 2, 3, 4], [0, 1, 2, 3]).node
    tree.insert([1, 2, 9], [4, 5, 6])
    tree.set_priority(leaf, 7)
    assert [n.priority for n in (leaf, leaf.parent, leaf.parent.parent)] == [7, 7, 7]
    tree.insert([5], [7])
    order = evict_order(tree)
    assert order[:2] == [[1, 2, 9], [5]]  # priority 0 first, then the pinned path


def test_insert_priority_raises_path_to_max() -> None:
    tree = fresh("priority")
    tree.insert([1, 2, 3], [0, 1, 2], priority=3)
    node = tree.insert([1, 2, 3, 4], [0, 1, 2, 3], priority=1).node
    assert node.priority == 1 and node.parent.priority == 3
    tree.insert([1, 2, 3, 4], [0, 1, 2, 3], priority=8)
    assert node.priority == 8 and node.parent.priority == 8


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="lru"):
        RadixCache(policy="fifo")
    with pytest.raises(TypeError):
        RadixCache(policy=object())  # type: ignore[arg-type]


def test_custom_policy_object() -> None:
    class LongestFirst:
        name = "longest"

        @staticmethod
        def key(node):
            return -node.length

    tree = RadixCache(policy=LongestFirst())
    tree.insert([1], [0])
    tree.insert([2, 2, 2], [1, 2, 3])
    assert tree.evict(1).tolist() == [1, 2, 3]


def test_on_evict_sees_namespace_prefix_and_slots_before_removal() -> None:
    tree = fresh()
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13], namespace="t")
    tree.insert([1, 2, 5], [14, 15, 16], namespace="t")
    tree.match([1, 2, 5], namespace="t")  # [3,4] is the LRU leaf
    seen: list[EvictedSegment] = []

    def hook(seg: EvictedSegment) -> None:
        # called before removal: the node is still matchable
        assert tree.match(seg.prefix_tokens.tolist() + seg.tokens.tolist(), "t").length > 0
        seen.append(seg)

    tree.evict(2, on_evict=hook)
    assert len(seen) == 1
    seg = seen[0]
    assert (seg.namespace, seg.prefix_len) == ("t", 2)
    assert seg.prefix_tokens.tolist() == [1, 2]
    assert seg.tokens.tolist() == [3, 4] and seg.slots.tolist() == [12, 13]


def test_evict_cost_grows_with_what_is_evicted_not_tree_size() -> None:
    calls = 0

    class CountingLRU:
        name = "counting-lru"

        @staticmethod
        def key(node):
            nonlocal calls
            calls += 1
            return LRUPolicy.key(node)

    tree = RadixCache(policy=CountingLRU())
    n = 20_000
    toks = np.arange(3 * n, dtype=np.int64).reshape(n, 3)
    for i in range(n):
        tree.insert(toks[i], toks[i])
    calls = 0
    freed = tree.evict(30)  # ten 3-token leaves
    assert len(freed) == 30
    assert calls <= 20, f"evicting 10 of {n} leaves evaluated {calls} keys"


def test_lock_unlock_churn_does_not_grow_the_heap_without_bound() -> None:
    tree = fresh()
    nodes = [tree.insert([i, i], [2 * i, 2 * i + 1]).node for i in range(50)]
    for node in itertools.islice(itertools.cycle(nodes), 20_000):
        tree.lock(node)
        tree.unlock(node)
    assert len(tree._leaves) <= 4 * 1024
    tree.check_integrity()
    assert len(tree.evict(10**9)) == 100


def test_evict_zero_or_empty() -> None:
    tree = fresh()
    assert tree.evict(5).tolist() == []
    tree.insert([1], [0])
    assert tree.evict(0).tolist() == []
    assert tree.total_size == 1


def test_evict_namespaces_takes_only_the_chosen_namespaces() -> None:
    """A tenant's flush: every unlocked entry of its namespaces goes (cascading up to their
    emptied roots), locked ones stay, and other namespaces keep every token."""
    tree = fresh()
    slots = itertools.count()

    def put(ns, toks):  # noqa: ANN001, ANN202
        return tree.insert(toks, [next(slots) for _ in toks], namespace=ns).node

    put("t1", [1, 2, 3])
    put("t1", [1, 2, 4])
    held = put("t1/docs", [5, 6])
    put("t1/docs", [5, 7, 8])
    put("t10", [1, 2, 3])  # shares t1's prefix as a string: not one of t1's namespaces
    put(None, [1, 2, 3])
    tree.lock(held)
    others = {ns: tree.match([1, 2, 3], ns).length for ns in ("t10", None)}
    before = tree.total_size
    freed = tree.evict_namespaces(lambda ns: ns == "t1" or str(ns).startswith("t1/"))
    assert len(freed) == before - tree.total_size == 3 + 1 + 2  # [1,2,3],[4] and [7,8]
    assert tree.match([1, 2, 3], "t1").length == 0
    assert tree.match([5, 6], "t1/docs").length == 2  # locked: stays
    assert tree.match([5, 7, 8], "t1/docs").length == 1  # the shared [5] is on the lock path
    assert {ns: tree.match([1, 2, 3], ns).length for ns in ("t10", None)} == others
    tree.check_integrity()
    tree.unlock(held)
    tree.evict(100)
    assert tree.total_size == 0
    tree.check_integrity()
