"""Retained-token accounting: how many distinct cached tokens pins and sessions hold.

Every holder (a pin, an open session) keeps a lock on one path of the radix tree; a
path shared by several holders is retained once. The count is computed from the held
token sequences, not from the tree, so an admission (a pin, an open with input) can be
checked *before* anything is prefilled. The distinct prefixes of a set of sequences are
the nodes of their trie: sum of lengths minus the longest common prefix of each sequence
with its neighbour in sorted order. With pages of P tokens the tree shares whole pages
only, so common prefixes are rounded down to a multiple of P.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

import numpy as np
from radixlm.cache.pages import align_down

# Classes in the order a shared token is attributed (the strongest holder counts it).
RETENTION_CLASSES: tuple[str, ...] = ("pinned", "hard", "soft")


class Held(NamedTuple):
    """One holder's locked path: its namespace and the cached tokens it pins."""

    namespace: Hashable
    tokens: np.ndarray  # int64; the page-aligned cached part of the holder's history


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int64 arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = a[:n] != b[:n]
    i = int(neq.argmax())
    return i if neq[i] else n


def distinct_tokens(held: Iterable[Held], page_size: int = 1) -> int:
    """Tokens in the union of the held paths (shared whole pages counted once); the
    paths are page-aligned."""
    by_ns: dict[Hashable, list[np.ndarray]] = defaultdict(list)
    for h in held:
        if len(h.tokens):
            by_ns[h.namespace].append(h.tokens)
    total = 0
    for seqs in by_ns.values():
        # Any consistent lexicographic order keeps sequences that share a prefix adjacent;
        # raw int64 bytes give one (a prefix sorts before its extensions).
        seqs.sort(key=lambda t: t.tobytes())
        prev: np.ndarray | None = None
        for t in seqs:
            if prev is not None:
                shared = common_prefix_len(prev, t)
                total -= align_down(shared, page_size)
            total += len(t)
            prev = t
    return total


def retained_by_class(held: Sequence[tuple[str, Held]], page_size: int = 1) -> dict[str, int]:
    """Distinct retained tokens per class; a token held by several classes counts for
    the strongest ("pinned" > "hard" > "soft"), so the values sum to the union."""
    out: dict[str, int] = {}
    acc: list[Held] = []
    before = 0
    for cls in RETENTION_CLASSES:
        acc.extend(h for c, h in held if c == cls)
        now = distinct_tokens(acc, page_size)
        out[cls] = now - before
        before = now
    return out
