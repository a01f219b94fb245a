"""Weight-only quantized matrices on CPU, in GGML's block formats (Q8_0, Q4_0, Q4_1).

`QuantWeight` is built from a `[N, K]` weight's GGML blocks (`uint8 [N, K/32 *
block_bytes]`, GGUF's own layout, so GGUF tensors are used as stored) and keeps the same
bytes split the way the C kernel reads them (`qkernel`, kernels/qmatmul.c): the codes,
the fp16 scales and, for Q4_1, the fp16 offsets, each contiguous per row. `blocks` gives
the GGML layout back. Up to `GEMV_MAX_ROWS` activation rows (decode) stream the packed
weights, each activation held as two int8 digits per block of 32 (integer dot products
with AVX-512 VNNI; within ~1e-5 of float32 products, see the kernel); more rows (prefill)
dequantize the matrix once and use torch's float32 GEMM, which is compute-bound there.

`quantize(w, qtype)` packs a float matrix (HF checkpoints quantized at load):
- Q8_0: per 32 weights, d = max|w| / 127, q = round(w / d);
- Q4_1: per 32 weights, m = min w, d = (max w - m) / 15, q = round((w - m) / d).
Both round as GGML's reference quantizers do, so the errors are the usual ones.
"""

from __future__ import annotations

import torch

from .qkernel import kernel

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML type codes (as in GGUF)
BLOCK = 32
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
CODE_BYTES = {Q4_0: 16, Q4_1: 16, Q8_0: 32}  # a block's codes, without its scale/offset
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
# Activation rows up to which the kernel streams the weights (see the module docstring).
GEMV_MAX_ROWS = 64


class QuantWeight:
    """A `[rows, cols]` weight as GGML blocks, kept as `codes` (`uint8 [rows, nb *
    CODE_BYTES]`), `d` (fp16 scales `[rows, nb]`) and `m` (fp16 offsets, Q4_1 only)."""

    __slots__ = ("codes", "cols", "d", "m", "qtype", "rows", "_scratch")

    def __init__(self, blocks: torch.Tensor | None, qtype: int, rows: int, cols: int, *,
                 parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None):
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported quantized type {qtype}")
        if cols % BLOCK:
            raise ValueError(f"quantized rows need a multiple of {BLOCK} columns, got {cols}")
        self.qtype, self.rows, self.cols = qtype, rows, cols
        self._scratch = torch.empty(0, dtype=torch.uint8)
        nb = cols // BLOCK
        if parts is not None:  # already in the kernel's layout (`cat`)
            self.codes, self.d, self.m = parts
            return
        assert blocks is not None
        want = (rows, nb * BLOCK_BYTES[qtype])
        if tuple(blocks.shape) != want or blocks.dtype != torch.uint8:
            raise ValueError(f"blocks of shape {tuple(blocks.shape)}, expected uint8 {want}")
        if not blocks.is_contiguous() or blocks.device.type != "cpu":
            raise ValueError("quantized blocks must be a contiguous CPU tensor")
        self.codes = torch.empty(rows, nb * CODE_BYTES[qtype], dtype=torch.uint8)
        self.d = torch.empty(rows, nb, dtype=torch.float16)
        self.m = torch.empty(rows, nb, dtype=torch.float16) if qtype == Q4_1 else None
        kernel().q_repack(blocks.data_ptr(), qtype, rows, cols, self.codes.data_ptr(),
                          self.d.data_ptr(), 0 if self.m is None else self.m.data_ptr())

    @property
    def blocks(self) -> torch.Tensor:
        """The GGML blocks `uint8 [rows, cols/32 * block_bytes]` (GGUF's layout), rebuilt."""
        out = torch.empty(self.rows, self.cols // BLOCK * BLOCK_BYTES[self.qtype], dtype=torch.uint8)
        kernel().q_unpack(self.codes.data_ptr(), self.d.data_ptr(), self.m_ptr, self.qtype,
                          self.rows, self.cols, out.data_ptr())  # fmt: skip
        return out

    @property
    def m_ptr(self) -> int:
        """Address of the Q4_1 offsets for the kernel (0: none)."""
        return 0 if self.m is None else self.m.data_ptr()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        """Bytes read by one pass over the matrix (the same as its GGML blocks)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m)
                   if t is not None)  # fmt: skip

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
        k = kernel()
        need = k.q_matmul_scratch_bytes(m, self.cols)
        if self._scratch.numel() < need:  # per weight: calls on one weight never overlap
            self._scratch = torch.empty(need, dtype=torch.uint8)
        k.q_matmul(
            x.data_ptr(), m, x.stride(0), self.cols, self.codes.data_ptr(), self.d.data_ptr(),
            self.m_ptr, self.qtype, self.rows, out.data_ptr(), out.stride(0),
            None if bias is None else bias.data_ptr(), int(accumulate), self._scratch.data_ptr(),
        )  # fmt: skip
        return out

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 weights: all rows `[rows, cols]`, or the rows listed in `rows` (int64)."""
        k = kernel()
        if rows is None:
            out = torch.empty(self.rows, self.cols)
            k.q_dequant_rows(self.codes.data_ptr(), self.d.data_ptr(), self.m_ptr, self.qtype,
                             self.cols, None, self.rows, out.data_ptr())  # fmt: skip
            return out
        rows = rows.to(torch.int64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise IndexError(f"row index out of range for {self.rows} rows")
        out = torch.empty(rows.numel(), self.cols)
        k.q_dequant_rows(self.codes.data_ptr(), self.d.data_ptr(), self.m_ptr, self.qtype,
                         self.cols, rows.data_ptr(), rows.numel(), out.data_ptr())  # fmt: skip
        return out

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Rows of several weights stacked (one fused QKV or gate+up matrix)."""
        qtypes = {p.qtype for p in parts}
        cols = {p.cols for p in parts}
        if len(qtypes) != 1 or len(cols) != 1:
            raise ValueError("can only stack quantized weights of one type and width")
        q = parts[0]
        codes = torch.cat([p.codes for p in parts], 0)
        d = torch.cat([p.d for p in parts], 0)
        m = torch.cat([p.m for p in parts], 0) if q.m is not None else None  # type: ignore[misc]
        return QuantWeight(None, q.qtype, codes.shape[0], q.cols, parts=(codes, d, m))


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
