"""RadixCache structure: the chapter's worked example, matching, splitting, pages,
namespaces, locks and the integrity check."""

from __future__ import annotations

import numpy as np
import pytest
from radixlm.cache import LockError, RadixCache, StaleHandle, TreeNode


def shape(node: TreeNode) -> dict:
    """The subtree below `node` as {tuple(edge tokens): subtree}."""
    return {tuple(c.tokens.tolist()): shape(c) for c in node.children.values()}


def ns_root(tree: RadixCache, namespace=None) -> TreeNode:
    return tree.root.children[namespace]


# ------------------- three requests sharing ever shorter prefixes: A, B, then C
A = [101, 11, 12, 21, 22]
B = [101, 11, 12, 31, 32]
C = [101, 11, 99]


def test_chapter_example_abc() -> None:
    tree = RadixCache(page_size=1)
    # request A: empty tree, one compressed node; KV in p0..p4
    r = tree.insert(A, [0, 1, 2, 3, 4])
    assert r.cached_len == 0
    assert shape(ns_root(tree)) == {(101, 11, 12, 21, 22): {}}
    a_node = r.node

    # request B: shares [101, 11, 12]; the node is split at 3
    r = tree.insert(B, [5, 6, 7, 8, 9])
    assert r.cached_len == 3  # slots 5, 6, 7 are B's duplicates: the caller frees them
    assert shape(ns_root(tree)) == {(101, 11, 12): {(21, 22): {}, (31, 32): {}}}

    # request C: shares only [101, 11]; the shared node is split again at 2
    r = tree.insert(C, [10, 11, 12])
    assert r.cached_len == 2
    assert shape(ns_root(tree)) == {
        (101, 11): {(12,): {(21, 22): {}, (31, 32): {}}, (99,): {}},
    }
    tree.check_integrity()

    # A's leaf object survived both splits (handles stay valid) with A's own slots
    assert a_node.tokens.tolist() == [21, 22] and a_node.slots.tolist() == [3, 4]
    # a split never copies: the shared prefix still points at A's p0, p1, p2 ...
    assert tree.match(A).slots.tolist() == [0, 1, 2, 3, 4]
    assert tree.match(B).slots.tolist() == [0, 1, 2, 8, 9]
    assert tree.match(C).slots.tolist() == [0, 1, 12]
    # ... and the halves are views of A's original slot array, not copies
    (top,) = ns_root(tree).children.values()
    mid = next(iter(top.children.values()))
    assert top.value.base is mid.value.base is a_node.value.base
    assert tree.total_size == 5 + 2 + 1


def test_match_splits_where_it_ends_without_copying() -> None:
    tree = RadixCache()
    leaf = tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15]).node
    m = tree.match([1, 2, 3, 9])
    assert m.length == 3 and m.slots.tolist() == [10, 11, 12]
    assert m.node.depth == 3 and m.node.tokens.tolist() == [1, 2, 3]
    assert leaf.parent is m.node and leaf.tokens.tolist() == [4, 5, 6]
    assert tree.total_size == 6 and tree.num_nodes == 2
    tree.check_integrity()


def test_match_empty_and_miss_return_root() -> None:
    tree = RadixCache()
    assert tree.match([]).node is tree.root
    assert tree.match([1, 2]).length == 0
    tree.insert([1, 2], [0, 1])
    m = tree.match([7, 1, 2])
    assert m.node is tree.root and m.length == 0 and m.slots.dtype == np.int64
    tree.lock(m.node)  # locking the root handle is a harmless no-op
    tree.unlock(m.node)


def test_slots_are_private_both_ways() -> None:
    tree = RadixCache()
    slots = np.array([5, 6, 7], dtype=np.int64)
    tree.insert([1, 2, 3], slots)
    slots[:] = -1  # the caller's buffer is not the tree's
    m = tree.match([1, 2, 3])
    assert m.slots.tolist() == [5, 6, 7] and m.slots.dtype == np.int64
    with pytest.raises(ValueError):
        m.slots[0] = 0  # match results may be the tree's own (read-only) storage
    with pytest.raises(ValueError):
        m.node.value[0] = 0
    assert tree.match([1, 2, 3]).slots.tolist() == [5, 6, 7]


