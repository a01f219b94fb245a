"""Mixture-of-experts MLPs (Qwen3-MoE, Qwen2-MoE, Mixtral): one layer's router, experts
and (Qwen2-MoE) shared expert, run by `DecoderModel.layer_forward` in place of its dense MLP.

A token's router logits pick `top_k` of the layer's experts, with weights, as its family
defines it (`route`); its output is the weighted sum of those experts' SwiGLU MLPs. The
rows of a forward are grouped by expert: each chosen expert multiplies all of its rows at
once, and an expert no row chose is not touched, so its weights are not read. A one-row
step (batch-1 decode) skips the grouping: its `top_k` experts' gate+up rows are one product
(`quant.matmul_stacked`), their down projections one by one.

Each expert's matrices are its own weights, as the decoder's are: gate+up stacked into one
`[in, out]` operand and down, dense (float32/bfloat16, CPU or CUDA: torch's matmul per
expert) or packed GGML blocks (`QuantWeight`: the CPU kernel's products, one weight per
expert, read only when the expert runs). The routing weight scales an expert's activations
before its down projection (the same sum: the projection is linear), so the products add
straight into the output rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .moe_config import EXPERT_NAMES, MoeConfig
from .quant import DEQUANT_MIN_ROWS, QuantWeight, matmul_stacked

Weight = torch.Tensor | QuantWeight  # as decoder.Weight: an `[in, out]` operand or packed blocks
# Rows per call of the kernel's integer products. A packed expert multiplies more rows in
# blocks of these, never dequantized: that pays only for a whole prompt's rows on a dense
# matrix, and an expert gets a few dozen (a 1,024-token prefill over 128 experts, 8 per
# token: 64 on average). AVX-512 EPYC, 2 threads, a Q4_0 [1536, 2048] expert by 64 rows:
# kernel 1.1 ms; dequantize 0.6 ms + float32 GEMM 1.3-4 ms.
_KERNEL_ROWS = DEQUANT_MIN_ROWS - 1


def route(logits: torch.Tensor, top_k: int, routing: str, normalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(float32 weights `[T, top_k]`, expert indices `[T, top_k]`) from router logits `[T, E]`.

    - "softmax_topk" (Qwen): softmax over all experts, the top_k probabilities, divided by
      their sum when `normalize` (norm_topk_prob);
    - "topk_softmax" (Mixtral): the top_k logits, softmax over those k.
    """
    logits = logits.float()
    if routing == "topk_softmax":
        top, chosen = torch.topk(logits, top_k, dim=-1)
        return top.softmax(-1), chosen
    top, chosen = torch.topk(logits.softmax(-1), top_k, dim=-1)
    if normalize:
        top = top / top.sum(-1, keepdim=True)
    return top, chosen


