"""Weight-only quantized matrices on CPU, in GGML's block formats: Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 (blocks of 32 weights) and the K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256).

`QuantWeight` is a `[rows, cols]` weight made of GGML blocks. It starts as the blocks
exactly as a GGUF file stores them (`uint8 [cols / block elements * block bytes]` a row),
addressed by a table of row addresses (`rowptr`): the rows may lie in a read-only mapping
of the GGUF file (nothing copied, see `gguf_weights`), in several tensors stacked (one
fused QKV or gate+up matrix: `cat`) or in another order (llama.cpp's Q/K row permutation
undone: `take_rows`), all without moving a byte. `owners` keeps whatever holds the bytes
alive. Tensors of different types stack too (llama.cpp's K-quant mixes store a layer's V
rows as Q6_K and its Q and K rows as Q4_K): the weight is then a stack of `parts`, one
per run of rows of one type, which the kernel multiplies part after part into one output.

`pack` then copies the blocks once into the kernel's tile layout (kernels/common.h: 8 rows
interleaved, the same bytes reordered, in anonymous memory backed by huge pages where the
OS allows), and lets the source go: a model's matrices are packed when the model is built,
so the file's pages are read once and not kept. Products and dequantization read the
tiles (a weight not yet packed is packed by its first one).

Products (`matmul`) run in the C kernel (`qkernel`): below `GEMM8_MIN_ROWS` activation
rows (decode) with activations as one int16 per value per block of 32 (within ~1e-5 of
float32 products; kernels/qmatmul.c), from there on (prefill) with int8 activations and
integer multiply-adds (VNNI's vpdpbusd where the CPU has it; kernels/gemm8.c), whose
accuracy cost is measured (benchmarks/bench_quant_accuracy.py), not exact. No product
makes a float32 copy of the matrix.

`quantize(w, qtype)` packs a float matrix (HF checkpoints quantized at load):
- Q8_0: per 32 weights, d = max|w| / 127, q = round(w / d);
- Q4_1: per 32 weights, m = min w, d = (max w - m) / 15, q = round((w - m) / d).
Both round as GGML's reference quantizers do, so the errors are the usual ones.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
import torch

from .qkernel import G8_GLU, G8_NORM, kernel

# GGML type codes (as in GGUF) the kernel multiplies, with their blocks' weights and bytes.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCK = 32
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q4_K: 144, Q5_K: 176, Q6_K: 210}
BLOCK_ELEMS = {t: 256 if t >= Q4_K else BLOCK for t in BLOCK_BYTES}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
              Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}  # fmt: skip
# Activation rows from which `matmul` quantizes activations to int8 (kernels/gemm8.c: a
# prefill's products) instead of int16 (kernels/qmatmul.c: up to a decode batch's 64).
# RADIXLM_INT8_MIN_ROWS raises it (e.g. 1000000: int16 everywhere, products within ~1e-5
# of float32's, prefill slower).
GEMM8_MIN_ROWS = max(1, int(os.environ.get("RADIXLM_INT8_MIN_ROWS", "65")))
DEQUANT_MIN_ROWS = GEMM8_MIN_ROWS  # its former name (from there on products were dequantized)
MAX_PARTS = 8  # row blocks of different types one stacked weight may hold (kernels/decode.c)
_HUGE_MIN_BYTES = 4 << 20  # tiles from this size ask for transparent huge pages


def _tile_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh anonymous memory as a uint8 tensor; for big matrices advised to
    use huge pages (fewer TLB misses while a decode step streams every weight once)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                    prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
    if nbytes >= _HUGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


class QuantWeight:
    """A `[rows, cols]` weight as GGML blocks: row n's blocks at address `rowptr[n]` until
    `pack`, then in `tiles` (the kernel's layout; `rowptr` None). A stack of several types
    has `parts` (single-type weights, in row order) instead, and `qtype` None."""

    __slots__ = ("cols", "owners", "parts", "qtype", "rowptr", "rows", "tiles", "_desc")

    def __init__(self, blocks: torch.Tensor | np.ndarray | None, qtype: int, rows: int,
                 cols: int, *, rowptr: torch.Tensor | None = None, owners: tuple = ()):
        """From `blocks` (`uint8 [rows, cols / block elements * block bytes]`, C-contiguous,
        CPU; a torch tensor or a numpy array, possibly read-only), or from a row table
        `rowptr` whose memory `owners` keep alive."""
        if qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported quantized type {qtype}")
        if cols % BLOCK_ELEMS[qtype]:
            raise ValueError(f"{TYPE_NAMES[qtype]} rows need a multiple of {BLOCK_ELEMS[qtype]} "
                             f"columns, got {cols}")  # fmt: skip
        self.qtype: int | None = qtype
        self.rows, self.cols = rows, cols
        self.parts: tuple[QuantWeight, ...] | None = None
        self.tiles: torch.Tensor | None = None
        self._desc: torch.Tensor | None = None
        if rowptr is not None:
            if rowptr.dtype != torch.int64 or tuple(rowptr.shape) != (rows,):
                raise ValueError(f"rowptr must be int64 [{rows}]")
            self.rowptr, self.owners = rowptr.contiguous(), tuple(owners)
            return
        if blocks is None:
            raise ValueError("QuantWeight needs blocks or a rowptr")
        base, shape, contiguous = _buffer(blocks)
        want = (rows, cols // BLOCK_ELEMS[qtype] * BLOCK_BYTES[qtype])
        if shape != want:
            raise ValueError(f"blocks of shape {shape}, expected uint8 {want}")
        if not contiguous:
            raise ValueError("quantized blocks must be a C-contiguous CPU array")
        self.rowptr = base + torch.arange(rows, dtype=torch.int64) * self.row_bytes
        self.owners = (blocks,)

    @classmethod
    def _stack(cls, parts: list[QuantWeight]) -> QuantWeight:
        """Single-type weights of one width stacked (row order kept), no copy."""
        self = cls.__new__(cls)
        self.qtype, self.rowptr, self.owners, self.tiles, self._desc = None, None, (), None, None
        self.parts = tuple(parts)
        self.rows, self.cols = sum(p.rows for p in parts), parts[0].cols
        return self

    @classmethod
    def from_tiles(cls, tiles: torch.Tensor, qtype: int, rows: int, cols: int) -> QuantWeight:
        """A weight already packed: `tiles` (uint8, `q_tiled_bytes` long; e.g. a view of a
        tile cache file, tile_cache.py) in the kernel's layout."""
        self = cls.__new__(cls)
        if qtype not in BLOCK_BYTES or cols % BLOCK_ELEMS[qtype]:
            raise ValueError(f"no {rows} x {cols} weight of type {qtype}")
        if tiles.dtype != torch.uint8 or tiles.numel() != kernel().q_tiled_bytes(qtype, rows, cols):
            raise ValueError("tiles of the wrong size for this weight")
        self.qtype, self.rows, self.cols, self.tiles = qtype, rows, cols, tiles
        self.rowptr, self.owners, self.parts, self._desc = None, (), None, None
        return self

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's blocks (a stack: of its first part's)."""
        first = self.parts[0] if self.parts else self
        return first.cols // BLOCK_ELEMS[first.qtype] * BLOCK_BYTES[first.qtype]

    def pack(self, into: torch.Tensor | None = None) -> QuantWeight:
        """Copy the blocks into the kernel's tile layout (once) and release the source rows
        (`rowptr` and `owners`: a mapped file's pages are no longer this weight's). `into`:
        the uint8 memory to pack into (`q_tiled_bytes` long; default fresh anonymous
        memory)."""
        if self.parts is not None:
            for p in self.parts:
                p.pack()
        elif self.tiles is None:
            k = kernel()
            need = k.q_tiled_bytes(self.qtype, self.rows, self.cols)
            tiles = _tile_buffer(need) if into is None else into
            if tiles.dtype != torch.uint8 or tiles.numel() != need:
                raise ValueError(f"packing needs {need} bytes of uint8 memory")
            k.q_pack(self.rowptr.data_ptr(), self.qtype, self.cols, self.rows, tiles.data_ptr())
            self.tiles, self.rowptr, self.owners = tiles, None, ()
        return self

    @property
    def packed(self) -> bool:
        return all(p.tiles is not None for p in self.parts) if self.parts else self.tiles is not None

    def tiles_ptr(self) -> int:
        """Address of the tiles (packing first if needed), for the kernel (one type)."""
        if self.parts is not None:
            raise ValueError("a stack of several types has no one tile array; use desc_ptr")
        return self.pack().tiles.data_ptr()

    def desc(self) -> torch.Tensor:
        """The kernel's description of the matrix (packing first): int64 `[parts, 3]`, per
        run of rows of one type {rows, qtype, tiles address} (kernels/common.h, qmat)."""
        if self._desc is None:
            self.pack()
            parts = self.parts or (self,)
            self._desc = torch.tensor([[p.rows, p.qtype, p.tiles.data_ptr()] for p in parts],
                                      dtype=torch.int64)  # fmt: skip
        return self._desc

    def desc_ptr(self) -> int:
        return self.desc().data_ptr()

    @property
    def nparts(self) -> int:
        return len(self.parts) if self.parts else 1

    @property
    def blocks(self) -> torch.Tensor:
        """The GGML blocks `uint8 [rows, row bytes]` (GGUF's layout), a copy (one type)."""
        if self.parts is not None:
            raise ValueError("a stack of several types has no one block layout; see .parts")
        out = torch.empty(self.rows, self.row_bytes, dtype=torch.uint8)
        k = kernel()
        if self.tiles is not None:
            k.q_unpack_rows(self.tiles.data_ptr(), self.qtype, self.cols, self.rows, out.data_ptr())
        else:
            k.q_gather_rows(self.rowptr.data_ptr(), self.qtype, self.cols, self.rows,
                            out.data_ptr())  # fmt: skip
        return out

    def _row_table(self) -> tuple[torch.Tensor, tuple]:
        """(rowptr, owners) of the GGML rows: the source's, or of a copy once packed (for
        `take_rows`)."""
        if self.tiles is None:
            return self.rowptr, self.owners
        blocks = self.blocks
        return blocks.data_ptr() + torch.arange(self.rows, dtype=torch.int64) * self.row_bytes, (blocks,)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        """Bytes read by one pass over the matrix (its GGML blocks)."""
        if self.parts is not None:
            return sum(p.nbytes for p in self.parts)
        return self.rows * self.row_bytes

    @property
    def type_name(self) -> str:
        """The block type ('Q4_K'), or a stack's types joined ('Q4_K+Q6_K')."""
        if self.parts is not None:
            return "+".join(sorted({p.type_name for p in self.parts}))
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
        return _rows_product(x, self.desc(), self.rows, self.cols, bias, out, accumulate)

    def matmul_glu(self, gu: torch.Tensor, out: torch.Tensor | None = None,
                   accumulate: bool = False) -> torch.Tensor:  # fmt: skip
        """`(silu(gate) * up) @ W.T` for float32 `gu [M, 2 cols]` = `[gate | up]` (a SwiGLU
        MLP's down projection; with `accumulate`, added into `out`). From `GEMM8_MIN_ROWS`
        rows the kernel forms each row's input as it quantizes it (no `[M, cols]`
        intermediate, no separate pass); fewer rows take it from torch."""
        c = self.cols
        if gu.dtype == torch.float32 and gu.dim() == 2 and gu.shape[1] == 2 * c and gu.shape[0] < GEMM8_MIN_ROWS:
            act = torch.nn.functional.silu(gu[:, :c]) * gu[:, c:]
            return _rows_product(act, self.desc(), self.rows, c, None, out, accumulate)
        return _rows_product(gu, self.desc(), self.rows, c, None, out, accumulate, glu=True)  # (checks gu)

    def matmul_norm(self, x: torch.Tensor, norm_w: torch.Tensor, eps: float,
                    bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """`rms_norm(x, norm_w, eps) @ W.T (+ bias)` for float32 `x [M, cols]` (a layer's
        input norm and the projection after it). From `GEMM8_MIN_ROWS` rows the kernel
        norms each row as it quantizes it (no normed `[M, cols]` copy, no torch norm);
        fewer rows take torch's norm."""
        c = self.cols
        if (x.shape[0] < GEMM8_MIN_ROWS or norm_w.dtype != torch.float32 or norm_w.shape != (c,)
                or not norm_w.is_contiguous()):  # fmt: skip
            return self.matmul(torch.nn.functional.rms_norm(x, (c,), norm_w, eps), bias)
        return _rows_product(x, self.desc(), self.rows, c, bias, norm=(norm_w, eps))

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 weights: all rows `[rows, cols]`, or the rows listed in `rows` (int64)."""
        if self.parts is not None:
            full = torch.cat([p.dequantize() for p in self.parts])
            return full if rows is None else full[rows.to(torch.int64)]
        k, tiles = kernel(), self.tiles_ptr()
        if rows is None:
            out = torch.empty(self.rows, self.cols)
            k.q_dequant_rows(tiles, self.qtype, self.cols, None, self.rows, out.data_ptr())
            return out
        rows = rows.to(torch.int64).contiguous()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise IndexError(f"row index out of range for {self.rows} rows")
        out = torch.empty(rows.numel(), self.cols)
        k.q_dequant_rows(tiles, self.qtype, self.cols, rows.data_ptr(), rows.numel(),
                         out.data_ptr())  # fmt: skip
        return out

    def take_rows(self, order: torch.Tensor | np.ndarray) -> QuantWeight:
        """The rows `order` (int64) of this weight (one type), as a new weight over the same
        bytes (a packed weight's rows are copied out first)."""
        if self.parts is not None:
            raise ValueError("take_rows needs a weight of one type")
        order = torch.as_tensor(np.asarray(order, dtype=np.int64))
        if order.numel() and (int(order.min()) < 0 or int(order.max()) >= self.rows):
            raise IndexError(f"row index out of range for {self.rows} rows")
        rowptr, owners = self._row_table()
        return QuantWeight(None, self.qtype, order.numel(), self.cols, rowptr=rowptr[order],
                           owners=owners)  # fmt: skip

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Rows of several weights stacked (one fused QKV or gate+up matrix), no copy:
        consecutive weights of one type not yet packed become one weight over their rows;
        weights of different types, or packed ones (their tiles as they are), make a stack
        of `parts`."""
        if len({p.cols for p in parts}) != 1:
            raise ValueError("can only stack quantized weights of one width")
        flat = [q for p in parts for q in (p.parts or (p,))]
        runs: list[list[QuantWeight]] = []
        for q in flat:  # consecutive unpacked weights of one type become one part
            if runs and runs[-1][0].qtype == q.qtype and not runs[-1][0].packed and not q.packed:
                runs[-1].append(q)
            else:
                runs.append([q])
        if len(runs) > MAX_PARTS:
            raise ValueError(f"a stacked weight may hold at most {MAX_PARTS} runs of one type")
        merged = [_cat_one_type(run) for run in runs]
        return merged[0] if len(merged) == 1 else QuantWeight._stack(merged)


def matmul_stacked(x: torch.Tensor, weights: list[QuantWeight]) -> torch.Tensor:
    """`x @ [w_0; w_1; ...].T` for weights of one width chosen per call (a token's experts):
    one kernel call, so `x` is quantized once and the threads are woken once, instead of a
    call per weight. Nothing is copied: the weights' descriptions are joined."""
    desc = torch.cat([w.desc() for w in weights])
    return _rows_product(x, desc, sum(w.rows for w in weights), weights[0].cols)


def _rows_product(x: torch.Tensor, desc: torch.Tensor, rows: int, cols: int,
                  bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  accumulate: bool = False, glu: bool = False,
                  norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:  # fmt: skip
    """The kernel's product of float32 `x [M, cols]` with the matrix `desc` describes
    (`QuantWeight.desc`: runs of packed rows, `rows` in all); with `glu`, of
    `silu(x[:, :cols]) * x[:, cols:]` for `x [M, 2 cols]`; with `norm` (weight [cols]
    float32, eps), of x RMS-normed (`F.rms_norm`); either with int8 activations whatever M
    (q_gemm8_input)."""
    width = 2 * cols if glu else cols
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"expected float32 [M, {width}] input, got {x.dtype} {tuple(x.shape)}")
    if accumulate and out is None:
        raise ValueError("accumulate needs out")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    if out is None:
        out = x.new_empty(m, rows)
    if m == 0:
        return out
    k, min8 = kernel(), GEMM8_MIN_ROWS
    int8 = glu or norm is not None or m >= min8
    scratch = torch.empty(k.q_matmul_scratch_bytes8(m, cols, int(int8)), dtype=torch.uint8)
    if glu or norm is not None:
        kind, norm_w, eps = (G8_GLU, None, 0.0) if glu else (G8_NORM, norm[0].data_ptr(), float(norm[1]))
        k.q_gemm8_input(x.data_ptr(), m, x.stride(0), cols, desc.data_ptr(), desc.shape[0], out.data_ptr(),
                        out.stride(0), None if bias is None else bias.data_ptr(), int(accumulate), kind, norm_w,
                        eps, scratch.data_ptr())  # fmt: skip
        return out
    k.q_matmul_rows(
        x.data_ptr(), m, x.stride(0), cols, desc.data_ptr(), desc.shape[0],
        out.data_ptr(), out.stride(0), None if bias is None else bias.data_ptr(),
        int(accumulate), scratch.data_ptr(), min8,
    )  # fmt: skip
    return out


def _cat_one_type(parts: list[QuantWeight]) -> QuantWeight:
    """Weights of one type and width stacked over the same bytes (row tables joined)."""
    if len(parts) == 1:
        return parts[0]
    tables = [p._row_table() for p in parts]
    rowptr = torch.cat([t[0] for t in tables])
    owners = tuple(o for t in tables for o in t[1])
    return QuantWeight(None, parts[0].qtype, rowptr.numel(), parts[0].cols, rowptr=rowptr,
                       owners=owners)  # fmt: skip


def _buffer(blocks: Any) -> tuple[int, tuple[int, ...], bool]:
    """(address, shape, C-contiguous) of a 2-D uint8 CPU torch tensor or numpy array."""
    if isinstance(blocks, torch.Tensor):
        if blocks.dtype != torch.uint8 or blocks.device.type != "cpu" or blocks.dim() != 2:
            raise ValueError("quantized blocks must be a 2-D uint8 CPU tensor")
        return blocks.data_ptr(), tuple(blocks.shape), blocks.is_contiguous()
    arr = np.asarray(blocks)
    if arr.dtype != np.uint8 or arr.ndim != 2:
        raise ValueError("quantized blocks must be a 2-D uint8 array")
    return arr.__array_interface__["data"][0], arr.shape, bool(arr.flags.c_contiguous)


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
