"""The FlashInfer backend's use of FlashInfer's API, checked on CPU against a stand-in.

The stand-in implements the documented semantics of `BatchPrefillWithPagedKVCacheWrapper`
and `BatchDecodeWithPagedKVCacheWrapper` (paged NHD cache, page-table CSR arrays,
`last_page_len`, causal mask aligned to the end of each KV sequence) in plain torch, so
this test pins down the plan/run arguments our backend passes; the real kernels are
compared with the torch backend in tests/model/test_gpu_flashinfer.py on a GPU. The stand-in
also follows the documented `window_left` (a query at KV position p sees keys p -
window_left .. p), `logits_soft_cap` (cap * tanh(s / cap) before the mask) and `sm_scale`,
for Gemma's and Mistral's layers (not yet run on a GPU: the real wrappers' use of them is
GPU-unverified).
"""

from __future__ import annotations

import types

import pytest
import torch
from radixlm.cache import KVPool
from radixlm.runtime.attention import flashinfer_backend
from radixlm.runtime.attention.torch_backend import TorchAttention
from radixlm.runtime.model import BatchRequest, ForwardBatch
from tiny_models import PageSlots


class _Wrapper:
    decode = False

    def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8

    def _plan(self, qo, indptr, indices, last, H, Hkv, D, P, q_data_type, kv_data_type,
              window_left=-1, logits_soft_cap=None, sm_scale=None):  # fmt: skip
        for t in (qo, indptr, indices, last):
            assert t.dtype == torch.int32
        assert q_data_type == kv_data_type
        assert indptr.shape[0] == last.shape[0] + 1 == qo.shape[0]
        self.qo, self.indptr = qo.tolist(), indptr.tolist()
        self.indices, self.last = indices.tolist(), last.tolist()
        self.H, self.Hkv, self.D, self.P = H, Hkv, D, P
        self.window_left, self.cap = window_left, logits_soft_cap
        self.scale = D**-0.5 if sm_scale is None else sm_scale

    def run(self, q, paged_kv_cache):
        k_pages, v_pages = paged_kv_cache
        assert k_pages.shape[1:] == (self.P, self.Hkv, self.D)
        out = torch.empty_like(q)
        for r in range(len(self.last)):
            pages = self.indices[self.indptr[r] : self.indptr[r + 1]]
            kv_len = (len(pages) - 1) * self.P + self.last[r]
            k = k_pages[pages].reshape(-1, self.Hkv, self.D)[:kv_len].transpose(0, 1)
            v = v_pages[pages].reshape(-1, self.Hkv, self.D)[:kv_len].transpose(0, 1)
            qs, qe = self.qo[r], self.qo[r + 1]
            n = qe - qs
            mask = torch.ones(n, kv_len, dtype=torch.bool).tril(kv_len - n)  # end-aligned causal
            if self.window_left >= 0:  # keys from the query's position - window_left on
                mask &= torch.ones(n, kv_len, dtype=torch.bool).triu(kv_len - n - self.window_left)
            qh = q[qs:qe].transpose(0, 1)
            kh = k.repeat_interleave(self.H // self.Hkv, 0)
            vh = v.repeat_interleave(self.H // self.Hkv, 0)
            scores = qh @ kh.transpose(1, 2) * self.scale
            if self.cap:
                scores = self.cap * torch.tanh(scores / self.cap)
            o = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vh
            out[qs:qe] = o.transpose(0, 1)
        return out


class _Prefill(_Wrapper):
    def plan(self, qo, indptr, indices, last, H, Hkv, D, P, *, causal, pos_encoding_mode,
             q_data_type, kv_data_type, **documented):  # fmt: skip
        assert causal and pos_encoding_mode == "NONE"
        self._plan(qo, indptr, indices, last, H, Hkv, D, P, q_data_type, kv_data_type, **documented)


class _Decode(_Wrapper):
    def plan(self, indptr, indices, last, H, Hkv, D, P, *, pos_encoding_mode, q_data_type,
             kv_data_type, **documented):  # fmt: skip
        assert pos_encoding_mode == "NONE"
        qo = torch.arange(last.shape[0] + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last, H, Hkv, D, P, q_data_type, kv_data_type, **documented)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    fake = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_Prefill, BatchDecodeWithPagedKVCacheWrapper=_Decode
    )
    monkeypatch.setattr(flashinfer_backend, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_backend, "available", lambda: True)
    monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 1024)


def _ids(n, seed):
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


VARIATIONS = {
    "plain": {},
    # Gemma 2: a sliding layer (window 5) beside a global one, soft-capped scores, its own scale.
    "windows-softcap-scale": dict(windows=[5, None], softcap=3.0, scale=0.3),
}


@pytest.mark.parametrize("variation", sorted(VARIATIONS))
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_backend_drives_flashinfer_api_as_documented(fake_flashinfer, page_size, variation):
    H, Hkv, D, cap = 4, 2, 8, 1024
    kw = VARIATIONS[variation]
    layers = len(kw.get("windows", [None]))
    torch.manual_seed(0)
    pools = [KVPool(layers, Hkv, D, cap, page_size, torch.float32, "cpu") for _ in range(2)]
    cpu = torch.device("cpu")
    fi = flashinfer_backend.FlashInferAttention(
        pools[0], H, Hkv, D, cpu, torch.float32, check_pages=True, **kw
    )
    ref = TorchAttention(pools[1], H, Hkv, D, cpu, torch.float32, **kw)
    pages = PageSlots(cap, page_size, seed=3)
    shared = pages.extend([], 2 * page_size + 3)
    a = pages.extend([], 5)
    steps = [
        [BatchRequest(_ids(len(shared), 1), 0, shared)],
        [BatchRequest(_ids(5, 2), 0, a), BatchRequest(_ids(6, 3), None, pages.extend(shared, 6))],
        [BatchRequest([7], None, (a := pages.extend(a, 1)))],
        [
            BatchRequest([8], None, (a := pages.extend(a, 1))),
            BatchRequest(_ids(9, 4), None, pages.extend(shared, 9)),
            BatchRequest([1], None, pages.extend(shared, 1)),
        ],  # fmt: skip
    ]
    for reqs in steps:
        batch = ForwardBatch.build(reqs)
        T = batch.num_tokens
        q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
        fi.plan(batch)
        ref.plan(batch)
        assert all(isinstance(w, _Decode if batch.is_decode else _Prefill) for w in fi.planned.values())
        for layer in range(layers):
            got, want = fi.forward(layer, q, k, v), ref.forward(layer, q, k, v)
            assert (got - want).abs().max().item() < 1e-5


def test_page_check_rejects_inconsistent_slots(fake_flashinfer):
    pool = KVPool(1, 2, 8, 64, 4, torch.float32, "cpu")
    fi = flashinfer_backend.FlashInferAttention(
        pool, 4, 2, 8, torch.device("cpu"), torch.float32, check_pages=True
    )
    with pytest.raises(ValueError, match="page"):
        fi.plan(ForwardBatch.build([([1, 2, 3], 0, [4, 5, 7])]))
