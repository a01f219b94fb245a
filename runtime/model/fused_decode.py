"""Decode steps through all layers in one call of the C kernel (kernels/decode.c).

A one-token step of one request is a few hundred tiny operations; dispatched one by one
from Python their overhead outweighs the arithmetic (profiled: ~370 torch ops a step on
SmolLM2). When every layer's matrices are quantized (`QuantWeight`), `FusedDecode` runs the
whole stack in one kernel call (Qwen3's per-head q/k norms included): one OpenMP region, the
matrix products split across threads, K/V of the new tokens written straight into the
pool (float32, float16 or bfloat16 elements), attention over each request's slots. One
request takes `decode_layers`; 2 to MAX_ROWS decode rows `decode_rows` (the products take
all rows per pass over the weights). Mixture-of-experts layers (Qwen3-MoE, Mixtral,
Qwen2-MoE with its shared expert) run in both (kernels/moe_step.c: the router, each row's choice, the chosen
experts' products, an expert's rows together; `moe_desc`). Everything else (prefill, dense weights) takes the
ordinary per-op path, as does any model the step does not implement
(`DecoderModel.fused_step_blockers`: Gemma's norms, soft-caps, GeGLU, local RoPE; partial
rotary) and any batch with a sequence past a sliding window. The embedding rows and RoPE factors come from a
second, small kernel call (`decode_inputs`: a dozen tensor operations a step, each slow right after the
weight stream has left the caches cold); the final norm and LM head run in Python,
except for one request with a quantized head, whose step ends with them in the same call
(`logits`: no second parallel region, no per-op norm).
"""

from __future__ import annotations

import ctypes

import torch

from .decoder import DecoderModel
from .moe import ExpertMlp
from .qkernel import kernel
from .quant import QuantWeight

MAX_ROWS = 64  # decode rows the batched one-call step (`decode_rows`) takes
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the kernel's codes
ROUTINGS = {"softmax_topk": 0, "topk_softmax": 1}  # moe_step.h's ROUTE_* codes
MAX_TOP_K = 16  # moe_step.h's MOE_MAX_K
_NORMS = ("in_norm", "post_norm")
_MATS = (("w_qkv_t", "b_qkv"), ("w_o_t", "b_o"), ("w_gu_t", "b_gu"), ("w_down_t", "b_down"))


