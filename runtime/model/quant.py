"""Weight-only quantized matrices on CPU, in GGML's block formats (Q8_0, Q4_0, Q4_1).

`QuantWeight` holds a `[N, K]` weight as packed blocks (`uint8 [N, K/32 * block_bytes]`,
GGUF's own layout, so GGUF tensors are used as stored) and multiplies float32 activations
by it with the C kernel (`qkernel`). Up to `GEMV_MAX_ROWS` activation rows (decode) stream
the packed weights; more rows (prefill) dequantize the matrix once and use torch's GEMM,
which is compute-bound there and faster than a per-row kernel.

`quantize(w, qtype)` packs a float matrix (HF checkpoints quantized at load):
- Q8_0: per 32 weights, d = max|w| / 127, q = round(w / d);
- Q4_1: per 32 weights, m = min w, d = (max w - m) / 15, q = round((w - m) / d).
Both round as GGML's reference quantizers do, so the errors are the usual ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .qkernel import kernel

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML type codes (as in GGUF)
BLOCK = 32
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
# Activation rows up to which the kernel streams the weights (see the module docstring).
GEMV_MAX_ROWS = 16


@dataclass(frozen=True)
class QuantWeight:
    """A `[rows, cols]` weight as GGML blocks; `blocks` is `uint8 [rows, cols/32 * bytes]`."""

    blocks: torch.Tensor
    qtype: int
    rows: int
    cols: int

    def __post_init__(self):
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported quantized type {self.qtype}")
        if self.cols % BLOCK:
            raise ValueError(f"quantized rows need a multiple of {BLOCK} columns, got {self.cols}")
        want = (self.rows, self.cols // BLOCK * BLOCK_BYTES[self.qtype])
        if tuple(self.blocks.shape) != want or self.blocks.dtype != torch.uint8:
            raise ValueError(f"blocks of shape {tuple(self.blocks.shape)}, expected uint8 {want}")
        if not self.blocks.is_contiguous() or self.blocks.device.type != "cpu":
            raise ValueError("quantized blocks must be a contiguous CPU tensor")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.qtype]

    def matmul(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> torch.Tensor:
        """`x @ W.T (+ bias)` for float32 `x [M, cols]`; with `accumulate`, added into `out`
        (a residual stream updated in place) and `out` returned."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.cols:
            raise ValueError(f"expected float32 [M, {self.cols}] input, got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        if m > GEMV_MAX_ROWS:
            y = torch.mm(x, self.dequantize().t())
            if bias is not None:
                y += bias
            if accumulate:
                return out.add_(y)
            if out is not None:
                return out.copy_(y)
            return y
        if out is None:
            if accumulate:
                raise ValueError("accumulate needs out")
            out = x.new_empty(m, self.rows)
        kernel().q_matmul(
            x.data_ptr(), m, x.stride(0), self.cols, self.blocks.data_ptr(), self.qtype,
            self.rows, out.data_ptr(), out.stride(0),
            None if bias is None else bias.data_ptr(), int(accumulate),
        )  # fmt: skip
        return out

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 weights: all rows `[rows, cols]`, or the rows listed in `rows` (int64)."""
        if rows is None:
            out = torch.empty(self.rows, self.cols)
            kernel().q_dequant_rows(self.blocks.data_ptr(), self.qtype, self.cols, None, self.rows,
                                    out.data_ptr())  # fmt: skip
            return out
        rows = rows.to(torch.int64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise IndexError(f"row index out of range for {self.rows} rows")
        out = torch.empty(rows.numel(), self.cols)
        kernel().q_dequant_rows(self.blocks.data_ptr(), self.qtype, self.cols, rows.data_ptr(),
                                rows.numel(), out.data_ptr())  # fmt: skip
        return out

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Rows of several weights stacked (one fused QKV or gate+up matrix)."""
        qtypes = {p.qtype for p in parts}
        cols = {p.cols for p in parts}
        if len(qtypes) != 1 or len(cols) != 1:
            raise ValueError("can only stack quantized weights of one type and width")
        blocks = torch.cat([p.blocks for p in parts], 0)
        return QuantWeight(blocks, parts[0].qtype, blocks.shape[0], parts[0].cols)


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """`[..., 1]` float → `[..., 2]` uint8: the little-endian bytes of its float16."""
    return v.to(torch.float16).contiguous().view(torch.uint8)


def quantize(w: torch.Tensor, qtype: int) -> QuantWeight:
    """Pack a float `[N, K]` matrix (K a multiple of 32) into Q8_0 or Q4_1 blocks."""
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"quantize needs a [N, K] matrix with K % {BLOCK} == 0, got {tuple(w.shape)}")
    n, k = w.shape
    b = w.detach().to(torch.float32).cpu().reshape(n, k // BLOCK, BLOCK)
    if qtype == Q8_0:
        amax = b.abs().amax(-1, keepdim=True)
        d = (amax / 127).to(torch.float16).to(torch.float32)
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (b * inv).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        packed = torch.cat([_fp16_bytes(d), q], -1)
    elif qtype == Q4_1:
        lo = b.amin(-1, keepdim=True)
        hi = b.amax(-1, keepdim=True)
        d = ((hi - lo) / 15).to(torch.float16).to(torch.float32)
        m = lo.to(torch.float16).to(torch.float32)
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((b - m) * inv).round().clamp(0, 15).to(torch.uint8)
        nib = q[..., :16] | (q[..., 16:] << 4)
        packed = torch.cat([_fp16_bytes(d), _fp16_bytes(m), nib], -1)
    else:
        raise ValueError(f"quantize supports Q8_0 and Q4_1, not type {qtype}")
    return QuantWeight(packed.reshape(n, -1).contiguous(), qtype, n, k)
