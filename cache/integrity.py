"""Full consistency check of a RadixCache (tests and debugging; O(tree size))."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from radixlm.cache.tokens import ITEM

if TYPE_CHECKING:
    from radixlm.cache.radix import RadixCache


def _fail(msg: str) -> None:
    raise AssertionError(f"RadixCache integrity: {msg}")


def check_tree(tree: RadixCache) -> None:
    """Recompute sizes, ref counts and the evictable-leaf set from scratch and compare.

    Raises AssertionError naming the first inconsistency.
    """
    root = tree.root
    psize = tree.page_size
    pb = psize * ITEM
    if root.parent is not None or root.length != 0 or root.key_bytes:
        _fail("root must be empty and parentless")

    evictable = protected = nodes = 0
    slot_parts: list[np.ndarray] = []
    live = tree._leaves.live_entries()
    stack = []
    for ns_key, ns in root.children.items():
        if ns.parent is not root:
            _fail(f"namespace {ns_key!r} root does not point back to the root")
        if ns.length != 0 or ns.key_bytes or ns.depth != 0:
            _fail(f"namespace {ns_key!r} root must hold no tokens")
        if ns.namespace != ns_key:
            _fail(f"namespace root under key {ns_key!r} says {ns.namespace!r}")
        if not ns.children:
            _fail(f"empty namespace root {ns_key!r} was not removed")
        stack.append(ns)

    while stack:
        node = stack.pop()
        child_refs = 0
        for ckey, child in node.children.items():
            where = f"node at depth {child.depth} in namespace {child.namespace!r}"
            if child.parent is not node:
                _fail(f"{where}: parent pointer does not match the tree")
            if child.namespace != node.namespace:
                _fail(f"{where}: namespace differs from its parent's")
            if child.length <= 0 or child.length % psize:
                _fail(f"{where}: edge length {child.length} not a positive multiple of {psize}")
            if len(child.key_bytes) != child.length * ITEM or len(child.value) != child.length:
                _fail(f"{where}: key/value lengths disagree with length {child.length}")
            if ckey != child.key_bytes[:pb]:
                _fail(f"{where}: child dict key is not its first page")
            if child.depth != node.depth + child.length:
                _fail(f"{where}: depth {child.depth} != parent {node.depth} + {child.length}")
            if child.ref_count < 0:
                _fail(f"{where}: negative ref_count {child.ref_count}")
            if child.value.flags.writeable:
                _fail(f"{where}: slot array is writeable (callers could corrupt it)")
            child_refs += child.ref_count
            nodes += 1
            if child.ref_count:
                protected += child.length
            else:
                evictable += child.length
                if not child.children and live.get(child.heap_seq) is not child:
                    _fail(f"{where}: unlocked leaf is missing from the eviction heap")
            slot_parts.append(child.value)
            stack.append(child)
        if node.ref_count < child_refs:
            _fail(
                f"node at depth {node.depth}: ref_count {node.ref_count} < sum of its "
                f"children's {child_refs} (a lock did not reach the root)"
            )
        if not node.length and node.ref_count != child_refs:
            _fail(f"namespace {node.namespace!r} root ref_count {node.ref_count} != {child_refs}")

    if nodes != tree.num_nodes:
        _fail(f"node count {tree.num_nodes} != {nodes} found")
    if evictable != tree.evictable_size:
        _fail(f"evictable_size {tree.evictable_size} != {evictable} recomputed")
    if protected != tree.protected_size:
        _fail(f"protected_size {tree.protected_size} != {protected} recomputed")
    if slot_parts:
        slots = np.concatenate(slot_parts)
        if len(np.unique(slots)) != len(slots):
            _fail("a slot is used by two cached tokens")
