"""One tenant's held breakpoint prefixes: which token prefixes are held in the engine, by
which session, until when.

A `Hold` is an engine session of the tenant's connection (retention *hard*, idle TTL the
breakpoint's) whose history is exactly a breakpoint's prefix, so its KV is locked in the
tenant's cache: other traffic, of any tenant, cannot evict it until it expires. A hold is
found by the digest of its token ids (`PrefixKeys`): a request hits it when its own
prompt starts with those tokens. Holds expire `ttl_s` after their last use (each use
restarts the clock, in the engine too: see `prompt_cache.touch`); expired ones are taken
out by `expired` (their sessions are closed by the caller).

Pure bookkeeping: no I/O here, and the clock is injectable (tests run it by hand).
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

TOKEN_BYTES = 4  # ids are packed as int32 for hashing and comparing


def pack(ids: Sequence[int]) -> bytes:
    return array("i", ids).tobytes()


def common_prefix(a: bytes, b: bytes) -> int:
    """Tokens two packed id sequences share at their start (binary search on slices: the
    comparisons run in C)."""
    n = min(len(a), len(b)) // TOKEN_BYTES
    if a[: n * TOKEN_BYTES] == b[: n * TOKEN_BYTES]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * TOKEN_BYTES] == b[: mid * TOKEN_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixKeys:
    """Digests of a prompt's prefixes, at the lengths asked for (hashed once, in order)."""

    def __init__(self, packed: bytes) -> None:
        self.packed = packed
        self.length = len(packed) // TOKEN_BYTES
        self._keys: dict[int, bytes] = {}

    def compute(self, lengths: Iterable[int]) -> None:
        todo = sorted({n for n in lengths if 0 < n <= self.length and n not in self._keys})
        h = hashlib.blake2b(digest_size=16)
        at = 0
        for n in todo:
            h.update(self.packed[at * TOKEN_BYTES: n * TOKEN_BYTES])
            at = n
            self._keys[n] = h.copy().digest()

    def key(self, length: int) -> bytes:
        if length not in self._keys:
            self.compute([length])
        return self._keys[length]


@dataclass(eq=False)
class Hold:
    session: str
    length: int  # tokens held
    key: bytes  # digest of those tokens (`PrefixKeys`)
    block: int  # the block of the breakpoint that wrote it (for Anthropic's lookback)
    ttl_s: float
    expires_at: float


class PrefixHolds:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by_length: dict[int, dict[bytes, Hold]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Hold]:
        for holds in self._by_length.values():
            yield from holds.values()

    def live(self, hold: Hold) -> bool:
        return hold.expires_at > self.clock()

    def matching(self, keys: PrefixKeys) -> list[Hold]:
        """Live holds whose tokens the prompt starts with, longest first."""
        lengths = [n for n in self._by_length if n <= keys.length]
        keys.compute(lengths)
        found = []
        for n in sorted(lengths, reverse=True):
            hold = self._by_length[n].get(keys.key(n))
            if hold is not None and self.live(hold):
                found.append(hold)
        return found

    def get(self, length: int, key: bytes) -> Hold | None:
        hold = self._by_length.get(length, {}).get(key)
        return hold if hold is not None and self.live(hold) else None

    def add(self, hold: Hold) -> Hold | None:
        """Register `hold`; returns the hold it replaces (whose session is to be closed)."""
        same = self._by_length.setdefault(hold.length, {})
        old = same.get(hold.key)
        same[hold.key] = hold
        if old is None:
            self._count += 1
        return old

    def refresh(self, hold: Hold) -> None:
        hold.expires_at = self.clock() + hold.ttl_s

    def drop(self, hold: Hold) -> bool:
        same = self._by_length.get(hold.length)
        if same is None or same.get(hold.key) is not hold:
            return False
        del same[hold.key]
        if not same:
            del self._by_length[hold.length]
        self._count -= 1
        return True

    def expired(self) -> list[Hold]:
        """Take out every hold past its TTL."""
        now = self.clock()
        gone = [h for h in self if h.expires_at <= now]
        for hold in gone:
            self.drop(hold)
        return gone
