"""Brute-force reference for the radix cache: every cached *page* is a dict entry keyed
by (namespace, the whole token prefix ending with that page). Obviously correct (with
pages, tokens are shared only when their whole page matches), hopelessly slow."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

Key = tuple[Hashable, tuple[int, ...]]


class ReferenceCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[Key, tuple[int, ...]] = {}  # (ns, tokens[:end of page]) -> slots
        self.locks: Counter[Key] = Counter()  # (ns, locked sequence) -> lock count

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _page_keys(self, ns: Hashable, t: tuple[int, ...]) -> list[Key]:
        p = self.page_size
        return [(ns, t[:end]) for end in range(p, self.aligned(len(t)) + 1, p)]

    def match_len(self, tokens: Sequence[int], ns: Hashable) -> int:
        n = 0
        for key in self._page_keys(ns, tuple(tokens)):
            if key not in self.pages:
                break
            n += self.page_size
        return n

    def slots(self, tokens: Sequence[int], ns: Hashable, length: int) -> list[int]:
        keys = self._page_keys(ns, tuple(tokens[:length]))
        return [s for k in keys for s in self.pages[k]]

    def insert(self, tokens: Sequence[int], slots: Sequence[int], ns: Hashable) -> int:
        t = tuple(tokens)
        cached = self.match_len(t, ns)
        p = self.page_size
        for key in self._page_keys(ns, t)[cached // p :]:
            end = len(key[1])
            self.pages[key] = tuple(int(s) for s in slots[end - p : end])
        return cached

    @property
    def total(self) -> int:
        return len(self.pages) * self.page_size

    def protected_keys(self) -> set[Key]:
        out: set[Key] = set()
        for (ns, seq), count in self.locks.items():
            if count:
                out.update(self._page_keys(ns, seq))
        return out

    def sizes(self) -> tuple[int, int]:
        """(evictable, protected) token counts."""
        prot = self.protected_keys()
        assert prot <= self.pages.keys(), "a locked prefix is not cached"
        return self.total - len(prot) * self.page_size, len(prot) * self.page_size

    def remove_slots(self, freed: Sequence[int]) -> None:
        """Apply an eviction: drop the pages whose slots were freed, checking they were
        cached as whole pages, unprotected, and that what stays is still prefix-closed
        (only leaves were taken)."""
        freed_set = {int(s) for s in freed}
        assert len(freed_set) == len(freed), "evict returned a slot twice"
        gone = {k for k, s in self.pages.items() if s[0] in freed_set}
        assert all(set(self.pages[k]) <= freed_set for k in gone), "evict split a page"
        assert len(gone) * self.page_size == len(freed_set), "evict freed an uncached slot"
        assert not gone & self.protected_keys(), "evict freed a locked token"
        for k in gone:
            del self.pages[k]
        p = self.page_size
        for ns, seq in self.pages:
            assert len(seq) == p or (ns, seq[:-p]) in self.pages, "evict removed an inner node"
