"""Reading a path of the radix tree: the token ids and KV slots from a namespace root down
to a node, and what an eviction hook is shown of a node as it goes.

Apart from radix.py because these read nodes only, never the tree's accounting (sizes,
ref counts, the eviction heap) and never its access times: any holder of a node may call
them, and `RadixCache.path_tokens` / `RadixCache.path_slots` are these functions.
"""

from __future__ import annotations

import numpy as np
from radixlm.cache.node import TreeNode
from radixlm.cache.results import EvictedSegment
from radixlm.cache.tokens import EMPTY, KEY, VAL


def path_tokens(node: TreeNode | None) -> np.ndarray:
    """All token ids (read-only int64) from the namespace root to the end of `node`."""
    parts: list[bytes] = []
    while node is not None and node.length:
        parts.append(node.key_bytes)
        node = node.parent
    return np.frombuffer(b"".join(reversed(parts)), dtype=KEY)


def path_slots(node: TreeNode, start: int = 0, end: int | None = None) -> np.ndarray:
    """KV slots (read-only int64) of positions `[start, end)` on the path ending at `node`
    (`end` defaults to `node.depth`). Does not touch access times."""
    end = node.depth if end is None else min(end, node.depth)
    parts: list[np.ndarray] = []
    while node is not None and node.length and node.depth > start:
        lo = node.depth - node.length
        if lo < end:
            parts.append(node.value[max(start - lo, 0) : min(end, node.depth) - lo])
        node = node.parent  # type: ignore[assignment]
    parts.reverse()
    return join_slots(parts)


def evicted_segment(node: TreeNode) -> EvictedSegment:
    """`node` as an eviction hook sees it: its own edge and the tokens on the path above."""
    return EvictedSegment(node.namespace, node.depth - node.length, node.tokens, node.slots,
                          path_tokens(node.parent))


def join_slots(values: list[np.ndarray]) -> np.ndarray:
    """Node slot arrays as one read-only int64 array: the node's own array when there is
    one, else one join of the raw buffers (cheaper than np.concatenate here)."""
    if len(values) == 1:
        return values[0]
    if not values:
        return EMPTY
    return np.frombuffer(b"".join(values), dtype=VAL)
