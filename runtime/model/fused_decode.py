"""Batch-1 decode through all layers in one call of the C kernel (`decode_layers`).

A one-token step of one request is a few hundred tiny operations; dispatched one by one
from Python their overhead outweighs the arithmetic (profiled: ~370 torch ops a step on
SmolLM2). When every layer's matrices are quantized (`QuantWeight`) and the layers have no
q/k norms, `FusedDecode` runs the whole stack in one kernel call: one OpenMP region, the
matrix products split across threads, K/V of the new token written straight into the pool,
attention over the request's slots. Everything else (batches, prefill, dense weights) takes
the ordinary per-op path. The embedding row, final norm and LM head stay in Python.
"""

from __future__ import annotations

import ctypes

import torch

from .decoder import DecoderModel
from .qkernel import kernel
from .quant import QuantWeight

_NORMS = ("in_norm", "post_norm")
_MATS = (("w_qkv_t", "b_qkv"), ("w_o_t", "b_o"), ("w_gu_t", "b_gu"), ("w_down_t", "b_down"))


def _ptr(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError("fused decode needs contiguous float32 norms and biases")
    return t.data_ptr()


def _layer_row(layer) -> list[int]:
    """The layer's `table` entries: norms, then codes, d, m, qtype, bias per matrix."""
    row = [_ptr(getattr(layer, name)) for name in _NORMS]
    for mat, bias in _MATS:
        w: QuantWeight = getattr(layer, mat)
        row += [w.codes.data_ptr(), w.d.data_ptr(), 0 if w.m is None else w.m.data_ptr(),
                w.qtype, _ptr(getattr(layer, bias))]
    return row


class FusedDecode:
    """The batch-1 decode step of `model` over `pool` as one kernel call."""

    def __init__(self, model: DecoderModel, pool):
        c = model.config
        self.model = model
        self.table = torch.tensor([_layer_row(layer) for layer in model.layers], dtype=torch.int64)
        self.kv = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(pool.k, pool.v, strict=True)],
                               dtype=torch.int64)  # fmt: skip
        self.pool = pool  # keeps the buffers the pointers name alive
        self.dims = (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                     c.intermediate_size)  # fmt: skip
        self.eps = ctypes.c_float(c.rms_norm_eps)
        self.work = torch.empty(0)

    @staticmethod
    def supported(model: DecoderModel, pool) -> bool:
        """Quantized layer matrices, no q/k norms, float32 CPU pool of contiguous layers."""
        if model.device.type != "cpu" or model.dtype != torch.float32:
            return False
        for layer in model.layers:
            mats = (layer.w_qkv_t, layer.w_o_t, layer.w_gu_t, layer.w_down_t)
            if not all(isinstance(w, QuantWeight) for w in mats) or layer.qk_norm is not None:
                return False
        c = model.config
        return c.head_dim <= 512 and all(
            t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and tuple(t.shape[1:]) == (c.num_kv_heads, c.head_dim)
            for t in (*pool.k, *pool.v)
        )  # fmt: skip

    @staticmethod
    def applies(batch) -> bool:
        """One request with one new token (and its logits row)."""
        return batch.input_ids.shape[0] == 1 and len(batch.extend_lens) == 1

    def forward_hidden(self, batch) -> torch.Tensor:
        """The last layer's hidden state `[1, hidden]` (pre final norm); writes the new K/V."""
        m = self.model
        hidden, n_layers, nh, nkv, hd, inter = self.dims
        if isinstance(m.embed, QuantWeight):
            x = m.embed.dequantize(batch.input_ids)
        else:
            x = m.embed[batch.input_ids].contiguous()
        cos, sin = m.rotary.cos_sin(batch.positions)
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = batch.kv_indices_cpu if batch.kv_indices_cpu is not None else batch.kv_indices
        slots = slots.to(torch.int64).contiguous()
        k = kernel()
        need = k.decode_work_floats(hidden, nh, nkv, hd, inter, slots.numel())
        if self.work.numel() < need:
            self.work = torch.empty(max(need, 2 * self.work.numel()))
        rc = k.decode_layers(
            x.data_ptr(), hidden, n_layers, self.table.data_ptr(), self.kv.data_ptr(), nh, nkv,
            hd, inter, self.eps, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), slots.numel(),
            self.work.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode_layers refused the model's shapes (code {rc})")
        return x
