"""The C kernel's prefill attention (kernels/attend.c, attention/cpu_prefill.py), which the
torch backend uses for prompt chunks on CPU where it applies: every planner variant (a
fresh chunk on its own K/V, a cached prefix read through consecutive slots, scattered
slots, several prefills and a decode in one batch), grouped-query shapes, head dims, pool
dtypes and sliding windows give the outputs of a float64 reference and of the backend's
SDPA path; shapes the kernel does not take fall back to SDPA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from radixlm.cache import KVPool
from radixlm.runtime.attention import TorchAttention
from radixlm.runtime.attention import cpu_prefill as cpu_prefill_module
from radixlm.runtime.model import BatchRequest, ForwardBatch
from radixlm.runtime.model.qkernel import kernel

pytestmark = pytest.mark.skipif(not kernel().attend_supported, reason="the kernel's attention needs AVX-512")

CAPACITY = 512


def setup(h: int, hkv: int, d: int, dtype: torch.dtype, window: int | None, seed: int):
    pool = KVPool(1, hkv, d, CAPACITY, 1, dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    pool.k[0].copy_(torch.randn(CAPACITY, hkv, d, generator=g).to(dtype))
    pool.v[0].copy_(torch.randn(CAPACITY, hkv, d, generator=g).to(dtype))
    windows = None if window is None else [window]
    kernel_side = TorchAttention(pool, h, hkv, d, torch.device("cpu"), torch.float32, windows=windows)
    sdpa_side = TorchAttention(pool, h, hkv, d, torch.device("cpu"), torch.float32, windows=windows)
    sdpa_side.cpu_prefill = None
    assert kernel_side.cpu_prefill is not None
    return pool, kernel_side, sdpa_side


def batch_of_every_variant(seed: int) -> ForwardBatch:
    """A fresh 37-token chunk, a 70-token chunk after 50 cached tokens in consecutive
    slots, a 21-token chunk after 30 cached tokens in scattered slots, and a decode."""
    rng = np.random.default_rng(seed)
    scattered = (300 + rng.permutation(200)[:51]).tolist()
    return ForwardBatch.build([
        BatchRequest(list(range(37)), 0, list(range(37))),
        BatchRequest(list(range(70)), 50, list(range(100, 220))),
        BatchRequest(list(range(21)), 30, scattered),
        BatchRequest([5], 9, list(range(240, 250))),
    ])  # fmt: skip


def reference(pool: KVPool, batch: ForwardBatch, q, k, v, h, hkv, d, window) -> torch.Tensor:
    """float64, request by request, head by head, over the keys each query may see: the
    pool's rows (the new ones rounded into its dtype), except that a chunk with no cached
    prefix attends its own K/V as computed (the backend does not re-read them)."""
    kc, vc = pool.k[0].double().clone(), pool.v[0].double().clone()
    slots_out = batch.out_slots.long()
    kc[slots_out], vc[slots_out] = k.to(pool.k[0].dtype).double(), v.to(pool.v[0].dtype).double()
    kf, vf = kc.clone(), vc.clone()
    kf[slots_out], vf[slots_out] = k.double(), v.double()
    out = torch.zeros(q.shape[0], h * d, dtype=torch.float64)
    kv, ptr = batch.kv_indices.tolist(), batch.kv_indptr.tolist()
    row = 0
    for r in range(batch.batch_size):
        slots = kv[ptr[r] : ptr[r + 1]]
        n, s = batch.extend_lens[r], len(slots)
        keys, vals = (kf, vf) if n == s and n > 1 else (kc, vc)
        for i in range(n):
            pos = s - n + i
            lo = max(0, pos - window + 1) if window else 0
            seen = slots[lo : pos + 1]
            for head in range(h):
                g = head // (h // hkv)
                scores = keys[seen, g] @ q[row + i, head].double() * d**-0.5
                out[row + i, head * d : (head + 1) * d] = torch.softmax(scores, 0) @ vals[seen, g]
        row += n
    return out.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("h", "hkv", "d"), [(8, 2, 64), (32, 8, 64), (4, 4, 128), (16, 2, 32), (8, 1, 16)])
@pytest.mark.parametrize("window", [None, 16])
def test_prefill_attention_equals_the_reference_and_sdpa(dtype, h, hkv, d, window):
    pool, kernel_side, sdpa_side = setup(h, hkv, d, dtype, window, seed=h + d)
    batch = batch_of_every_variant(seed=d)
    rows = batch.input_ids.shape[0]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(rows, heads, d, generator=g) for heads in (h, hkv, hkv))
    calls = []
    orig = kernel_side.cpu_prefill.attend
    kernel_side.cpu_prefill.attend = lambda *a, **kw: calls.append(1) or orig(*a, **kw)
    want = reference(pool, batch, q, k, v, h, hkv, d, window)
    kernel_side.plan(batch)
    got = kernel_side.forward(0, q, k, v)
    sdpa_side.plan(batch)
    via_sdpa = sdpa_side.forward(0, q, k, v)
    assert len(calls) == 3  # every prefill took the kernel
    assert (got - want).abs().max().item() < 2e-5
    assert (got - via_sdpa).abs().max().item() < 2e-5


def test_shapes_the_kernel_does_not_take_fall_back_to_sdpa():
    """A head dim that is not a multiple of 16 gets no kernel path; the kernel itself
    declines one too (returns 0) and the helper answers None."""
    pool = KVPool(1, 2, 24, 64, 1, torch.float32, "cpu")
    assert TorchAttention(pool, 4, 2, 24, torch.device("cpu"), torch.float32).cpu_prefill is None
    soft = TorchAttention(KVPool(1, 2, 32, 64, 1, torch.float32, "cpu"), 4, 2, 32, torch.device("cpu"),
                          torch.float32, softcap=50.0)  # fmt: skip
    assert soft.cpu_prefill is None
    helper = cpu_prefill_module.CpuPrefill(kernel(), 4, 2, 24, 0.2)
    q, kv = torch.randn(5, 4, 24), torch.randn(5, 2, 24)
    assert helper.attend(q, kv, kv, None, 5, None) is None


def test_the_environment_can_keep_sdpa(monkeypatch):
    monkeypatch.setenv("RADIXLM_PREFILL_ATTENTION", "sdpa")
    pool = KVPool(1, 2, 64, 64, 1, torch.float32, "cpu")
    assert TorchAttention(pool, 8, 2, 64, torch.device("cpu"), torch.float32).cpu_prefill is None
