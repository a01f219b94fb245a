"""The one decoder: Llama family, Qwen2 and Qwen3 from the same code, driven by `ModelConfig`.

Weights are held fused and pre-transposed where that saves ops: one QKV matmul, one
gate+up matmul, residual adds folded into `addmm`, and RoPE applied to all q and k heads
in one go. Matrices may instead be weight-only quantized (`QuantWeight`, CPU): they are
fused the same way (rows stacked) and multiply through the quantized kernel, residual adds
accumulated in place. The per-layer path has no per-request Python loops (those live in the attention
backend's `plan`, once per forward).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .quant import QuantWeight
from .rope import Rotary

Weight = torch.Tensor | QuantWeight  # a dense (transposed) matrix or packed blocks


class DecoderLayer:
    __slots__ = (
        "in_norm", "w_qkv_t", "b_qkv", "qk_norm", "w_o_t", "b_o",
        "post_norm", "w_gu_t", "b_gu", "w_down_t", "b_down",
    )  # fmt: skip

    def __init__(self, **tensors: torch.Tensor | None):
        for name in self.__slots__:
            setattr(self, name, tensors.get(name))


def transposed(w: Weight, device: torch.device) -> Weight:
    """`w` ([out, in]) as the `[in, out]` right operand of `x @ w_t`, in the memory layout
    that streams fastest. On CPU a batch-1 step is a GEMV bound by memory bandwidth, and
    MKL reads a matrix faster along long contiguous rows: wide matrices (out > in: QKV,
    gate/up, LM head) are stored `[in, out]`-row-major, the others stay `[out, in]` (a
    transposed view). On GPUs the standard layout is kept. Quantized weights stay as they
    are ([out, in] blocks)."""
    if isinstance(w, QuantWeight):
        return w
    if device.type == "cpu" and w.shape[0] > w.shape[1]:
        return _rows_unaliased(w.t())
    return w.t()


def _rows_unaliased(a: torch.Tensor) -> torch.Tensor:
    """A row-major copy of 2-D `a`, its row stride padded by one cache line when it is a
    multiple of 1 KiB. With such strides (gate/up: 3072 floats = 12 KiB) the rows' same
    columns share a few L1 sets, and MKL's packing of the matrix for a multi-row GEMM
    thrashes them: 64 rows x [576, 3072] ran 6.5 ms unpadded, 5.0 ms padded; GEMV speed
    is unchanged."""
    rows, cols = a.shape
    if (cols * a.element_size()) % 1024:
        return a.contiguous()
    pad = max(1, 64 // a.element_size())
    buf = a.new_empty(rows, cols + pad)
    buf[:, :cols] = a
    return buf[:, :cols]


class DecoderModel:
    """Decoder-only transformer over a KV pool; see `forward`."""

    def __init__(self, config: ModelConfig, state: Mapping[str, torch.Tensor], device, dtype):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        c = config
        self._used: set[str] = set()

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = state.get(name)
            if t is None:
                if required:
                    raise KeyError(f"checkpoint lacks tensor {name!r}")
                return None
            self._used.add(name)
            return t

        def put(t: Weight | None) -> Weight | None:
            if t is None:
                return None
            if isinstance(t, QuantWeight):
                if self.device.type != "cpu":
                    raise ValueError("quantized weights run on CPU only")
                return t.pack()  # the kernel's layout, once; the file's pages let go
            return t.to(device=self.device, dtype=dtype).contiguous()

        self.embed = put(take("model.embed_tokens.weight"))
        if c.tie_word_embeddings:
            head = self.embed
            take("lm_head.weight", required=False)
        else:
            head = put(take("lm_head.weight", required=False))
            if head is None:
                raise KeyError("checkpoint lacks lm_head.weight and tie_word_embeddings is false")
        self.lm_head_t = transposed(head, self.device)  # [hidden, vocab]
        # The head in the standard [vocab, hidden] layout too, where that copy is free (the
        # tied embedding): on CPU, MKL multiplies 4+ rows by it (in blocks) up to ~1.4x
        # faster than by the [hidden, vocab] copy that a batch-1 step streams fastest.
        dense_tied = head is self.embed and not isinstance(head, QuantWeight)
        self.lm_head_rows = head if self.device.type == "cpu" and dense_tied else None
        del head
        self.norm = put(take("model.norm.weight"))
        self.layers: list[DecoderLayer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            w_qkv = _cat_rows([take(a + f"{x}_proj.weight") for x in "qkv"])
            b_qkv = None
            if c.qkv_bias:
                b_qkv = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"], 0)
            qk_norm = None
            if c.qk_norm:
                qn = take(a + "q_norm.weight").reshape(1, c.head_dim)
                kn = take(a + "k_norm.weight").reshape(1, c.head_dim)
                qk_norm = torch.cat([qn.expand(c.num_heads, -1), kn.expand(c.num_kv_heads, -1)], 0)
            w_gu = _cat_rows([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
            b_gu = b_down = None
            if c.mlp_bias:
                b_gu = torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")], 0)
                b_down = take(m + "down_proj.bias")
            w_o = put(take(a + "o_proj.weight"))
            w_down = put(take(m + "down_proj.weight"))
            self.layers.append(
                DecoderLayer(
                    in_norm=put(take(p + "input_layernorm.weight")),
                    w_qkv_t=transposed(put(w_qkv), self.device),
                    b_qkv=put(b_qkv),
                    qk_norm=put(qk_norm),
                    w_o_t=transposed(w_o, self.device),
                    b_o=put(take(a + "o_proj.bias")) if c.o_bias else None,
                    post_norm=put(take(p + "post_attention_layernorm.weight")),
                    w_gu_t=transposed(put(w_gu), self.device),
                    b_gu=put(b_gu),
                    w_down_t=transposed(w_down, self.device),
                    b_down=put(b_down),
                )
            )
        unused = sorted(
            n for n in state if n not in self._used and not n.endswith("rotary_emb.inv_freq")
        )
        if unused:
            raise KeyError(f"checkpoint has tensors this decoder does not use: {unused[:8]}")
        self.rotary = Rotary(c.rope, c.head_dim, self.device, dtype)
        # `x + a @ w_t` of o_proj and down_proj; tensor parallelism puts in its place one
        # that sums the ranks' partial products (radixlm.runtime.distributed.linear).
        self.add_out_proj: Callable[[torch.Tensor, torch.Tensor, Weight], torch.Tensor] = _add_mm

    def weight_bytes(self) -> int:
        """Bytes of weights read by one decode step (embedding row reads not counted)."""
        tensors = [self.lm_head_t, self.norm]
        for layer in self.layers:
            tensors += [getattr(layer, name) for name in DecoderLayer.__slots__]
        return sum(
            t.nbytes if isinstance(t, QuantWeight) else t.numel() * t.element_size()
            for t in tensors
            if t is not None
        )

    def resident_bytes(self) -> int:
        """Bytes of every weight the model holds, each once (the embedding included; a
        tied head counted once; quantized blocks at their packed size)."""
        seen: dict[int, int] = {}
        for t in [self.embed, self.lm_head_t, self.norm, self.lm_head_rows] + [
                getattr(layer, name) for layer in self.layers for name in DecoderLayer.__slots__]:  # fmt: skip
            if t is None:
                continue
            if isinstance(t, QuantWeight):
                seen[id(t)] = t.nbytes
            else:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    @property
    def weight_format(self) -> str:
        """'float32' etc. for dense weights, else the block types in use (e.g. 'Q4_1+Q8_0')."""
        mats = [self.lm_head_t] + [w for lyr in self.layers
                                   for w in (lyr.w_qkv_t, lyr.w_o_t, lyr.w_gu_t, lyr.w_down_t)]  # fmt: skip
        names = sorted({n for w in mats if isinstance(w, QuantWeight) for n in w.type_name.split("+")})
        return "+".join(names) if names else str(self.dtype).removeprefix("torch.")

    def forward(self, batch, attn) -> torch.Tensor:
        """Run `batch` (a planned `ForwardBatch`) through the decoder; float32 logits `[L, V]`."""
        return self.compute_logits(self.forward_hidden(batch, attn))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head over `[L, hidden]` rows → float32 `[L, vocab]`."""
        x = F.rms_norm(hidden, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        if self.lm_head_rows is not None and x.shape[0] >= _HEAD_ROWS_MIN:
            return _mm_by_row_blocks(x, self.lm_head_rows).float()
        return _mm(x, self.lm_head_t, None).float()

    def forward_hidden(self, batch, attn) -> torch.Tensor:
        """The last layer's hidden states of the `batch.logits_indices` rows (pre final norm)."""
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions)
        for i in range(len(self.layers)):
            x = self.layer_forward(i, x, cos, sin, attn)
        if batch.logits_indices.shape[0] != x.shape[0]:
            x = x.index_select(0, batch.logits_indices)
        return x

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[T, hidden]` input embeddings."""
        if isinstance(self.embed, QuantWeight):
            return self.embed.dequantize(input_ids)
        return F.embedding(input_ids, self.embed)

    def layer_forward(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attn, layer: DecoderLayer | None = None) -> torch.Tensor:
        """Layer `i` (or `layer`, standing in for it) over the
        `[T, hidden]` rows `x`, whose K/V the planned `attn` writes; may update `x` in
        place. Also run alone, a piece at a time (sliced.py)."""
        c = self.config
        layer = self.layers[i] if layer is None else layer
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        hq = H + Hkv
        eps = c.rms_norm_eps
        hidden = (c.hidden_size,)
        inter = c.intermediate_size
        T = x.shape[0]
        h = F.rms_norm(x, hidden, layer.in_norm, eps)
        qkv = _mm(h, layer.w_qkv_t, layer.b_qkv).view(T, hq + Hkv, D)
        qk = qkv[:, :hq]
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (D,), None, eps) * layer.qk_norm
        qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin)
        o = attn.forward(i, qk[:, :H], qk[:, H:], qkv[:, hq:])
        x = self.add_out_proj(x, o, layer.w_o_t)
        if layer.b_o is not None:
            x = x + layer.b_o
        h = F.rms_norm(x, hidden, layer.post_norm, eps)
        gu = _mm(h, layer.w_gu_t, layer.b_gu)
        act = F.silu(gu[:, :inter]) * gu[:, inter:]
        x = self.add_out_proj(x, act, layer.w_down_t)
        if layer.b_down is not None:
            x = x + layer.b_down
        return x


# Rows from which `compute_logits` uses `lm_head_rows`. CPU, 1 thread, SmolLM2's 576 x
# 49152 head, `lm_head_t` vs `lm_head_rows` by blocks: 2 rows 16 vs 28 ms, 4 rows 30 vs 26,
# 16 rows 52 vs 40, 64 rows 114 vs 81.
_HEAD_ROWS_MIN = 4
# Output columns per MKL call in `_mm_by_row_blocks`: 512 rows of a 576-wide head are
# ~1 MiB (the L2 size); one call over the whole 113 MB matrix is ~1.5x slower.
_HEAD_BLOCK = 512


def _mm_by_row_blocks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w.T` for a tall `w` ([N, K]), one block of `w`'s rows per call."""
    out = x.new_empty(x.shape[0], w.shape[0])
    for j in range(0, w.shape[0], _HEAD_BLOCK):
        torch.mm(x, w[j : j + _HEAD_BLOCK].t(), out=out[:, j : j + _HEAD_BLOCK])
    return out


def _mm(x: torch.Tensor, w_t: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w_t, QuantWeight):
        return w_t.matmul(x, bias)
    return torch.mm(x, w_t) if bias is None else torch.addmm(bias, x, w_t)


def _add_mm(x: torch.Tensor, a: torch.Tensor, w_t: Weight) -> torch.Tensor:
    """`x + a @ w_t`; quantized weights add into `x` in place (the decoder owns `x`)."""
    if isinstance(w_t, QuantWeight):
        return w_t.matmul(a, out=x, accumulate=True)
    return torch.addmm(x, a, w_t)


def _cat_rows(parts: list[Weight]) -> Weight:
    """Several `[out_i, in]` matrices stacked into one (fused projections)."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantWeight.cat(parts)
    parts = [p.dequantize() if isinstance(p, QuantWeight) else p for p in parts]
    return torch.cat(parts, 0)
