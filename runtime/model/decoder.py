"""The one decoder: Llama family, Qwen2/3, Gemma 2/3 and Phi-3 from the same code, driven
by `ModelConfig` (its `Variations` name what a family does differently: variants.py).

Weights are held fused and pre-transposed where that saves ops: one QKV matmul, one
gate+up matmul, residual adds folded into `addmm`, and RoPE applied to all q and k heads
in one go. Matrices may instead be weight-only quantized (`QuantWeight`, CPU): they are
fused the same way (rows stacked) and multiply through the quantized kernel, residual adds
accumulated in place. The per-layer path has no per-request Python loops (those live in the attention
backend's `plan`, once per forward). A mixture-of-experts layer (`config.moe`) holds an
`ExpertMlp` (moe.py) in place of the dense MLP's matrices.

Gemma's sandwich norms normalise the attention and MLP outputs before the residual add, so
those products are not folded into the residual (`_proj`); its (1 + w) norms are stored
with the 1 added. Fused checkpoint projections (Phi-3's qkv_proj, gate_up_proj) are taken
as the fused matrices they already are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .moe import ExpertMlp, load_experts, weight_nbytes
from .quant import QuantWeight
from .rope import Rotary, rotate_in_place
from .weights import text_decoder_tensors

Weight = torch.Tensor | QuantWeight  # a dense (transposed) matrix or packed blocks


class DecoderLayer:
    __slots__ = (
        "in_norm", "w_qkv_t", "b_qkv", "qk_norm", "w_o_t", "b_o",
        "post_norm", "w_gu_t", "b_gu", "w_down_t", "b_down", "moe",
        "attn_out_norm", "mlp_out_norm",  # sandwich norms (Gemma), else None
    )  # fmt: skip

    def __init__(self, **tensors: torch.Tensor | ExpertMlp | None):
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
        v = c.variations
        self._used: set[str] = set()
        state = text_decoder_tensors(state)

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
        def norm(name: str, required: bool = True) -> torch.Tensor | None:
            t = take(name, required)  # Gemma's (1 + w): the 1 added once, in float32
            return t if t is None or not v.norm_offset else t.float() + v.norm_offset

        def fused(prefix: str, parts: list[str], fused_name: str, rows: int) -> Weight:
            """`[part; part; ...]` rows, from the parts or from a checkpoint's fused matrix."""
            if prefix + fused_name + ".weight" not in state:
                return _cat_rows([take(prefix + f"{x}.weight") for x in parts])
            w = take(prefix + fused_name + ".weight")
            if w.shape[0] != rows:
                raise ValueError(f"{prefix}{fused_name}.weight has {w.shape[0]} rows, the config "
                                 f"needs {rows} (tensor parallelism does not split fused "
                                 "projections)")  # fmt: skip
            return w

        self.norm = put(norm("model.norm.weight"))
        self.layers: list[DecoderLayer] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            w_qkv = fused(a, ["q_proj", "k_proj", "v_proj"], "qkv_proj", c.q_size + 2 * c.kv_size)
            b_qkv = None
            if c.qkv_bias:
                b_qkv = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"], 0)
            qk_norm = None
            if c.qk_norm:
                qn = norm(a + "q_norm.weight").reshape(1, c.head_dim)
                kn = norm(a + "k_norm.weight").reshape(1, c.head_dim)
                qk_norm = torch.cat([qn.expand(c.num_heads, -1), kn.expand(c.num_kv_heads, -1)], 0)
            moe = w_gu = w_down = b_gu = b_down = None
            if c.moe is not None and c.moe.sparse_layers[i]:  # mixture of experts (moe.py)
                moe = load_experts(c.moe, c.model_type, i, take,
                                   lambda w: transposed(put(w), self.device), _cat_rows)  # fmt: skip
            else:
                w_gu = fused(m, ["gate_proj", "up_proj"], "gate_up_proj", 2 * c.intermediate_size)
                if c.mlp_bias:
                    b_gu = torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")], 0)
                    b_down = take(m + "down_proj.bias")
                w_down = put(take(m + "down_proj.weight"))
            w_o = put(take(a + "o_proj.weight"))
            sandwich = v.sandwich_norms
            self.layers.append(
                DecoderLayer(
                    in_norm=put(norm(p + "input_layernorm.weight")),
                    w_qkv_t=transposed(put(w_qkv), self.device),
                    b_qkv=put(b_qkv),
                    qk_norm=put(qk_norm),
                    w_o_t=transposed(w_o, self.device),
                    b_o=put(take(a + "o_proj.bias")) if c.o_bias else None,
                    post_norm=put(norm(p + ("pre_feedforward_layernorm.weight" if sandwich
                                            else "post_attention_layernorm.weight"))),  # fmt: skip
                    w_gu_t=transposed(put(w_gu), self.device) if w_gu is not None else None,
                    b_gu=put(b_gu),
                    w_down_t=transposed(w_down, self.device) if w_down is not None else None,
                    b_down=put(b_down),
                    moe=moe,
                    attn_out_norm=put(norm(p + "post_attention_layernorm.weight")) if sandwich else None,
                    mlp_out_norm=put(norm(p + "post_feedforward_layernorm.weight")) if sandwich else None,
                )
            )
        unused = sorted(
            n for n in state if n not in self._used and not n.endswith("rotary_emb.inv_freq")
        )
        if unused:
            raise KeyError(f"checkpoint has tensors this decoder does not use: {unused[:8]}")
        self.rotary = Rotary(c.rope, c.head_dim, self.device, dtype)
        # Gemma 3's sliding layers rotate with their own base: one Rotary per RoPE config.
        self.local_rotary = None
        if c.local_rope is not None:
            self.local_rotary = Rotary(c.local_rope, c.head_dim, self.device, dtype)
        self.embed_scale = v.embed_scale
        # `x + a @ w_t` of o_proj and down_proj; tensor parallelism puts in its place one
        # that sums the ranks' partial products (radixlm.runtime.distributed.linear).
        self.add_out_proj: Callable[[torch.Tensor, torch.Tensor, Weight], torch.Tensor] = _add_mm
        # `x + moe(h)` of a sparse layer; under tensor parallelism, summed over the ranks.
        self.add_experts: Callable[[torch.Tensor, torch.Tensor, ExpertMlp], torch.Tensor] = _add_experts

    def weight_bytes(self) -> int:
        """Bytes of weights read by one decode step (embedding row reads not counted)."""
        tensors = [self.lm_head_t, self.norm]
        for layer in self.layers:
            tensors += [getattr(layer, name) for name in _TENSOR_SLOTS]
        experts = sum(layer.moe.step_bytes() for layer in self.layers if layer.moe is not None)
        return experts + sum(weight_nbytes(t) for t in tensors if t is not None)

    def resident_bytes(self) -> int:
        """Bytes of every weight the model holds, each once (the embedding included; a
        tied head counted once; quantized blocks at their packed size)."""
        seen: dict[int, int] = {}
        for t in [self.embed, self.lm_head_t, self.norm, self.lm_head_rows] + [
                getattr(layer, name) for layer in self.layers for name in _TENSOR_SLOTS] + [
                w for layer in self.layers if layer.moe is not None for w in layer.moe.weights()]:  # fmt: skip
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
        mats += [lyr.moe.gu[0] for lyr in self.layers if lyr.moe is not None and lyr.moe.gu]
        names = sorted({n for w in mats if isinstance(w, QuantWeight) for n in w.type_name.split("+")})
        return "+".join(names) if names else str(self.dtype).removeprefix("torch.")

    def forward(self, batch, attn) -> torch.Tensor:
        """Run `batch` (a planned `ForwardBatch`) through the decoder; float32 logits `[L, V]`."""
        return self.compute_logits(self.forward_hidden(batch, attn))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head over `[L, hidden]` rows → float32 `[L, vocab]`."""
        x = F.rms_norm(hidden, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)
        if self.lm_head_rows is not None and x.shape[0] >= _HEAD_ROWS_MIN:
            logits = _mm_by_row_blocks(x, self.lm_head_rows).float()
        else:
            logits = _mm(x, self.lm_head_t, None).float()
        cap = self.config.variations.final_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits.div_(cap)).mul_(cap)
        return logits

    def rotary_for(self, layer: int) -> Rotary:
        """The `Rotary` layer `layer` rotates its q and k with."""
        if self.local_rotary is not None and self.config.layer_window(layer) is not None:
            return self.local_rotary
        return self.rotary

    def forward_hidden(self, batch, attn) -> torch.Tensor:
        """The last layer's hidden states of the `batch.logits_indices` rows (pre final norm)."""
        x = self.embed_tokens(batch.input_ids)
        tables = {id(r): r.cos_sin(batch.positions) for r in (self.rotary, self.local_rotary) if r}
        for i in range(len(self.layers)):
            cos, sin = tables[id(self.rotary_for(i))]
            x = self.layer_forward(i, x, cos, sin, attn)
        if batch.logits_indices.shape[0] != x.shape[0]:
            x = x.index_select(0, batch.logits_indices)
        return x

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`[T, hidden]` input embeddings (Gemma: times sqrt(hidden), in their dtype)."""
        if isinstance(self.embed, QuantWeight):
            x = self.embed.dequantize(input_ids)
        else:
            x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def fused_step_blockers(self) -> list[str]:
        """What keeps the fused C decode step (fused_decode.py) from running this model,
        which then takes the per-op path (its quantized products included). Sliding
        windows are checked per batch (`FusedDecode.applies`)."""
        c, v = self.config, self.config.variations
        out = [name for name, on in (
            ("sandwich norms", v.sandwich_norms),
            ("a GeGLU MLP", v.mlp_act != "silu"), ("scaled embeddings", v.embed_scale),
            ("attention soft-capping", v.attn_softcap), ("logit soft-capping", v.final_softcap),
            ("a local RoPE base", self.local_rotary), ("partial rotary", self.rotary.partial),
            ("query_pre_attn_scalar", v.query_scale is not None
             and v.query_scale != c.head_dim**-0.5),
        ) if on]  # fmt: skip
        return out

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
        qkv = _norm_mm(x, layer.in_norm, eps, layer.w_qkv_t, layer.b_qkv).view(T, hq + Hkv, D)
        qk = qkv[:, :hq]
        # quantized weights (CPU): q and k rotated in qkv's own rows by the C kernel
        rotated = (isinstance(layer.w_qkv_t, QuantWeight) and not self.rotary.partial
                   and rotate_in_place(qkv, hq, cos, sin, layer.qk_norm, eps))  # fmt: skip
        if not rotated:
            if layer.qk_norm is not None:
                qk = F.rms_norm(qk, (D,), None, eps) * layer.qk_norm
            if self.rotary.partial:
                qk = self.rotary.apply(qk, cos, sin)
            else:
                qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin)
        o = attn.forward(i, qk[:, :H], qk[:, H:], qkv[:, hq:])
        if layer.attn_out_norm is not None:
            x = x + F.rms_norm(self._proj(o, layer.w_o_t, layer.b_o), hidden, layer.attn_out_norm, eps)
        else:
            x = self.add_out_proj(x, o, layer.w_o_t)
            if layer.b_o is not None:
                x = x + layer.b_o
        if layer.moe is not None:
            return self.add_experts(x, F.rms_norm(x, hidden, layer.post_norm, eps), layer.moe)
        gu = _norm_mm(x, layer.post_norm, eps, layer.w_gu_t, layer.b_gu)
        if (self.config.variations.mlp_act == "silu" and layer.mlp_out_norm is None
                and self.add_out_proj is _add_mm and isinstance(layer.w_down_t, QuantWeight)):
            x = layer.w_down_t.matmul_glu(gu, out=x, accumulate=True)  # SiLU x up formed in the kernel
            return x if layer.b_down is None else x + layer.b_down
        if self.config.variations.mlp_act == "silu":
            act = F.silu(gu[:, :inter]) * gu[:, inter:]
        else:
            act = F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]
        if layer.mlp_out_norm is not None:
            y = self._proj(act, layer.w_down_t, layer.b_down)
            return x + F.rms_norm(y, hidden, layer.mlp_out_norm, eps)
        x = self.add_out_proj(x, act, layer.w_down_t)
        if layer.b_down is not None:
            x = x + layer.b_down
        return x

    def _proj(self, a: torch.Tensor, w_t: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """`a @ w_t (+ bias)` of o_proj / down_proj where the residual add must wait for a
        norm (sandwich norms); under tensor parallelism, the ranks' sum (`add_out_proj`
        onto zeros)."""
        if self.add_out_proj is _add_mm:
            return _mm(a, w_t, bias)
        y = self.add_out_proj(a.new_zeros(a.shape[0], self.config.hidden_size), a, w_t)
        return y if bias is None else y + bias


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


def _norm_mm(x: torch.Tensor, norm_w: torch.Tensor | None, eps: float, w_t: Weight,
             bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """`rms_norm(x) @ w_t (+ bias)`; quantized weights norm the rows as they quantize them
    (a prefill's: `QuantWeight.matmul_norm`)."""
    if isinstance(w_t, QuantWeight) and norm_w is not None:
        return w_t.matmul_norm(x, norm_w, eps, bias)
    return _mm(F.rms_norm(x, (x.shape[-1],), norm_w, eps), w_t, bias)


def _add_mm(x: torch.Tensor, a: torch.Tensor, w_t: Weight) -> torch.Tensor:
    """`x + a @ w_t`; quantized weights add into `x` in place (the decoder owns `x`)."""
    if isinstance(w_t, QuantWeight):
        return w_t.matmul(a, out=x, accumulate=True)
    return torch.addmm(x, a, w_t)


def _add_experts(x: torch.Tensor, h: torch.Tensor, moe: ExpertMlp) -> torch.Tensor:
    """`x + moe(h)`, added into `x` in place (the decoder owns `x`)."""
    return moe(h, x)


_TENSOR_SLOTS = tuple(name for name in DecoderLayer.__slots__ if name != "moe")


def _cat_rows(parts: list[Weight]) -> Weight:
    """Several `[out_i, in]` matrices stacked into one (fused projections)."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantWeight.cat(parts)
    parts = [p.dequantize() if isinstance(p, QuantWeight) else p for p in parts]
    return torch.cat(parts, 0)