def _ptr(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError("fused decode needs contiguous float32 norms and biases")
    return t.data_ptr()


def _int64(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous int64 tensor (itself when it is one already: no tensor operation)."""
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


def _layer_row(layer, moe: torch.Tensor | None) -> list[int]:
    """The layer's `table` entries: norms, then per matrix its part descriptor (row blocks
    of one type each, `QuantWeight.desc`), part count and bias (a layer of experts has no
    gate_up and down: zeros), then its q/k norm weights and its experts' descriptor."""
    row = [_ptr(getattr(layer, name)) for name in _NORMS]
    for mat, bias in _MATS:
        w: QuantWeight | None = getattr(layer, mat)
        row += [0, 0, 0] if w is None else [w.desc_ptr(), w.nparts, _ptr(getattr(layer, bias))]
    return row + [_ptr(layer.qk_norm), 0 if moe is None else moe.data_ptr()]


def moe_desc(moe: ExpertMlp, keep: list[torch.Tensor]) -> torch.Tensor:
    """The experts' descriptor the kernel reads (kernels/moe_step.h); a float router is
    copied as `[E, hidden]` rows into `keep` (which must outlive the descriptor). Checked
    here once by the kernel's `moe_check` (the steps do not check it again)."""
    c = moe.config
    router = moe.router_t
    if isinstance(router, QuantWeight):
        head = [1, router.desc_ptr(), router.nparts]
    else:
        rows = router.t().contiguous()
        keep.append(rows)
        head = [0, rows.data_ptr(), 0]
    experts = [v for gu, down in zip(moe.gu, moe.down, strict=True)
               for v in (gu.desc_ptr(), gu.nparts, down.desc_ptr(), down.nparts)]  # fmt: skip
    shared = [0] * 6
    if moe.shared_gu is not None:  # Qwen2-MoE: gate+up, down, the [hidden] gate row
        gate = moe.shared_gate_t  # (a packed one is one row: its values as floats)
        gate = (gate.dequantize() if isinstance(gate, QuantWeight) else gate).reshape(-1).float().contiguous()
        keep.append(gate)
        shared = [c.shared_intermediate_size, moe.shared_gu.desc_ptr(), moe.shared_gu.nparts,
                  moe.shared_down.desc_ptr(), moe.shared_down.nparts, gate.data_ptr()]  # fmt: skip
    routing = ROUTINGS[c.routing]
    desc = torch.tensor([c.num_experts, c.top_k, routing, int(c.norm_topk_prob), c.intermediate_size,
                         *head, *shared, *experts], dtype=torch.int64)  # fmt: skip
    if kernel().moe_check(desc.data_ptr(), moe.gu[0].cols) != 0:  # once here, not every step
        raise ValueError(f"the fused step cannot take these experts ({c})")
    return desc


def _moe_supported(moe: ExpertMlp) -> bool:
    """Experts the kernel's step takes: all packed, one part per down projection, a packed or
    float32 router, at most MAX_TOP_K chosen, a routing it knows; a shared expert packed
    too."""
    c = moe.config
    router = moe.router_t
    mats = [*moe.gu, *moe.down]
    downs = list(moe.down)
    if moe.shared_gu is not None:
        mats += [moe.shared_gu, moe.shared_down]
        downs.append(moe.shared_down)
    return (c.top_k <= MAX_TOP_K and c.routing in ROUTINGS
            and all(isinstance(w, QuantWeight) for w in mats) and all(w.nparts == 1 for w in downs)
            and (isinstance(router, QuantWeight) or router.dtype == torch.float32))  # fmt: skip


class FusedDecode:
    """The decode step of `model` over `pool` as one kernel call."""

    def __init__(self, model: DecoderModel, pool):
        c = model.config
        self.model = model
        self.keep: list[torch.Tensor] = []  # what the table's pointers name
        moes = [None if layer.moe is None else moe_desc(layer.moe, self.keep) for layer in model.layers]
        self.keep += [m for m in moes if m is not None]
        self.table = torch.tensor([_layer_row(layer, m) for layer, m in zip(model.layers, moes, strict=True)],
                                  dtype=torch.int64)  # fmt: skip
        self.has_experts = any(m is not None for m in moes)
        self.kv = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(pool.k, pool.v, strict=True)],
                               dtype=torch.int64)  # fmt: skip
        self.pool = pool  # keeps the buffers the pointers name alive
        self.kv_type = KV_TYPES[pool.k[0].dtype]
        self.dims = (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                     c.intermediate_size)  # fmt: skip
        self.eps = ctypes.c_float(c.rms_norm_eps)
        self.work = torch.empty(0)
        # The step attends to whole sequences: a batch longer than a layer's window is not its.
        windows = [w for w in (c.layer_window(i) for i in range(c.num_layers)) if w is not None]
        self.longest = min(windows) if windows else None
        # The embedding rows and RoPE factors of a step in one kernel call (decode_inputs)
        # when the embedding is packed in one type; else tensor operations (`_inputs`).
        emb, rot = model.embed, model.rotary
        self.embed = emb if isinstance(emb, QuantWeight) and emb.parts is None else None
        self.inv_freq = rot.inv_freq.float().contiguous()
        self.long_inv_freq = None if rot.long_inv_freq is None else rot.long_inv_freq.float().contiguous()
        self.rope = torch.empty(0)  # a step's RoPE factors: cos [rows, head_dim], then sin
        head = model.lm_head_t
        self.head = None  # {final norm, head descriptor, its part count} for decode_layers
        if isinstance(head, QuantWeight) and model.norm.dtype == torch.float32 and model.norm.is_contiguous():
            self.head = torch.tensor([model.norm.data_ptr(), head.desc_ptr(), head.nparts],
                                     dtype=torch.int64)  # fmt: skip

    @staticmethod
    def supported(model: DecoderModel, pool) -> bool:
        """Quantized layer matrices (experts the kernel takes), a CPU pool of contiguous layers in float32,
        float16 or bfloat16, head_dim a multiple of 8."""
        if model.device.type != "cpu" or model.dtype != torch.float32 or model.fused_step_blockers():
            return False
        for layer in model.layers:
            if layer.moe is not None and not _moe_supported(layer.moe):
                return False
            mats = (layer.w_qkv_t, layer.w_o_t) if layer.moe is not None else (
                layer.w_qkv_t, layer.w_o_t, layer.w_gu_t, layer.w_down_t)
            if not all(isinstance(w, QuantWeight) for w in mats):
                return False
            if layer.qk_norm is not None and (layer.qk_norm.dtype != torch.float32
                                              or not layer.qk_norm.is_contiguous()):
                return False
        c = model.config
        return c.head_dim <= 512 and c.head_dim % 8 == 0 and all(
            t.dtype in KV_TYPES and t.device.type == "cpu" and t.is_contiguous()
            and tuple(t.shape[1:]) == (c.num_kv_heads, c.head_dim)
            for t in (*pool.k, *pool.v)
        )  # fmt: skip

    def applies(self, batch) -> bool:
        """Decode rows only (one new token per request), at most MAX_ROWS of them, none
        longer than a sliding window."""
        n = batch.input_ids.shape[0]
        if self.longest is not None and max(batch.seq_lens) > self.longest:
            return False
        return n <= MAX_ROWS and len(batch.extend_lens) == n

    def logits(self, batch) -> torch.Tensor:
        """float32 logits `[L, vocab]` of the `batch.logits_indices` rows (as
        `model.compute_logits` of `forward_hidden`); writes the new K/V of every row."""
        if self.head is not None and batch.input_ids.shape[0] == 1 == batch.logits_indices.shape[0]:
            out = torch.empty(1, self.model.lm_head_t.rows)
            self.forward_hidden(batch, out)
            return out
        return self.model.compute_logits(self.forward_hidden(batch))

    def forward_hidden(self, batch, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's hidden states of the `batch.logits_indices` rows (pre final
        norm); writes the new K/V of every row. With `logits` (one row, `self.head`), the
        step also writes them there."""
        hidden, n_layers, nh, nkv, hd, inter = self.dims
        x, cos, sin = self._inputs(batch)
        slots = _int64(batch.kv_indices_cpu if batch.kv_indices_cpu is not None else batch.kv_indices)
        k = kernel()
        rows = x.shape[0]
        if rows > 1:
            indptr = _int64(batch.kv_indptr)
            need = k.decode_rows_work_floats(rows, hidden, nh, nkv, hd, inter, indptr.data_ptr())
            self._grow(need + self._moe_floats(rows))
            rc = k.decode_rows(
                x.data_ptr(), rows, hidden, n_layers, self.table.data_ptr(), self.kv.data_ptr(),
                self.kv_type, nh, nkv, hd, inter, self.eps, cos, sin, slots.data_ptr(),
                indptr.data_ptr(), self.work.data_ptr(),
            )  # fmt: skip
        else:
            self._grow(k.decode_work_floats(hidden, nh, nkv, hd, inter, slots.numel()) + self._moe_floats(1))
            rc = k.decode_layers(
                x.data_ptr(), hidden, n_layers, self.table.data_ptr(), self.kv.data_ptr(),
                self.kv_type, nh, nkv, hd, inter, self.eps, cos, sin, slots.data_ptr(),
                slots.numel(), self.work.data_ptr(),
                0 if logits is None else self.head.data_ptr(), 0 if logits is None else logits.data_ptr(),
            )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"the fused decode step refused the model's shapes (code {rc})")
        if batch.logits_indices.shape[0] != rows:  # e.g. a session turn's tail row
            x = x.index_select(0, batch.logits_indices)
        return x

    def _inputs(self, batch) -> tuple[torch.Tensor, int, int]:
        """The rows' embeddings `[rows, hidden]` and the addresses of their RoPE factors
        (cos, sin: `[rows, head_dim]` each, in `self.rope`), from one kernel call."""
        m, rows, hd = self.model, batch.input_ids.shape[0], self.dims[4]
        if self.rope.numel() < 2 * rows * hd:
            self.rope = torch.empty(2 * max(rows, MAX_ROWS) * hd)
        e, cos = self.embed, self.rope.data_ptr()
        sin = cos + 4 * rows * hd
        ids = _int64(batch.input_ids)
        if e is None:  # a float or multi-type embedding: rows taken with tensor operations
            x = m.embed.dequantize(ids) if isinstance(m.embed, QuantWeight) else m.embed[ids].contiguous()
        else:
            x = torch.empty(rows, self.dims[0])
        tiles, qtype, n_embed = (0, 0, 0) if e is None else (e.tiles_ptr(), e.qtype, e.rows)  # (0: factors only)
        long = self.long_inv_freq
        rc = kernel().decode_inputs(
            tiles, qtype, n_embed, self.dims[0], ids.data_ptr(), _int64(batch.positions).data_ptr(), rows,
            self.inv_freq.data_ptr(), 0 if long is None else long.data_ptr(), m.rotary.long_from or 0, hd,
            m.rotary.scale, x.data_ptr(), cos, sin,
        )  # fmt: skip
        if rc != 0:
            raise IndexError(f"a token id is outside the embedding's {n_embed} rows")
        return x, cos, sin

    def _moe_floats(self, rows: int) -> int:
        """The experts' scratch after the step's own (moe_step.h's moe_work_floats)."""
        moe = self.model.config.moe
        if not self.has_experts:
            return 0
        return kernel().moe_work_floats(rows, moe.num_experts, moe.top_k, moe.intermediate_size,
                                        moe.shared_intermediate_size, self.dims[0])  # fmt: skip

    def _grow(self, floats: int) -> None:
        if self.work.numel() < floats:
            self.work = torch.empty(max(floats, 2 * self.work.numel()))
