"""A request's cache lifecycle, step by step, on a PrefixCache: match, lock, allocate
only the suffix, insert, unlock, and evict/free under pressure."""

from __future__ import annotations

import numpy as np
from radixlm.cache import PrefixCache

S = [900, 10, 11, 12]
R1 = S + [31, 32]
R2 = S + [41, 42, 43]


def test_r1_r2_lifecycle() -> None:
    pc = PrefixCache(capacity_tokens=8)
    # history: S is cached in p0..p3, unreferenced
    s_slots = pc.alloc(4)
    assert s_slots.tolist() == [0, 1, 2, 3]
    assert pc.insert(S, s_slots).cached_len == 0
    pc.check_integrity()

    # Step 1 match: both requests hit S; a match is not a reservation
    m1, m2 = pc.match(R1), pc.match(R2)
    assert (m1.length, m1.slots.tolist()) == (4, [0, 1, 2, 3])
    assert (m2.length, m2.slots.tolist()) == (4, [0, 1, 2, 3])
    assert pc.sizes().protected == 0

    # Step 3 lock (R1 was scheduled first: shorter uncached suffix)
    pc.lock(m1.node)
    assert (pc.sizes().evictable, pc.sizes().protected) == (0, 4)

    # Step 4 allocate only the gap [31, 32]
    new = pc.alloc(len(R1) - m1.length)
    assert len(new) == 2 and not set(new.tolist()) & {0, 1, 2, 3}
    table = np.concatenate([m1.slots, new])
    pc.check_integrity(private=2)

    # Step 5 insert after prefill: S is reused, only [31, 32] -> new slots joins
    r = pc.insert(R1, table)
    assert r.cached_len == 4  # nothing duplicated beyond what R1 matched itself
    assert r.node.tokens.tolist() == [31, 32] and r.node.slots.tolist() == new.tolist()
    pc.lock(r.node)  # move the request's lock to its own end node
    pc.unlock(m1.node)
    pc.check_integrity()

    # Step 6 finish: unlock; nothing is freed, [31, 32] and S stay cached
    pc.unlock(r.node)
    assert pc.sizes() == (8, 2, 6, 0)

    # Step 7 R2 runs: lock S, then need 3 slots with only 2 free -> evict.
    pc.lock(m2.node)
    got = pc.alloc(len(R2) - m2.length)
    assert len(got) == 3
    # the unreferenced leaf [31, 32] was evicted: R1's private slots came back ...
    assert set(new.tolist()) <= set(got.tolist())
    assert pc.match(R1).length == 4
    # ... and never the locked, shared S
    assert pc.match(S).slots.tolist() == [0, 1, 2, 3]
    assert not set(got.tolist()) & {0, 1, 2, 3}
    pc.check_integrity(private=3)

    r2 = pc.insert(R2, np.concatenate([m2.slots, got]))
    assert r2.cached_len == 4
    pc.unlock(m2.node)
    pc.check_integrity()
    assert pc.sizes() == (8, 1, 7, 0)


def test_insert_race_frees_duplicates() -> None:
    """Two requests prefill the same uncached suffix; the second insert reports the
    overlap, and the caller frees its duplicate slots at once (no leak)."""
    pc = PrefixCache(16)
    tokens = [1, 2, 3, 4, 5]
    ma, mb = pc.match(tokens), pc.match(tokens)
    pc.lock(ma.node)
    pc.lock(mb.node)
    sa, sb = pc.alloc(5), pc.alloc(5)
    ra = pc.insert(tokens, sa)
    rb = pc.insert(tokens, sb)
    assert (ra.cached_len, rb.cached_len) == (0, 5)
    pc.free(sb[mb.length : rb.cached_len])  # B's duplicates
    pc.check_integrity()
    assert pc.match(tokens).slots.tolist() == sa.tolist()


def test_finish_with_output_and_page_tail() -> None:
    """page_size 4: prompt+output inserted at finish, the partial last page freed."""
    pc = PrefixCache(64, page_size=4)
    prompt = list(range(10))
    m = pc.match(prompt)
    pc.lock(m.node)
    table = np.concatenate([m.slots, pc.alloc(len(prompt) - m.length)])  # 12 slots
    r = pc.insert(prompt, table[: len(prompt)])  # 8 tokens join (two pages)
    pc.lock(r.node)
    pc.unlock(m.node)
    owned_from = r.node.depth
    output = [50, 51, 52, 53, 54]
    full = prompt + output  # 15 tokens -> 16 slots
    table = np.concatenate([table, pc.alloc(len(full) - len(table))])
    pc.check_integrity(private=len(table) - owned_from)
    rf = pc.insert(full, table[: len(full)])
    assert rf.cached_len == 8 and rf.node.depth == 12
    pc.free(table[rf.node.depth :])  # the unfinished page never joins the tree
    pc.unlock(r.node)
    pc.check_integrity()
    assert pc.sizes() == (64, 52, 12, 0)
