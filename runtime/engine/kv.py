"""A request's KV through the seed's §4.2 lifecycle, on a `PrefixCache`.

match → `attach` (lock the handle, copy its slots) → `grow` (allocate only the uncached
suffix, page by page) → `cache_prefix` (insert computed tokens, free the duplicates at
once, optionally move the lock) → `detach` (unlock, free what never joined the tree).
Every function keeps `Request.private == alloc_len - tree_len` exact, which is what
the pool invariant free + evictable + protected + private == capacity is checked with.
"""

from __future__ import annotations

import numpy as np
from radixlm.cache import MatchResult, PrefixCache, TreeNode
from radixlm.runtime.engine.request import Request


def align_down(n: int, page_size: int) -> int:
    return n - n % page_size


def attach(cache: PrefixCache, req: Request, match: MatchResult) -> None:
    """Lock the matched prefix and make it the start of the request's slot table."""
    assert req.locked is None and req.alloc_len == 0, req
    cache.lock(match.node)
    m = match.length
    req.locked = match.node
    req.slots[:m] = match.slots
    req.kv_len = req.tree_len = req.alloc_len = m


def grow(cache: PrefixCache, req: Request, upto: int) -> None:
    """Allocate private pages so positions `[0, upto)` all have slots. Evicts unlocked
    leaves when short; raises OutOfSlots (nothing changed) when even that is not enough."""
    need = upto - req.alloc_len
    if need <= 0:
        return
    new = cache.alloc(need)
    end = req.alloc_len + len(new)
    req.slots[req.alloc_len : end] = new
    req.alloc_len = end


def cache_prefix(cache: PrefixCache, req: Request, upto: int, relock: bool) -> TreeNode:
    """Insert `tokens[:upto]` (cut to whole pages; at most what has KV) into the tree;
    returns the node ending there (the locked node when nothing new was inserted).

    Slots the tree already had are freed at once (duplicates). With `relock`, the
    request's slot table is re-pointed at the tree's copies and the lock moves to the new
    node (lock new, then unlock old), so the request keeps computing on a protected path.
    """
    end = align_down(min(upto, req.kv_len), cache.page_size)
    old = req.locked
    assert old is not None
    if end <= req.tree_len:
        return old
    ns = req.group.namespace
    res = cache.insert(req.tokens[:end], req.slots[:end], ns)
    start = req.tree_len
    if res.cached_len > start:
        cache.free(req.slots[start : res.cached_len].copy())
        if relock:
            req.slots[start : res.cached_len] = path_slots(res.node, start, res.cached_len)
    req.tree_len = end
    if relock:
        cache.lock(res.node)
        cache.unlock(old)
        req.locked = res.node
    return res.node


def detach(cache: PrefixCache, req: Request) -> None:
    """Unlock the request's node and free its private slots; the request holds no KV after."""
    private = req.slots[req.tree_len : req.alloc_len]
    if len(private):
        cache.free(private.copy())
    if req.locked is not None:
        cache.unlock(req.locked)
    req.locked = None
    req.kv_len = req.tree_len = req.alloc_len = 0


def path_slots(node: TreeNode, start: int, end: int) -> np.ndarray:
    """Tree slots of positions `[start, end)` on the path ending at `node` (depth >= end)."""
    parts: list[np.ndarray] = []
    n: TreeNode | None = node
    while n is not None and n.depth > start:
        lo = n.depth - n.length
        if lo < end:
            parts.append(n.value[max(start - lo, 0) : min(end, n.depth) - lo])
        n = n.parent
    parts.reverse()
    return np.concatenate(parts) if len(parts) > 1 else parts[0]
