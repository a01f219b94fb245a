"""PageAllocator, the PrefixCache facade (alloc with eviction, OutOfSlots, integrity),
and the KV pools."""

from __future__ import annotations

import numpy as np
import pytest
from radixlm.cache import (
    CacheError,
    DoubleFree,
    InvalidSlots,
    OutOfSlots,
    PageAllocator,
    PrefixCache,
)


# -------------------------------------------------------------------- allocator
def test_alloc_hands_out_whole_pages_as_slots() -> None:
    a = PageAllocator(32, page_size=4)
    s = a.alloc(5)  # ceil(5/4) = 2 pages
    assert s.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert a.free_size == 24 and a.free_pages == 6
    assert a.alloc(0).tolist() == []
    a.free(s[4:])
    a.free(s[:4])
    assert a.free_size == 32
    a.check_integrity()


def test_alloc_page1_and_reuse_order() -> None:
    a = PageAllocator(4)
    s = a.alloc(3)
    assert s.tolist() == [0, 1, 2]
    a.free([1])
    assert a.alloc(2).tolist() == [1, 3]  # freed pages are reused first (LIFO)
    with pytest.raises(CacheError, match="only 1 free|only 0 free"):
        a.alloc(2)


def test_allocator_errors_are_clear() -> None:
    a = PageAllocator(16, page_size=4)
    s = a.alloc(8)
    with pytest.raises(InvalidSlots, match="whole number"):
        a.free(s[:3])
    with pytest.raises(InvalidSlots, match="page-aligned"):
        a.free(s[2:6])
    with pytest.raises(InvalidSlots, match="out of range"):
        a.free([16, 17, 18, 19])
    a.free(s[:4])
    with pytest.raises(DoubleFree, match="already free"):
        a.free(s[:4])
    with pytest.raises(DoubleFree, match="twice"):
        a.free(np.concatenate([s[4:], s[4:]]))
    a.check_integrity()
    with pytest.raises(ValueError, match="multiple of page_size"):
        PageAllocator(10, page_size=4)


def test_allocator_integrity_check_fires() -> None:
    a = PageAllocator(8)
    a.alloc(4)
    a._free[a._head] = a._free[-1]  # a page listed twice
    with pytest.raises(AssertionError, match="twice"):
        a.check_integrity()


# ----------------------------------------------------------------- prefix cache
def test_alloc_evicts_unlocked_leaves_when_short() -> None:
    pc = PrefixCache(8)
    s = pc.alloc(6)
    pc.insert([1, 2, 3], s[:3])
    pc.insert([4, 5, 6], s[3:])
    pc.lock(pc.match([4, 5, 6]).node)
    assert pc.sizes() == (8, 2, 3, 3)
    got = pc.alloc(4)  # 2 free + evict the unlocked [1,2,3]
    assert sorted(got.tolist()) == [0, 1, 2, 6]  # 2 free + the 3 evicted ones
    assert pc.match([1, 2, 3]).length == 0 and pc.match([4, 5, 6]).length == 3
    pc.check_integrity(private=4)
    assert pc.sizes().private == 4


def test_out_of_slots_when_even_eviction_cannot_help() -> None:
    pc = PrefixCache(8)
    s = pc.alloc(4)
    node = pc.insert([1, 2, 3, 4], s).node
    pc.lock(node)
    with pytest.raises(OutOfSlots, match=r"requested 6 .* only 4 are free") as e:
        pc.alloc(6)
    assert isinstance(e.value, CacheError)
    assert (e.value.protected, e.value.capacity) == (4, 8)
    pc.check_integrity()
    pc.unlock(node)
    assert len(pc.alloc(8)) == 8  # now eviction can make room
    pc.check_integrity(private=8)


def test_evict_hook_and_facade_evict() -> None:
    seen = []
    pc = PrefixCache(16, page_size=4, on_evict=seen.append)
    s = pc.alloc(8)
    pc.insert(list(range(8)), s)
    assert pc.evict(1) == 8
    assert [seg.tokens.tolist() for seg in seen] == [list(range(8))]
    assert pc.sizes().free == 16
    pc.check_integrity()


