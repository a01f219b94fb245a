"""Rotary position embeddings (HF "rotate_half" layout), with default/linear/llama3/yarn/
longrope scaling and partial rotation (the first `rotary_dim` dims of each head).

The inverse frequencies follow transformers' `modeling_rope_utils` formulas, computed in
float32 the same way, so cos/sin match HF bit for bit.

Longrope (Phi-3) has two sets of frequencies: transformers uses the long set for a
forward whose last position is at or past `original_max_position_embeddings`, the short
set otherwise, for every token of that forward. Here the set is chosen per position
(long from that position on): a token's K/V is then the same however the tokens were
batched, which a prefix cache needs, and equals transformers' for every position below
the threshold and, past it, when the sequence grows one forward per token (decode). A
single prefill that crosses the threshold rotates its earlier tokens with the short set
where transformers would use the long one for all of them.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig
from .qkernel import kernel


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many of each head's dims RoPE rotates (all but for a partial rotary factor)."""
    return int(head_dim * rope.partial_rotary_factor)


def inv_freq_and_scale(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """`(inv_freq[rotary_dim // 2] float32, attention_scaling)` for a RoPE config (the
    short set of a longrope config; `long_inv_freq` gives the other)."""
    dim = rotary_dim(rope, head_dim)
    base = rope.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    scale = 1.0
    if rope.type == "default":
        pass
    elif rope.type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.type == "llama3":
        factor = rope.factor
        old_ctx = rope.original_max_position_embeddings
        low_wl = old_ctx / rope.low_freq_factor
        high_wl = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_llama = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        is_medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        inv_freq = torch.where(is_medium, smoothed, inv_llama)
    elif rope.type == "yarn":
        inv_freq, scale = _yarn(rope, dim)
    elif rope.type == "longrope":
        inv_freq, scale = _longrope(rope, dim, rope.short_factor)
    else:  # pragma: no cover - ModelConfig validates the type
        raise ValueError(f"unknown rope type {rope.type!r}")
    return inv_freq, scale


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    orig = rope.original_max_position_embeddings
    if rope.attention_factor is not None:
        scale = rope.attention_factor
    else:
        scale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv_freq, float(scale)


def long_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor | None:
    """The long-context frequencies of a longrope config (None for other types)."""
    if rope.type != "longrope":
        return None
    return _longrope(rope, rotary_dim(rope, head_dim), rope.long_factor)[0]


def _longrope(rope: RopeConfig, dim: int, ext: tuple[float, ...] | None) -> tuple[torch.Tensor, float]:
    orig = rope.original_max_position_embeddings
    scale = rope.attention_factor
    if scale is None:
        f = rope.factor
        scale = 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(orig))
    ext_t = torch.tensor(ext, dtype=torch.float32)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_t * rope.theta**exponents), float(scale)


class Rotary:
    """Per-forward cos/sin for given positions, applied to q and k together.

    `apply(qk, cos, sin_signed)` rotates a `[T, heads, D]` tensor: with `sin_signed =
    cat(-sin, sin)`, `roll(x, D/2) * sin_signed == rotate_half(x) * sin`, so the rotation is
    three tensor ops for all q and k heads at once. With partial rotation (`dim` <
    head_dim) only the first `dim` dims of each head turn; the rest pass through.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device, dtype: torch.dtype):
        inv_freq, scale = inv_freq_and_scale(rope, head_dim)
        self.inv_freq = inv_freq.to(device)
        long = long_inv_freq(rope, head_dim)
        self.long_inv_freq = None if long is None else long.to(device)
        self.long_from = rope.original_max_position_embeddings  # longrope: first long position
        self.scale = scale
        self.dim = rotary_dim(rope, head_dim)
        self.partial = self.dim < head_dim
        self.half = self.dim // 2
        self.dtype = dtype

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin_signed)`, each `[T, 1, dim]` in the model dtype."""
        pos = positions.to(torch.float32)[:, None]
        freqs = pos * self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            far = positions[:, None] >= self.long_from
            freqs = torch.where(far, pos * self.long_inv_freq[None, :], freqs)
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        cos = torch.cat((cos, cos), dim=-1).to(self.dtype)
        sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """Rotate `x` (`[T, heads, D]`); the decoder inlines the full-rotation case."""
        if not self.partial:
            return torch.addcmul(x * cos, x.roll(self.half, -1), sin_signed)
        rot = x[..., : self.dim]
        turned = torch.addcmul(rot * cos, rot.roll(self.half, -1), sin_signed)
        return torch.cat([turned, x[..., self.dim :]], -1)


def rotate_in_place(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin_signed: torch.Tensor,
                    qk_norm: torch.Tensor | None = None, eps: float = 0.0) -> bool:
    """Rotate the first `heads` heads of a CPU float32 `qkv [T, all heads, D]` in place with
    the C kernel (kernels/rotary.c), each head first RMS-normed times its row of `qk_norm`
    (`[heads, D]`) when given: what `Rotary.apply` (after the q/k norm) computes, without
    its three `[T, heads, D]` temporaries. False (nothing done) where the kernel does not
    take these tensors (full rotation only: the caller checks `Rotary.partial`)."""
    T, _, D = qkv.shape
    if (qkv.device.type != "cpu" or qkv.dtype != torch.float32 or qkv.stride(2) != 1 or qkv.stride(1) != D
            or cos.dtype != torch.float32 or sin_signed.dtype != torch.float32 or cos.shape != (T, 1, D)
            or sin_signed.shape != (T, 1, D) or not cos.is_contiguous() or not sin_signed.is_contiguous()):  # fmt: skip
        return False
    if qk_norm is not None and (qk_norm.dtype != torch.float32 or qk_norm.shape != (heads, D)
                                or not qk_norm.is_contiguous()):  # fmt: skip
        return False
    norm_ptr = None if qk_norm is None else qk_norm.data_ptr()
    return bool(kernel().rope_rows(qkv.data_ptr(), T, qkv.stride(0), heads, D, cos.data_ptr(),
                                   sin_signed.data_ptr(), D, norm_ptr, float(eps)))  # fmt: skip