def _product(x: torch.Tensor, w: Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w` (into `out` if given)."""
    if not isinstance(w, QuantWeight):
        return torch.mm(x, w) if out is None else torch.mm(x, w, out=out)
    if x.shape[0] <= _KERNEL_ROWS:
        return w.matmul(x, out=out)
    out = x.new_empty(x.shape[0], w.rows) if out is None else out
    for a in range(0, x.shape[0], _KERNEL_ROWS):
        w.matmul(x[a : a + _KERNEL_ROWS], out=out[a : a + _KERNEL_ROWS])
    return out


def _accumulate(out: torch.Tensor, a: torch.Tensor, w: Weight) -> None:
    """`out += a @ w`, in place."""
    if isinstance(w, QuantWeight):
        w.matmul(a, out=out, accumulate=True)
    else:
        out.addmm_(a, w)


def _swiglu(gu: torch.Tensor, width: int) -> torch.Tensor:
    return F.silu(gu[:, :width]) * gu[:, width:]


class ExpertMlp:
    """One layer's sparse MLP; `__call__(h, out)` adds its output for the rows `h` to `out`."""

    __slots__ = ("config", "router_t", "gu", "down", "shared_gu", "shared_down", "shared_gate_t")

    def __init__(self, config: MoeConfig, router_t: Weight, gu: list[Weight], down: list[Weight],
                 shared: tuple[Weight, Weight, Weight] | None = None):  # fmt: skip
        """`router_t`: `[hidden, E]`; `gu[e]`: expert e's gate and up rows stacked, as an
        `[hidden, 2 width]` operand; `down[e]`: `[width, hidden]`; `shared`: (gate+up,
        down, `[hidden, 1]` gate) of the shared expert."""
        if len(gu) != config.num_experts or len(down) != config.num_experts:
            raise ValueError(f"{len(gu)} / {len(down)} expert matrices for {config.num_experts} experts")
        self.config = config
        self.router_t, self.gu, self.down = router_t, gu, down
        self.shared_gu, self.shared_down, self.shared_gate_t = shared or (None, None, None)

    def __call__(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add the MLP output of the rows `h` `[T, hidden]` into `out` (same shape); `out`."""
        c = self.config
        weights, chosen = route(_product(h, self.router_t), c.top_k, c.routing, c.norm_topk_prob)
        if h.shape[0] == 1:
            self._one_row(h, out, weights[0], chosen[0].tolist())
        else:
            self._grouped(h, out, weights, chosen)
        if self.shared_gu is not None:
            act = _swiglu(_product(h, self.shared_gu), c.shared_intermediate_size)
            act.mul_(torch.sigmoid(_product(h, self.shared_gate_t)))
            _accumulate(out, act, self.shared_down)
        return out

    def _one_row(self, h: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
                 chosen: list[int]) -> None:  # fmt: skip
        """A one-row step (batch-1 decode): the chosen experts' gate+up rows as one
        product of packed weights (one kernel call where there were `top_k`), their
        downs one by one (each has its own input)."""
        width = self.config.intermediate_size
        gus = [self.gu[e] for e in chosen]
        if all(isinstance(w, QuantWeight) for w in gus):
            acts = _swiglu(matmul_stacked(h, gus).view(len(chosen), 2 * width), width)
            acts.mul_(weights.to(acts.dtype).unsqueeze(1))
        else:
            acts = torch.cat([_swiglu(_product(h, w), width) for w in gus]).mul_(
                weights.to(h.dtype).unsqueeze(1))
        for i, e in enumerate(chosen):
            _accumulate(out, acts[i : i + 1], self.down[e])

    def _grouped(self, h: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
                 chosen: torch.Tensor) -> None:  # fmt: skip
        """Several rows: the (row, expert) pairs sorted by expert, each expert's rows
        multiplied together, the results added back to their rows."""
        width = self.config.intermediate_size
        k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.gu)).tolist()  # the one host sync
        rows = torch.div(order, k, rounding_mode="floor")
        xs = h.index_select(0, rows)
        scale = weights.reshape(-1).index_select(0, order).to(h.dtype).unsqueeze(1)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = slice(start, start + n)
            act = _swiglu(_product(xs[seg], self.gu[e]), width).mul_(scale[seg])
            _product(act, self.down[e], out=ys[seg])
            start += n
        out.index_add_(0, rows, ys)

    def weights(self) -> list[Weight]:
        """Every matrix the layer holds (router, experts, shared expert)."""
        shared = [self.shared_gu, self.shared_down, self.shared_gate_t]
        return [self.router_t, *self.gu, *self.down, *(w for w in shared if w is not None)]

    def step_bytes(self) -> int:
        """Bytes one token reads: the router, `top_k` experts (of average size) and the
        shared expert."""
        experts = sum(weight_nbytes(w) for w in (*self.gu, *self.down))
        shared = [self.shared_gu, self.shared_down, self.shared_gate_t]
        return (weight_nbytes(self.router_t) + experts * self.config.top_k // len(self.gu)
                + sum(weight_nbytes(w) for w in shared if w is not None))  # fmt: skip


def weight_nbytes(w: Weight) -> int:
    return w.nbytes if isinstance(w, QuantWeight) else w.numel() * w.element_size()


def load_experts(
    config: MoeConfig,
    model_type: str,
    layer: int,
    take: Callable[[str], Weight],
    place: Callable[[Weight], Weight],
    fuse: Callable[[list[Weight]], Weight],
) -> ExpertMlp:
    """Layer `layer`'s sparse block from HF-named tensors: `take(name)` a tensor of the
    checkpoint, `place` it as the decoder holds a matrix (device, dtype, `[in, out]`
    operand), `fuse` stacks rows (gate and up into one matrix)."""
    block, (gate, up, down) = EXPERT_NAMES[model_type]
    p = f"model.layers.{layer}.{block}."
    gu, dn = [], []
    for e in range(config.num_experts):
        x = f"{p}experts.{e}."
        gu.append(place(fuse([take(x + f"{gate}.weight"), take(x + f"{up}.weight")])))
        dn.append(place(take(x + f"{down}.weight")))
    shared = None
    if config.shared_intermediate_size:
        s = p + "shared_expert."
        gate_row = take(p + "shared_expert_gate.weight")
        if isinstance(gate_row, torch.Tensor):
            gate_row = gate_row.reshape(1, -1)  # GGUF may store it as a vector
        shared = (place(fuse([take(s + "gate_proj.weight"), take(s + "up_proj.weight")])),
                  place(take(s + "down_proj.weight")), place(gate_row))  # fmt: skip
    return ExpertMlp(config, place(take(p + "gate.weight")), gu, dn, shared)
