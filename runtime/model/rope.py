"""Rotary position embeddings (HF "rotate_half" layout), with default/linear/llama3/yarn scaling.

The inverse frequencies follow transformers' `modeling_rope_utils` formulas, computed in
float32 the same way, so cos/sin match HF bit for bit.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inv_freq_and_scale(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """`(inv_freq[head_dim // 2] float32, attention_scaling)` for a RoPE config."""
    dim = head_dim
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


class Rotary:
    """Per-forward cos/sin for given positions, applied to q and k together.

    `apply(qk, cos, sin_signed)` rotates a `[T, heads, D]` tensor: with `sin_signed =
    cat(-sin, sin)`, `roll(x, D/2) * sin_signed == rotate_half(x) * sin`, so the rotation is
    three tensor ops for all q and k heads at once.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device, dtype: torch.dtype):
        inv_freq, scale = inv_freq_and_scale(rope, head_dim)
        self.inv_freq = inv_freq.to(device)
        self.scale = scale
        self.half = head_dim // 2
        self.dtype = dtype

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin_signed)`, each `[T, 1, D]` in the model dtype."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        cos = torch.cat((cos, cos), dim=-1).to(self.dtype)
        sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """Rotate `x` (`[T, heads, D]`); the decoder inlines this same expression."""
        return torch.addcmul(x * cos, x.roll(self.half, -1), sin_signed)
