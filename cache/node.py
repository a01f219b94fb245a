"""The radix tree node: one path-compressed edge of token ids and their KV slots, and the
one change of an edge's shape, `TreeNode.split` (metadata only: no KV moves)."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
from radixlm.cache.pages import align_down
from radixlm.cache.tokens import EMPTY_VAL, ITEM, KEY


class TreeNode:
    """A node owns the edge from its parent to itself.

    `key_bytes` is the edge's token ids as raw int64 bytes: bytes compare with `memcmp`
    (`startswith` at an offset, no copy), which makes walking long edges cheap, and the
    first page of them is the child's key in `parent.children`. `value` holds one KV slot
    per token (read-only int64 array). `depth` is the number of tokens from the namespace
    root to the end of this node; it never changes when an edge above is split.
    """

    __slots__ = (
        "parent",
        "children",
        "key_bytes",
        "value",
        "length",
        "depth",
        "ref_count",
        "last_access",
        "access_tick",
        "hit_count",
        "priority",
        "namespace",
        "heap_seq",
    )

    def __init__(
        self,
        parent: TreeNode | None,
        key_bytes: bytes,
        value: np.ndarray,
        depth: int,
        namespace: Hashable = None,
        access_tick: int = 0,
        last_access: float = 0.0,
        priority: int = 0,
    ) -> None:
        self.parent = parent
        self.children: dict[Hashable, TreeNode] = {}
        self.key_bytes = key_bytes
        self.value = value
        self.length = len(value)
        self.depth = depth
        self.ref_count = 0  # requests/handles holding this node or a descendant
        self.last_access = last_access  # clock() of the last match/insert through it
        self.access_tick = access_tick  # logical time of that access: strict LRU order
        self.hit_count = 0  # matches through this node (LFU)
        self.priority = priority  # higher = evicted later
        self.namespace = namespace
        self.heap_seq = -1  # sequence number of this node's live eviction-heap entry

    @classmethod
    def make_root(cls) -> TreeNode:
        return cls(None, b"", EMPTY_VAL, 0)

    @property
    def tokens(self) -> np.ndarray:
        """The edge's token ids (read-only int64 view)."""
        return np.frombuffer(self.key_bytes, dtype=KEY)

    @property
    def slots(self) -> np.ndarray:
        """The edge's KV slots (read-only int64)."""
        return self.value

    @property
    def prefix_len(self) -> int:
        """Tokens on the path above this node."""
        return self.depth - self.length

    def shared_len(self, tokens: np.ndarray, pos: int, page_size: int) -> int:
        """Page-aligned number of leading tokens `tokens[pos:]` shares with this edge (at
        least one page when its first page matched this node's key in its parent)."""
        edge = np.frombuffer(self.key_bytes, dtype=KEY)
        n = min(len(edge), len(tokens) - pos)
        neq = edge[:n] != tokens[pos : pos + n]
        i = int(neq.argmax())
        m = i if neq[i] else n
        return align_down(m, page_size)

    def split(self, m: int, page_bytes: int) -> TreeNode:
        """Cut this edge after `m` tokens; the new upper node is returned (one more node
        for the tree to count; `page_bytes`: the bytes of one page of keys).

        The lower part keeps this node's identity (handles ending here stay valid) and its
        heap entry; the upper node inherits the ref count (every lock through this node
        passes through it) and the usage stats. Slots are views: no KV moves.
        """
        parent = self.parent
        assert parent is not None
        mb = m * ITEM
        kb = self.key_bytes
        upper = TreeNode(
            parent,
            kb[:mb],
            self.value[:m],
            self.depth - self.length + m,
            self.namespace,
            self.access_tick,
            self.last_access,
            self.priority,
        )
        upper.ref_count = self.ref_count
        upper.hit_count = self.hit_count
        parent.children[kb[:page_bytes]] = upper
        self.key_bytes = kb[mb:]
        self.value = self.value[m:]
        self.length -= m
        self.parent = upper
        upper.children[kb[mb : mb + page_bytes]] = self
        return upper

    def __repr__(self) -> str:
        toks = self.tokens
        shown = toks[:8].tolist()
        more = "…" if len(toks) > 8 else ""
        return (
            f"TreeNode(tokens={shown}{more}, len={self.length}, depth={self.depth}, "
            f"ref={self.ref_count}, children={len(self.children)})"
        )
