"""K-quant blocks (Q4_K, Q5_K, Q6_K) written from the format's definition, for tests.

gguf-py dequantizes K-quants but does not quantize them, and llama.cpp's quantizers are not
importable here; these writers round each super-block of 256 weights plainly (no search
for the best scales, as llama.cpp's make_qkx2_quants does): what tests need is valid blocks
that gguf-py reads back close to the weights (checked in test_model_gguf_kquants.py).

    blocks = quantize_k(w, "Q4_K")   # w: float32 [rows, cols], cols % 256 == 0
    # -> uint8 [rows, cols / 256 * 144], GGUF's layout

Layouts (ggml's block_q4_K / block_q5_K / block_q6_K):
- Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins mn[8],
  qs[128]; sub-block s (32 weights) w = d sc[s] q - dmin mn[s], q in 0..15; qs byte
  32c + l holds q[64c + l] (low nibble) and q[64c + 32 + l] (high).
- Q5_K (176): as Q4_K with q in 0..31, qh[32] before qs: bit b of qh[l] is bit 4 of q[32b + l].
- Q6_K (210): ql[128], qh[64], int8 scales[16], fp16 d; w = d scales[j / 16] (q - 32), q in
  0..63; q[128n + 32k + l]'s low 4 bits in ql[64n + 32(k & 1) + l] (low nibble for k < 2),
  its top 2 in bits 2k, 2k+1 of qh[32n + l].
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _fp16(v: np.ndarray) -> np.ndarray:
    """`[n]` float → `[n, 2]` uint8, little-endian float16."""
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit `sc`, `mn` `[n, 8]` → the 12 scale bytes `[n, 12]` (the inverse of gguf-py's
    Q4_K.get_scale_min)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = mn[:, j] | ((mn[:, j + 4] >> 4) << 6)
        out[:, 8 + j] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    return out


def _asymmetric(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K rounding of super-blocks `x [n, 256]`: (d, dmin, sc, mn, q)."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # mins at or below 0: w = scale q - (-lo)
    scale = (sub.max(-1) - lo) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        step = (d[:, None] * sc)[..., None]  # [n, 8, 1]
        off = (dmin[:, None] * mn)[..., None]
        q = np.where(step > 0, np.rint((sub + off) / step), 0).clip(0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q.reshape(n, QK_K)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _asymmetric(x, 15)
    qs = np.concatenate([q[:, 64 * c : 64 * c + 32] | (q[:, 64 * c + 32 : 64 * c + 64] << 4) for c in range(4)], 1)
    return np.concatenate([_fp16(d), _fp16(dmin), _pack_scales(sc, mn), qs], 1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _asymmetric(x, 31)
    lo = q & 0xF
    qs = np.concatenate([lo[:, 64 * c : 64 * c + 32] | (lo[:, 64 * c + 32 : 64 * c + 64] << 4) for c in range(4)], 1)
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for b in range(8):
        qh |= ((q[:, 32 * b : 32 * b + 32] >> 4) & 1) << b
    return np.concatenate([_fp16(d), _fp16(dmin), _pack_scales(sc, mn), qh, qs], 1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(-128, 127).astype(np.int8)
        step = (d[:, None] * sc.astype(np.float32))[..., None]
        q = np.where(step != 0, np.rint(sub / step), 0).clip(-32, 31)
    u = (q + 32).astype(np.uint8).reshape(n, QK_K)
    ql = np.zeros((n, 128), dtype=np.uint8)
    qh = np.zeros((n, 64), dtype=np.uint8)
    for half in range(2):
        base = 128 * half
        for k in range(4):
            part = u[:, base + 32 * k : base + 32 * k + 32]
            at = 64 * half + 32 * (k & 1)
            ql[:, at : at + 32] |= (part & 0xF) << (4 if k >= 2 else 0)
            qh[:, 32 * half : 32 * half + 32] |= (part >> 4) << (2 * k)
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16(d)], 1)


_WRITERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize_k(w: np.ndarray, qtype: str) -> np.ndarray:
    """float `[rows, cols]` (cols a multiple of 256) as `qtype` blocks, uint8 `[rows, cols
    / 256 * block bytes]`."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = w.shape
    if cols % QK_K:
        raise ValueError(f"{qtype} needs rows of a multiple of {QK_K} weights, got {cols}")
    blocks = _WRITERS[qtype](w.reshape(-1, QK_K))
    return np.ascontiguousarray(blocks.reshape(rows, cols // QK_K * BLOCK_BYTES[qtype]))