def test_accepts_lists_tuples_and_other_int_dtypes() -> None:
    tree = RadixCache()
    tree.insert(np.array([1, 2, 3], dtype=np.int32), (7, 8, 9))
    assert tree.match([1, 2, 3]).slots.tolist() == [7, 8, 9]
    assert tree.match(np.array([1, 2], dtype=np.uint16)).length == 2
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3], [1, 2])  # fewer slots than tokens


def test_insert_of_existing_prefix_returns_node_ending_there() -> None:
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], [0, 1, 2, 3])
    r = tree.insert([1, 2], [9, 9])
    assert r.cached_len == 2 and r.node.depth == 2
    assert tree.path_tokens(r.node).tolist() == [1, 2]
    assert tree.total_size == 4
    tree.check_integrity()


# ------------------------------------------------------------------------ pages
def test_page_size_keys_are_page_aligned() -> None:
    tree = RadixCache(page_size=4)
    r = tree.insert(list(range(10)), list(range(100, 110)))  # 10 tokens -> 8 cached
    assert r.cached_len == 0 and r.node.depth == 8
    assert tree.total_size == 8
    # a mismatch inside the second page: only the first page is shared
    m = tree.match([0, 1, 2, 3, 4, 5, 99, 7])
    assert m.length == 4 and m.slots.tolist() == [100, 101, 102, 103]
    # differing inside the first page: no sharing at all, a sibling page
    r = tree.insert([0, 1, 2, 9, 4, 5, 6, 7], list(range(200, 208)))
    assert r.cached_len == 0
    assert shape(ns_root(tree)) == {
        (0, 1, 2, 3): {(4, 5, 6, 7): {}},
        (0, 1, 2, 9, 4, 5, 6, 7): {},
    }
    assert tree.match([0, 1, 2]).length == 0  # shorter than a page
    tree.check_integrity()


def test_page_size_validation() -> None:
    with pytest.raises(ValueError):
        RadixCache(page_size=0)


# ------------------------------------------------------------------- namespaces
def test_namespaces_isolate_identical_prefixes() -> None:
    tree = RadixCache()
    tree.insert([1, 2, 3], [0, 1, 2], namespace="alice")
    assert tree.match([1, 2, 3]).length == 0
    assert tree.match([1, 2, 3], namespace="bob").length == 0
    assert tree.match([1, 2, 3], namespace="alice").slots.tolist() == [0, 1, 2]
    r = tree.insert([1, 2, 3], [5, 6, 7], namespace="bob")
    assert r.cached_len == 0  # bob computes his own KV
    assert tree.match([1, 2, 3], namespace="bob").slots.tolist() == [5, 6, 7]
    assert set(tree.root.children) == {"alice", "bob"}
    tree.check_integrity()


def test_emptied_namespace_is_dropped() -> None:
    tree = RadixCache()
    tree.insert([1, 2], [0, 1], namespace=("salt", 7))
    assert tree.evict(10).tolist() == [0, 1]
    assert tree.root.children == {}
    tree.check_integrity()


# ------------------------------------------------------------------------ locks
def test_lock_unlock_moves_tokens_between_evictable_and_protected() -> None:
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], [0, 1, 2, 3])
    tree.insert([1, 2, 5], [4, 5, 6])
    node = tree.match([1, 2, 3, 4]).node
    assert (tree.evictable_size, tree.protected_size) == (5, 0)
    tree.lock(node)
    assert (tree.evictable_size, tree.protected_size) == (1, 4)
    tree.lock(node)
    tree.unlock(node)
    assert (tree.evictable_size, tree.protected_size) == (1, 4)
    tree.unlock(node)
    assert (tree.evictable_size, tree.protected_size) == (5, 0)
    tree.check_integrity()
    with pytest.raises(LockError):
        tree.unlock(node)


