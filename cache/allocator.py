"""PageAllocator: a free list of KV pages handed out as token slots.

Page `p` owns slots `p*P .. p*P+P-1`. Free pages are `_free[_head:]` of one numpy array
used as a stack (alloc takes from `_head`, free pushes back in front of it), so both
cost O(pages) in C with no per-slot Python work. A boolean mask of free pages catches
double frees and frees of never-allocated pages with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from radixlm.cache.errors import CacheError, DoubleFree, InvalidSlots
from radixlm.cache.pages import div_ceil
from radixlm.cache.tokens import EMPTY, as_i64


class PageAllocator:
    def __init__(self, capacity_tokens: int, page_size: int = 1) -> None:
        if int(page_size) != page_size or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        if capacity_tokens < 0 or capacity_tokens % page_size:
            raise ValueError(
                f"capacity_tokens ({capacity_tokens}) must be a non-negative multiple of "
                f"page_size ({page_size})"
            )
        self.page_size = int(page_size)
        self.capacity = int(capacity_tokens)
        self.num_pages = self.capacity // self.page_size
        self._offsets = np.arange(self.page_size, dtype=np.int64)
        self._marks = np.zeros(self.num_pages, dtype=np.int64)  # scratch for free()
        self._arange = np.arange(self.num_pages, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        """Every page free again; a fresh allocator hands out pages 0, 1, 2, ..."""
        self._free = np.arange(self.num_pages, dtype=np.int64)
        self._head = 0
        self._is_free = np.ones(self.num_pages, dtype=bool)

    @property
    def free_pages(self) -> int:
        return self.num_pages - self._head

    @property
    def free_size(self) -> int:
        """Free token slots (a multiple of the page size)."""
        return (self.num_pages - self._head) * self.page_size

    def alloc(self, n_tokens: int) -> np.ndarray:
        """Slots of ceil(n_tokens / P) whole pages (length a multiple of P, page-ordered).

        Raises CacheError when fewer pages are free; `PrefixCache.alloc` evicts first.
        """
        k = div_ceil(n_tokens, self.page_size)
        if k <= 0:
            return EMPTY
        head = self._head
        if k > self.num_pages - head:
            raise CacheError(
                f"PageAllocator: {n_tokens} tokens need {k} pages, only "
                f"{self.num_pages - head} free"
            )
        pages = self._free[head : head + k].copy()
        self._head = head + k
        self._is_free[pages] = False
        if self.page_size == 1:
            return pages
        return (pages[:, None] * self.page_size + self._offsets).ravel()

    def free(self, slots: np.ndarray | Sequence[int]) -> None:
        """Return slots to the free list. They must be whole pages (as `alloc` gave them),
        currently allocated; anything else raises InvalidSlots / DoubleFree."""
        slots = as_i64(slots)
        n = len(slots)
        if n == 0:
            return
        psize = self.page_size
        if psize == 1:
            pages = slots
        else:
            if n % psize:
                raise InvalidSlots(f"free: {n} slots is not a whole number of {psize}-pages")
            pages = slots[::psize] // psize
            expect = (pages[:, None] * psize + self._offsets).ravel()
            if expect.tobytes() != slots.tobytes():
                raise InvalidSlots("free: slots are not whole, page-aligned pages")
        # Ufunc reductions cost several µs each here; argmin/argmax/take/tobytes do not.
        lo, hi = pages[pages.argmin()], pages[pages.argmax()]
        if lo < 0 or hi >= self.num_pages:
            bad = int(lo * psize if lo < 0 else hi * psize)
            raise InvalidSlots(f"free: slot {bad} out of range [0, {self.capacity})")
        was_free = self._is_free.take(pages)
        if was_free[was_free.argmax()]:
            bad = pages[was_free][:8] * psize
            raise DoubleFree(f"free: slots already free (double free?): {bad.tolist()}")
        k = len(pages)
        if k > 1:
            # Duplicates within one call: with fancy assignment the last write wins, so an
            # earlier copy of a page does not read back its own index.
            idx = self._arange[:k]
            self._marks[pages] = idx
            if self._marks.take(pages).tobytes() != idx.tobytes():
                raise DoubleFree("free: the same slot appears twice in one free() call")
        self._push(pages)

    def free_trusted(self, slots: np.ndarray) -> None:
        """`free` without validation, for slots the cache itself just took out of the
        tree (eviction): they are known to be allocated, whole pages, and distinct."""
        if len(slots) == 0:
            return
        psize = self.page_size
        self._push(slots if psize == 1 else slots[::psize] // psize)

    def _push(self, pages: np.ndarray) -> None:
        k = len(pages)
        head = self._head - k
        self._is_free[pages] = True
        self._free[head : self._head] = pages
        self._head = head

    def any_free(self, slots: np.ndarray) -> bool:
        """Whether any of `slots` lies on a free page (an integrity check)."""
        return bool(self._is_free[np.asarray(slots) // self.page_size].any())

    def check_integrity(self) -> None:
        """Free list and free mask agree, with no page listed twice."""
        free = self._free[self._head :]
        if len(np.unique(free)) != len(free):
            raise AssertionError("PageAllocator integrity: a page is on the free list twice")
        if int(self._is_free.sum()) != len(free) or not self._is_free[free].all():
            raise AssertionError("PageAllocator integrity: free mask disagrees with free list")
