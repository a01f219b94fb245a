"""FlashInfer attention on CUDA over the paged NHD view of the KV pool.

The pool's per-layer `[capacity, H, D]` tensors are viewed as `[num_pages, P, H, D]`
(FlashInfer's NHD paged layout). A request's page table is derived from its slot list:
`pages = slots[::P] // P`, `last_page_len = seq_len - (num_pages - 1) * P`. This requires
page-consistent slot lists (position j of a request sits in slot `pages[j // P] * P + j % P`),
which the page allocator guarantees; `check_pages=True` (or RADIXLM_CHECK_PAGES=1) verifies it.

Pure-decode batches use `BatchDecodeWithPagedKVCacheWrapper`; anything with a multi-token
request uses `BatchPrefillWithPagedKVCacheWrapper` with `causal=True` (FlashInfer aligns the
causal mask to the end of the KV sequence, i.e. causal with the prefix as offset).
Import-guarded: `available()` is False without CUDA or without the `flashinfer` package.

Sliding windows, soft-caps and a scale other than head_dim ** -0.5 (Gemma, Mistral,
Phi-3) are passed to `plan` as FlashInfer's documented `window_left` (the keys a query
sees to its left besides its own position: W - 1 for a window of W tokens),
`logits_soft_cap` (cap * tanh(s / cap)) and `sm_scale`. A wrapper's plan fixes its
window, so each distinct window of the model's layers has its own pair of wrappers over
the one workspace (they run one after another on one stream). GPU-unverified: written
from FlashInfer's API documentation and checked on CPU against a stand-in that follows it
(tests/model/test_flashinfer_contract.py), never yet run on the real kernels.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from radixlm.cache.pages import div_ceil

from .base import AttentionBackend

try:  # pragma: no cover - not installed on CPU machines
    import flashinfer  # type: ignore[import-not-found]

    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 - any import failure means "not available"
    flashinfer = None
    _IMPORT_ERROR = e

WORKSPACE_BYTES = 256 * 1024 * 1024


def available() -> bool:
    return flashinfer is not None and torch.cuda.is_available()


def unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if flashinfer is None:
        return f"flashinfer is not importable ({_IMPORT_ERROR!r})"
    return None


def page_table(
    kv_indices: np.ndarray, seq_lens, page_size: int, check: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(page_indptr[B+1], page_ids[sum pages], last_page_len[B])` from per-request slot lists."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    P = page_size
    kv_starts = np.zeros(seq.shape[0] + 1, dtype=np.int64)
    np.cumsum(seq, out=kv_starts[1:])
    npages = div_ceil(seq, P)
    page_indptr = np.zeros(seq.shape[0] + 1, dtype=np.int64)
    np.cumsum(npages, out=page_indptr[1:])
    total = int(page_indptr[-1])
    req_of_page = np.repeat(np.arange(seq.shape[0]), npages)
    j = np.arange(total, dtype=np.int64) - page_indptr[:-1][req_of_page]
    first_slots = kv_indices[kv_starts[:-1][req_of_page] + j * P]
    page_ids = first_slots // P
    last_len = seq - (npages - 1) * P
    if check:
        if np.any(first_slots % P):
            raise ValueError("slot lists are not page-aligned: a page does not start at slot p*P")
        req_of_slot = np.repeat(np.arange(seq.shape[0]), seq)
        pos = np.arange(kv_indices.shape[0], dtype=np.int64) - kv_starts[:-1][req_of_slot]
        expect = page_ids[page_indptr[:-1][req_of_slot] + pos // P] * P + pos % P
        if not np.array_equal(expect, kv_indices):
            raise ValueError("slot lists are not page-consistent (slot != page*P + offset)")
    return page_indptr, page_ids, last_len


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        pool,
        num_heads,
        num_kv_heads,
        head_dim,
        device,
        dtype,
        check_pages=None,
        prefill_backend=None,
        **variations,
    ):
        super().__init__(pool, num_heads, num_kv_heads, head_dim, device, dtype, **variations)
        if not available():
            raise RuntimeError(f"flashinfer backend unavailable: {unavailable_reason()}")
        if check_pages is None:
            check_pages = os.environ.get("RADIXLM_CHECK_PAGES", "") not in ("", "0")
        self.check_pages = check_pages
        self.page_size = int(pool.page_size)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # FlashInfer picks FA2/FA3 itself ("auto"); RADIXLM_FLASHINFER_PREFILL_BACKEND=fa2
        # (or prefill_backend="fa2") forces one, should a kernel variant misbehave.
        prefill_backend = prefill_backend or os.environ.get(
            "RADIXLM_FLASHINFER_PREFILL_BACKEND", "auto"
        )
        kw = {} if prefill_backend == "auto" else {"backend": prefill_backend}
        # One (prefill, decode) wrapper pair per distinct layer window (None: full).
        self.wrappers = {
            w: (flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", **kw),
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=self.group >= 4))
            for w in sorted(set(self.windows or (None,)), key=lambda w: -1 if w is None else w)
        }  # fmt: skip
        self.prefill_wrapper, self.decode_wrapper = next(iter(self.wrappers.values()))
        self.paged = [(pool.k_pages(i), pool.v_pages(i)) for i in range(len(pool.k))]
        self.wrapper = None
        self.planned: dict[int | None, object] = {}  # window -> the wrapper planned for it

    def _plan_options(self, window: int | None) -> dict:
        """`plan` keywords beyond a plain causal model's (only those that apply, so a plain
        model's plan is as before). GPU-unverified (see the module docstring)."""
        extra: dict = {}
        if window is not None:
            extra["window_left"] = window - 1  # a window of W tokens: W - 1 to the left
        if self.softcap is not None:
            extra["logits_soft_cap"] = self.softcap
        if self.scale != self.head_dim**-0.5:
            extra["sm_scale"] = self.scale
        return extra

    def plan(self, batch) -> None:
        kv_cpu = batch.kv_indices_cpu
        if kv_cpu is None:
            kv_cpu = batch.kv_indices.cpu()
        page_indptr, page_ids, last_len = page_table(
            kv_cpu.numpy(), batch.seq_lens, self.page_size, self.check_pages
        )
        dev = self.device
        i32 = torch.int32
        indptr_t = torch.from_numpy(page_indptr).to(dev, i32)
        ids_t = torch.from_numpy(page_ids).to(dev, i32)
        last_t = torch.from_numpy(last_len).to(dev, i32)
        self.out_slots = batch.out_slots
        self.num_tokens = batch.num_tokens
        H, Hkv, D, P = self.num_heads, self.num_kv_heads, self.head_dim, self.page_size
        if not batch.is_decode:
            qo = np.zeros(batch.batch_size + 1, dtype=np.int64)
            np.cumsum(batch.extend_lens, out=qo[1:])
            qo_t = torch.from_numpy(qo).to(dev, i32)
        for window, (prefill, decode) in self.wrappers.items():
            extra = self._plan_options(window)
            if batch.is_decode:
                decode.plan(
                    indptr_t, ids_t, last_t, H, Hkv, D, P,
                    pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype,
                    **extra,
                )  # fmt: skip
                self.planned[window] = decode
            else:
                prefill.plan(
                    qo_t, indptr_t, ids_t, last_t, H, Hkv, D, P,
                    causal=True, pos_encoding_mode="NONE",
                    q_data_type=self.dtype, kv_data_type=self.dtype, **extra,
                )  # fmt: skip
                self.planned[window] = prefill
        self.wrapper = self.planned.get(None)

    def forward(self, layer_id, q, k, v):
        kc, vc = self.pool.k[layer_id], self.pool.v[layer_id]
        kc.index_copy_(0, self.out_slots, k)
        vc.index_copy_(0, self.out_slots, v)
        o = self.planned[self.window(layer_id)].run(q.contiguous(), self.paged[layer_id])
        return o.reshape(self.num_tokens, self.num_heads * self.head_dim)