def test_split_under_a_lock_keeps_the_lock_on_both_halves() -> None:
    tree = RadixCache()
    node = tree.insert([1, 2, 3, 4], [0, 1, 2, 3]).node
    tree.lock(node)
    m = tree.match([1, 2, 9])  # splits the locked edge
    assert m.node.ref_count == 1 and node.ref_count == 1
    assert tree.protected_size == 4
    tree.unlock(node)
    assert tree.protected_size == 0 and tree.evictable_size == 4
    tree.check_integrity()


def test_stale_handles_are_rejected() -> None:
    tree = RadixCache()
    node = tree.insert([1, 2], [0, 1]).node
    tree.evict(2)
    with pytest.raises(StaleHandle):
        tree.lock(node)
    node = tree.insert([1, 2], [0, 1]).node
    tree.reset()
    assert tree.total_size == 0 and tree.match([1, 2]).length == 0
    with pytest.raises(StaleHandle):
        tree.lock(node)
    tree.check_integrity()


# -------------------------------------------------------------------- integrity
def _frozen(values: list[int]) -> np.ndarray:
    arr = np.array(values, dtype=np.int64)
    arr.flags.writeable = False
    return arr


def _tree() -> tuple[RadixCache, TreeNode]:
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], [0, 1, 2, 3])
    leaf = tree.insert([1, 2, 5], [4, 5, 6]).node
    tree.lock(leaf)
    tree.check_integrity()
    return tree, leaf


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda t, n: setattr(t, "_evictable", t._evictable + 1), "evictable_size"),
        (lambda t, n: setattr(t, "_protected", 0), "protected_size"),
        (lambda t, n: setattr(n, "ref_count", 0), "evictable_size"),
        (lambda t, n: setattr(n.parent, "ref_count", 0), "ref_count"),
        (lambda t, n: setattr(t.root.children[None], "ref_count", 5), "root ref_count"),
        (lambda t, n: setattr(n, "depth", 7), "depth"),
        (lambda t, n: setattr(n, "parent", t.root), "parent pointer"),
        (lambda t, n: setattr(n, "value", _frozen([4, 7])), "lengths"),
        (lambda t, n: setattr(t, "_num_nodes", 1), "node count"),
        (lambda t, n: t.root.children[None].children.clear(), "empty namespace"),
    ],
)
def test_integrity_check_fires_on_corruption(corrupt, message) -> None:
    tree, leaf = _tree()
    corrupt(tree, leaf)
    with pytest.raises(AssertionError, match=message):
        tree.check_integrity()


def test_integrity_detects_shared_slot_writeable_value_and_lost_leaf() -> None:
    tree, leaf = _tree()
    leaf.value = _frozen([0])  # slot 0 also used by the first edge
    with pytest.raises(AssertionError, match="two cached tokens"):
        tree.check_integrity()

    tree, leaf = _tree()
    leaf.value = leaf.value.copy()  # writeable
    with pytest.raises(AssertionError, match="writeable"):
        tree.check_integrity()

    tree, leaf = _tree()
    other = tree.match([1, 2, 3, 4]).node
    other.heap_seq = -5  # its eviction-heap entry no longer matches
    with pytest.raises(AssertionError, match="eviction heap"):
        tree.check_integrity()


def test_path_slots_and_tokens_read_ranges_without_touching() -> None:
    tree = RadixCache()
    tree.insert([1, 2, 3], [10, 11, 12])
    leaf = tree.insert([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]).node
    tree.insert([1, 2, 9], [20, 21, 22])  # split: [1,2] | [3] | [4,5]
    tick = leaf.access_tick
    assert tree.path_slots(leaf).tolist() == [10, 11, 12, 13, 14]
    assert tree.path_slots(leaf, 1, 4).tolist() == [11, 12, 13]
    assert tree.path_slots(leaf, 3).tolist() == [13, 14]
    assert tree.path_slots(leaf, 5).tolist() == []
    assert tree.path_slots(leaf).dtype == np.int64
    assert tree.path_tokens(leaf).tolist() == [1, 2, 3, 4, 5]
    assert leaf.access_tick == tick
