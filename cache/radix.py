"""RadixCache: a path-compressed radix tree from token ids to KV slot indices.

Seed chapter §3-4: the tree is only an index. Keys are token ids, values are slot
indices into the KV pool; the KV itself lives in `KVPool`. Splitting an edge only
reorganises metadata (the two halves keep views of the same slot array), never KV.

Layout: the root holds nothing; its children are one *namespace root* per namespace
(tenant / cache salt; `None` is the default), each also empty, so tenants' sequences
live in disjoint subtrees and can never hit each other's prefixes. Below them, edges are
page-aligned (a multiple of `page_size` tokens) and a child is found by the bytes of
its first page, which for `page_size == 1` is simply its first token.

Accounting: every cached token is either *evictable* (its node has ref_count 0) or
*protected* (ref_count > 0). `lock`/`unlock` move whole nodes between the two along the
path to the root. Unlocked leaves sit in a lazily invalidated heap ordered by the
eviction policy, so evicting k tokens costs O(nodes evicted · log heap), not a tree scan.

Reading a path without touching anything (`path_tokens`, `path_slots`) is paths.py's;
splitting an edge is the node's own (`TreeNode.split`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np
from radixlm.cache.errors import LockError, StaleHandle
from radixlm.cache.leaves import LeafHeap
from radixlm.cache.node import TreeNode
from radixlm.cache.pages import align_down
from radixlm.cache.paths import evicted_segment, join_slots, path_slots, path_tokens
from radixlm.cache.policy import EvictionPolicy, make_policy
from radixlm.cache.results import EvictedSegment, InsertResult, MatchResult
from radixlm.cache.tokens import EMPTY, EMPTY_VAL, ITEM, as_i64, frozen_values

Tokens = np.ndarray | Sequence[int]
OnEvict = Callable[[EvictedSegment], None]


class RadixCache:
    def __init__(
        self,
        page_size: int = 1,
        policy: str | EvictionPolicy = "lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if int(page_size) != page_size or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        self.page_size = int(page_size)
        self._page_bytes = self.page_size * ITEM
        self.policy = make_policy(policy)
        self.clock = clock
        self.root = TreeNode.make_root()
        self._leaves = LeafHeap(self.policy.key)
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0  # token-holding nodes (namespace roots excluded)
        self._tick = 0

    # ------------------------------------------------------------------ sizes
    @property
    def evictable_size(self) -> int:
        """Cached tokens no request holds (ref_count 0): eviction may free them."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Cached tokens on a locked path: never evicted until unlocked."""
        return self._protected

    @property
    def total_size(self) -> int:
        """All tokens held by the tree."""
        return self._evictable + self._protected

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def reset(self) -> None:
        """Drop every node (handles from before become stale). The caller owns the slots."""
        # Detach every node so stale handles fail loudly instead of touching the new tree.
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            node.parent = None
            stack.extend(node.children.values())
        self.root = TreeNode.make_root()
        self._leaves.clear()
        self._evictable = self._protected = self._num_nodes = 0

    # ------------------------------------------------------------------ match
    def match(self, tokens: Tokens, namespace: Hashable = None) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens` in `namespace`.

        Returns MatchResult(node, length, slots): `node` ends exactly at `length` (the root
        when nothing matched), `slots` are the KV slots of `tokens[:length]`. If the match
        ends inside an edge, that edge is split there so the handle can name a node; the
        split only reorganises metadata, never copies KV. Matching refreshes the access
        time and hit count of the nodes on the path. A match is not a reservation: lock the
        node before using the slots.
        """
        ns = self.root.children.get(namespace)
        if ns is None:
            return MatchResult(self.root, 0, EMPTY)
        tokens = as_i64(tokens)
        psize = self.page_size
        n = align_down(len(tokens), psize)
        if n == 0:
            return MatchResult(self.root, 0, EMPTY)
        qb = (tokens if n == len(tokens) else tokens[:n]).tobytes()
        self._tick += 1
        node, off, values = self._walk(ns, tokens, qb, self.clock(), True)
        if not values:
            return MatchResult(self.root, 0, EMPTY)
        return MatchResult(node, off // ITEM, join_slots(values))

    def cached_len(self, tokens: Tokens, namespace: Hashable = None) -> int:
        """The length `match` would find, without its effects (no access time, hit count
        or split): for observers, who must not change the eviction order."""
        node = self.root.children.get(namespace)
        tokens = as_i64(tokens)
        n = align_down(len(tokens), self.page_size)
        if node is None or n == 0:
            return 0
        qb = (tokens if n == len(tokens) else tokens[:n]).tobytes()
        pb, off = self._page_bytes, 0
        while off < n * ITEM:
            child = node.children.get(qb[off : off + pb])
            if child is None:
                break
            if not qb.startswith(child.key_bytes, off):
                return off // ITEM + child.shared_len(tokens, off // ITEM, self.page_size)
            off += len(child.key_bytes)
            node = child
        return off // ITEM

    # ----------------------------------------------------------------- insert
    def insert(
        self,
        tokens: Tokens,
        slots: np.ndarray | Sequence[int],
        namespace: Hashable = None,
        priority: int = 0,
    ) -> InsertResult:
        """Cache `tokens` -> `slots` (both cut to a page-aligned length).

        Returns InsertResult(cached_len, node). `cached_len` tokens were already in the
        tree: the tree keeps its own slots for them, so the caller's
        `slots[its_matched_len:cached_len]` are duplicates it must free. The rest joins the
        tree as one new leaf (ref_count 0, evictable) using the caller's slots. `node` ends
        at the inserted length (an edge may be split there). Nodes on the path get
        `priority = max(priority, their own)`.
        """
        tokens = as_i64(tokens)
        psize = self.page_size
        n = align_down(len(tokens), psize)
        if len(slots) < n:
            raise ValueError(f"insert: {len(slots)} slots for {n} (page-aligned) tokens")
        if n == 0:
            return InsertResult(0, self.root)
        ns = self.root.children.get(namespace)
        if ns is None:
            ns = TreeNode(self.root, b"", EMPTY_VAL, 0, namespace)
            self.root.children[namespace] = ns
        qb = (tokens if n == len(tokens) else tokens[:n]).tobytes()
        self._tick += 1
        now = self.clock()
        node, off, _ = self._walk(ns, tokens, qb, now, False, priority)
        cached = off // ITEM
        if cached == n:
            return InsertResult(cached, node)
        leaf = TreeNode(
            node,
            qb[off:],
            frozen_values(slots[cached:n]),
            n,
            namespace,
            self._tick,
            now,
            priority,
        )
        node.children[qb[off : off + self._page_bytes]] = leaf
        self._num_nodes += 1
        self._evictable += n - cached
        self._leaves.push(leaf)
        return InsertResult(cached, leaf)

    def _walk(
        self,
        ns: TreeNode,
        tokens: np.ndarray,
        qb: bytes,
        now: float,
        is_match: bool,
        priority: int = 0,
    ) -> tuple[TreeNode, int, list[np.ndarray]]:
        """Descend from `ns` along `qb`, stamping nodes with the current tick and `now`;
        returns (last node, bytes matched, slot arrays of the nodes passed).

        Whole edges are compared with `bytes.startswith` at an offset (memcmp, no copy);
        only the edge where the walk stops is compared token-wise to find where to split.
        """
        tick = self._tick
        pb = self._page_bytes
        nb = len(qb)
        values: list[np.ndarray] = []
        node = ns
        children = ns.children
        off = 0
        while off < nb:
            child = children.get(qb[off : off + pb])
            if child is None:
                break
            kb = child.key_bytes
            whole = qb.startswith(kb, off)
            if not whole:
                # The walk ends inside this edge: split it at the last shared page.
                child = child.split(child.shared_len(tokens, off // ITEM, self.page_size), pb)
                self._num_nodes += 1
                kb = child.key_bytes
            child.access_tick = tick
            child.last_access = now
            if is_match:
                child.hit_count += 1
                values.append(child.value)
            elif priority > child.priority:
                child.priority = priority
            off += len(kb)
            node = child
            if not whole:
                break
            children = child.children
        return node, off, values

    # ------------------------------------------------------------ lock/unlock
    def lock(self, node: TreeNode) -> None:
        """Protect `node`'s path: ref_count += 1 up to the root; tokens of nodes that were
        unreferenced move from evictable to protected. Locking the root is a no-op."""
        root = self.root
        if node is root:
            return
        if node.parent is None:
            raise StaleHandle(f"lock of a node that is no longer in the tree: {node!r}")
        delta = 0
        while node is not root:
            if node.ref_count == 0:
                delta += node.length
            node.ref_count += 1
            node = node.parent
        self._evictable -= delta
        self._protected += delta

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Nodes whose count drops to 0 become evictable (an
        unreferenced leaf joins the eviction heap); nothing is freed here."""
        root = self.root
        if node is root:
            return
        if node.parent is None:
            raise StaleHandle(f"unlock of a node that is no longer in the tree: {node!r}")
        if node.ref_count <= 0:
            raise LockError(f"unlock without a matching lock: {node!r}")
        if node.ref_count == 1 and not node.children:
            bottom: TreeNode | None = node
        else:
            bottom = None
        delta = 0
        while node is not root:
            node.ref_count -= 1
            if node.ref_count == 0:
                delta += node.length
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        if bottom is not None:
            self._leaves.push(bottom)

    # --------------------------------------------------------------- priority
    def set_priority(self, node: TreeNode, priority: int) -> None:
        """Set the priority of `node` and every node above it (higher = evicted later,
        under the "priority" policy). Assigns, so it can lower a path as well as raise it."""
        if node is self.root:
            return
        if node.parent is None:
            raise StaleHandle(f"set_priority of a node no longer in the tree: {node!r}")
        bottom = node
        while node.length:
            node.priority = priority
            node = node.parent
        if bottom.ref_count == 0 and not bottom.children:
            self._leaves.push(bottom)  # its key may have dropped: re-queue it now

    # ------------------------------------------------------------------ evict
    def evict(self, n_tokens: int, on_evict: OnEvict | None = None) -> np.ndarray:
        """Remove unlocked leaves in policy order until at least `n_tokens` tokens are
        freed (or nothing evictable is left); parents that become unlocked leaves are
        candidates in turn. Returns the freed slots; the caller returns them to its
        allocator. `on_evict` sees each node (as an EvictedSegment) before it goes; if it
        raises, that node stays and the slots already freed by this call are attached to
        the exception as `evicted_slots`.
        """
        return self._evict_leaves(n_tokens, on_evict, None)

    def evict_namespaces(self, matches: Callable[[Hashable], bool],
                         on_evict: OnEvict | None = None) -> np.ndarray:
        """Remove every unlocked entry of the namespaces `matches` accepts (a tenant's
        flush); other namespaces are untouched. Returns the freed slots, as `evict`."""
        return self._evict_leaves(self._evictable, on_evict, matches)

    def _evict_leaves(self, n_tokens: int, on_evict: OnEvict | None,
                      matches: Callable[[Hashable], bool] | None) -> np.ndarray:
        freed: list[np.ndarray] = []
        skipped: list[TreeNode] = []  # leaves of other namespaces: back in the heap after
        got = 0
        pop = self._leaves.pop
        try:
            while got < n_tokens:
                node = pop()
                if node is None:
                    break
                if matches is not None and not matches(node.namespace):
                    skipped.append(node)
                    continue
                if on_evict is not None:
                    try:
                        on_evict(evicted_segment(node))
                    except BaseException as e:
                        # This node stays (and stays evictable); what was already removed
                        # rides on the exception so the caller can still free it.
                        self._leaves.push(node)
                        self._evictable -= got
                        e.evicted_slots = join_slots(freed)  # type: ignore[attr-defined]
                        raise
                parent = node.parent
                assert parent is not None
                del parent.children[node.key_bytes[: self._page_bytes]]
                node.parent = None
                got += node.length
                freed.append(node.value)
                self._num_nodes -= 1
                if not parent.children and parent.ref_count == 0:
                    if parent.length:
                        self._leaves.push(parent)
                    else:  # an emptied namespace root: drop it so tenants do not accumulate
                        del self.root.children[parent.namespace]
                        parent.parent = None
        finally:
            for node in skipped:
                self._leaves.push(node)
        self._evictable -= got
        return join_slots(freed)

    # ---------------------------------------------------------------- reading
    # (paths.py: they read nodes only, never the tree's accounting or access times)
    path_tokens = staticmethod(path_tokens)
    path_slots = staticmethod(path_slots)

    def check_integrity(self) -> None:
        """Walk the whole tree and verify structure, sizes, ref counts and the evictable
        leaf set; raises AssertionError describing the first inconsistency found."""
        from radixlm.cache.integrity import check_tree

        check_tree(self)

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, policy={self.policy.name!r}, "
            f"nodes={self._num_nodes}, evictable={self._evictable}, "
            f"protected={self._protected})"
        )

