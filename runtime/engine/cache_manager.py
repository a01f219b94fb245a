"""A request's KV through the cache lifecycle, on a `PrefixCache` (the only way the
scheduler touches the cache).

match → `attach` (lock the handle, copy its slots) → `grow` (allocate only the uncached
suffix, page by page) → `cache_prefix` (insert computed tokens, free the duplicates at
once, optionally move the lock) → `detach` (unlock, free what never joined the tree).
Every method keeps `Request.private == alloc_len - tree_len` exact, which is what the
pool invariant free + evictable + protected + private == capacity is checked with.

When the pool is short even after eviction, `make_room` (given by the scheduler: the
session controller's) may demote idle sessions so their history becomes evictable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from radixlm.cache import MatchResult, OutOfSlots, PrefixCache, TreeNode
from radixlm.cache.pages import align_down, align_up, div_ceil
from radixlm.runtime.engine.request import Request

MakeRoom = Callable[[int], int]  # tokens wanted evictable -> tokens made evictable


class CacheManager:
    def __init__(self, cache: PrefixCache, make_room: MakeRoom) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self._make_room = make_room

    # ------------------------------------------------------------------ sizes
    @property
    def epoch(self) -> int:
        """The cache's eviction epoch: a match taken at another epoch may be stale."""
        return self.cache.epoch

    def available(self) -> int:
        return self.cache.available()

    def pages(self, n: int) -> int:
        """`n` rounded up to whole pages."""
        return align_up(n, self.page_size)

    def make_room(self, need: int) -> int:
        """Ask for idle sessions to be demoted until `need` slots could be had; returns
        what is available afterwards."""
        short = need - self.cache.available()
        if short > 0:
            self._make_room(short)
        return self.cache.available()

    # ------------------------------------------------------------- lifecycle
    def match(self, r: Request) -> MatchResult:
        """The cached prefix of the request, short of what it must compute
        (`Request.compute_from`)."""
        return self.cache.match(r.tokens[: r.compute_from], r.group.namespace)

    def attach(self, r: Request, match: MatchResult) -> None:
        """Lock the matched prefix and make it the start of the request's slot table."""
        assert r.locked is None and r.alloc_len == 0, r
        self.cache.lock(match.node)
        m = match.length
        r.locked = match.node
        r.slots[:m] = match.slots
        r.kv_len = r.tree_len = r.alloc_len = m

    def grow(self, r: Request, upto: int) -> bool:
        """Allocate private pages so positions `[0, upto)` all have slots, evicting
        unlocked leaves and then making room when short; False (nothing changed) when
        even that is not enough."""
        need = upto - r.alloc_len
        if need <= 0:
            return True
        if self._alloc(r, need):
            return True
        return self.make_room(self.pages(need)) >= need and self._alloc(r, need)

    def _alloc(self, r: Request, need: int) -> bool:
        try:
            new = self.cache.alloc(need)
        except OutOfSlots:
            return False
        end = r.alloc_len + len(new)
        r.slots[r.alloc_len : end] = new
        r.alloc_len = end
        return True

    def decode_need(self, needy: Sequence[Request]) -> int:
        """Slots `grow_decodes(needy)` allocates: whole pages up to each next token."""
        psize = self.page_size
        if psize == 1:
            return sum(r.num_tokens - r.alloc_len for r in needy)
        return sum(div_ceil(r.num_tokens - r.alloc_len, psize) for r in needy) * psize

    def grow_decodes(self, needy: Sequence[Request], need: int) -> None:
        """Pages for every request's next token (its `num_tokens` position), in one
        allocation of `need` (`decode_need`) slots the caller has checked are available."""
        psize = self.page_size
        if not need:
            return
        slots = self.cache.alloc(need)
        off = 0
        for r in needy:
            start = r.alloc_len
            end = start + align_up(r.num_tokens - start, psize)
            r.slots[start:end] = slots[off : off + end - start]
            off += end - start
            r.alloc_len = end

    def cache_prefix(self, r: Request, upto: int, relock: bool) -> TreeNode:
        """Insert `tokens[:upto]` (cut to whole pages; at most what has KV) into the tree;
        returns the node ending there (the locked node when nothing new was inserted).

        Slots the tree already had are freed at once (duplicates). With `relock`, the
        request's slot table is re-pointed at the tree's copies and the lock moves to the
        new node (lock new, then unlock old), so the request keeps computing on a
        protected path.
        """
        cache = self.cache
        end = min(upto, r.kv_len)
        end = align_down(end, self.page_size)
        old = r.locked
        assert old is not None
        if end <= r.tree_len:
            return old
        res = cache.insert(r.tokens[:end], r.slots[:end], r.group.namespace)
        start = r.tree_len
        if res.cached_len > start:
            cache.free(r.slots[start : res.cached_len].copy())
            if relock:
                r.slots[start : res.cached_len] = cache.path_slots(res.node, start, res.cached_len)
        r.tree_len = end
        if relock:
            cache.lock(res.node)
            cache.unlock(old)
            r.locked = res.node
        return res.node

    def cache_finished(self, r: Request) -> TreeNode:
        """Insert what the request computed: the prompt first, then prompt + output, so
        the output is its own node (a leaf, evicted before the prompt it hangs off)."""
        limit = min(r.kv_len, r.num_tokens)
        prompt_end = min(r.group.prompt_len, limit)
        if align_down(prompt_end, self.page_size) > r.tree_len:
            self.cache_prefix(r, prompt_end, relock=False)
        return self.cache_prefix(r, limit, relock=False)

    def detach(self, r: Request) -> None:
        """Unlock the request's node and free its private slots; it holds no KV after."""
        private = r.slots[r.tree_len : r.alloc_len]
        if len(private):
            self.cache.free(private.copy())
        if r.locked is not None:
            self.cache.unlock(r.locked)
        r.locked = None
        r.kv_len = r.tree_len = r.alloc_len = 0

    def place_restored(self, r: Request, slots: Sequence[int]) -> int:
        """Take restored history slots (the K/V of the tokens right after the request's
        locked match) as computed: as many as whole pages before the first token it must
        compute allow; the rest are freed. Returns how many were kept."""
        keep = min(len(slots), max(0, r.compute_from - r.kv_len))
        keep = align_down(keep, self.page_size)
        if keep < len(slots):
            self.cache.free(slots[keep:])
        end = r.kv_len + keep
        r.slots[r.kv_len : end] = slots[:keep]
        r.kv_len = r.alloc_len = end
        return keep