def test_prefix_cache_integrity_detects_leaks_and_free_cached_slots() -> None:
    pc = PrefixCache(8)
    s = pc.alloc(3)
    pc.insert([1, 2, 3], s)
    pc.check_integrity()
    pc.alloc(2)  # held privately but not declared
    with pytest.raises(AssertionError, match="capacity"):
        pc.check_integrity()
    pc.check_integrity(private=2)

    pc = PrefixCache(8)
    s = pc.alloc(3)
    pc.insert([1, 2, 3], s)
    pc.allocator.free(s[:1])  # a cached slot handed back: corruption
    with pytest.raises(AssertionError):
        pc.check_integrity()


def test_reset_frees_everything() -> None:
    pc = PrefixCache(8)
    pc.insert([1, 2], pc.alloc(2))
    pc.reset()
    assert pc.sizes() == (8, 8, 0, 0)
    pc.check_integrity()


# ---------------------------------------------------------------------- KV pool
def test_kv_pool_layout_and_host_round_trip() -> None:
    torch = pytest.importorskip("torch")
    from radixlm.cache import HostKVPool, KVPool

    pool = KVPool(2, 3, 4, capacity_tokens=16, page_size=4, dtype=torch.float32)
    assert len(pool.k) == 2 and pool.k[0].shape == (16, 3, 4)
    assert pool.k[1].data_ptr() == pool.k_buffer[1].data_ptr()  # views, not copies
    assert pool.nbytes == 2 * 2 * 16 * 3 * 4 * 4  # K and V, layers, tokens, heads, dim, fp32
    slots = torch.tensor([4, 5, 6])
    k = torch.randn(3, 3, 4)
    v = torch.randn(3, 3, 4)
    pool.k[1][slots], pool.v[1][slots] = k, v
    assert torch.equal(pool.k_buffer[1, 4:7], k)

    host = HostKVPool.like(pool, capacity_tokens=8)
    assert host.device.type == "cpu" and host.k[0].shape == (8, 3, 4)
    host.copy_from_device(pool, np.array([4, 5, 6]), [0, 1, 2])
    assert torch.equal(host.v[1][:3], v)
    pool.k_buffer.zero_()
    pool.v_buffer.zero_()
    host.copy_to_device(pool, [0, 1, 2], torch.tensor([12, 13, 14]))
    assert torch.equal(pool.k[1][12:15], k) and torch.equal(pool.v[1][12:15], v)
    with pytest.raises(ValueError):
        host.copy_to_device(pool, [0, 1], [1])
    with pytest.raises(ValueError):
        KVPool(1, 1, 1, capacity_tokens=10, page_size=4)


@pytest.mark.gpu
def test_kv_pool_on_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from radixlm.cache import HostKVPool, KVPool

    pool = KVPool(2, 2, 8, 64, page_size=16, dtype=torch.bfloat16, device="cuda")
    host = HostKVPool.like(pool)
    assert host.k_buffer.is_pinned()
    idx = torch.arange(10, 20, device="cuda")
    k = torch.randn(10, 2, 8, device="cuda", dtype=torch.bfloat16)
    pool.k[0][idx], pool.v[0][idx] = k, k
    host.copy_from_device(pool, idx, np.arange(10))
    host.copy_to_device(pool, np.arange(10), np.arange(40, 50))
    torch.cuda.synchronize()
    assert torch.equal(pool.k[0][40:50], k)


def test_failing_evict_hook_leaks_nothing() -> None:
    calls = []

    def hook(seg) -> None:
        calls.append(seg)
        if len(calls) == 2:
            raise RuntimeError("host tier full")

    pc = PrefixCache(8)
    unsubscribe = pc.subscribe_evict(hook)
    pc.insert([1, 2], pc.alloc(2))
    pc.insert([3, 4], pc.alloc(2))
    pc.insert([5, 6], pc.alloc(2))
    with pytest.raises(RuntimeError, match="host tier full"):
        pc.evict(6)
    pc.check_integrity()  # the first node's slots came back; the second is still cached
    assert pc.sizes() == (8, 4, 4, 0)
    unsubscribe()
    assert pc.evict(4) == 4
    pc.check_integrity()
