"""The quantized-matmul kernel against an independent reference: gguf-py's own
dequantization of the same GGML blocks, multiplied in float64 by torch.

Every type the kernel keeps packed (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is
checked the same way. Blocks are random bytes with sane float16 scales, so every code and
every 6-bit scale value occurs. Packed rows dequantize bit-exactly to gguf-py's values.

Products are checked for 1..130 activation rows, with bias, accumulation into a residual,
and row-strided inputs. Below GEMM8_MIN_ROWS rows the kernel multiplies activations held
as one int16 per value per block of 32 (v = round(x / s), s = max|x| / 32767): the
reference quantizes them the same way in torch and keeps the float offsets (Q4_1 / Q5_1's
m, the K-quants' mins) on the exact x (`int16_reference`). From GEMM8_MIN_ROWS rows on
they are int8 (s = max|x| / 127), except values whose |x| exceeds OUTLIER_RMS times their
row's RMS: those are multiplied exactly and the rest of their block is quantized with its
own max|x| (`int8_reference`). Either way
the products are float32 sums of those exact terms in another order than float64's: a
relative bound of 1e-5 of the sum of |x|*|w| (the products' magnitude) covers that and
nothing more. Every build of the sources (the portable plain-C one, AVX2 without and with
VNNI, the native one: AVX-512 here) is held to the same references.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from radixlm.runtime.model import qkernel
from radixlm.runtime.model.quant import (
    BLOCK_BYTES,
    BLOCK_ELEMS,
    GEMM8_MIN_ROWS,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    TYPE_NAMES,
    QuantWeight,
    quantize,
)

QTYPES = {name: t for t, name in TYPE_NAMES.items()}
REL = 1e-5
TILE_MB = 4  # kernels/qmatmul.c: activation rows per pass over a tile
OUTLIER_RMS = 3.0  # kernels/gemm8.c: values above this times the row's RMS stay exact
OUTLIER_RMS_GLU = 2.5  # ... in an MLP's SiLU(gate) x up, formed in the product
SCALES_AT = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q4_K: (0, 2),
             Q5_K: (0, 2), Q6_K: (208,)}  # fmt: skip  # fp16 fields of each block


def widths(qtype: int) -> tuple[int, int]:
    """Two row widths for a type: 5 and 19 blocks of 32, or 1 and 3 super-blocks."""
    return (256, 768) if BLOCK_ELEMS[qtype] == 256 else (160, 608)


def random_blocks(rows: int, cols: int, qtype: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    nb, bb = cols // BLOCK_ELEMS[qtype], BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows, nb, bb), dtype=np.uint8)
    for at in SCALES_AT[qtype]:
        scales = rng.uniform(-0.05, 0.05, (rows, nb, 1)).astype(np.float16)
        raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, nb, 2)
    return QuantWeight(torch.from_numpy(raw.reshape(rows, nb * bb)), qtype, rows, cols)


def reference(w: QuantWeight) -> torch.Tensor:
    """gguf-py's dequantization (float64)."""
    deq = gguf.quants.dequantize(w.blocks.numpy(), gguf.GGMLQuantizationType(w.qtype))
    return torch.from_numpy(np.asarray(deq, dtype=np.float64)).reshape(w.rows, w.cols)


def block_offsets(w: QuantWeight) -> torch.Tensor:
    """The float offset of every weight (w = scale * code + offset): Q4_1 / Q5_1's m, the
    K-quants' -dmin * min of the sub-block (gguf-py's scale unpacking); zeros otherwise."""
    raw = w.blocks.numpy().reshape(w.rows, w.cols // BLOCK_ELEMS[w.qtype], BLOCK_BYTES[w.qtype])
    if w.qtype in (Q4_1, Q5_1):
        m = raw[..., 2:4].copy().view(np.float16).astype(np.float64)  # [rows, nb, 1]
        return torch.from_numpy(np.repeat(m, 32, axis=-1).reshape(w.rows, w.cols))
    if w.qtype in (Q4_K, Q5_K):
        dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float64)  # [rows, nsb, 1]
        _, mins = gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12).copy())
        off = -dmin * mins.reshape(w.rows, -1, 8).astype(np.float64)  # [rows, nsb, 8]
        return torch.from_numpy(np.repeat(off, 32, axis=-1).reshape(w.rows, w.cols))
    return torch.zeros(w.rows, w.cols, dtype=torch.float64)


def int16_activations(x: torch.Tensor) -> torch.Tensor:
    """`x` as the few-rows path multiplies it: per block of 32, v = round(x / s) with s =
    max|x| / 32767 (float32 arithmetic, round half to even, as the kernel), worth v s."""
    b = x.float().reshape(x.shape[0], -1, 32)
    s = b.abs().amax(-1, keepdim=True) / 32767.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    v = torch.round(b * inv).clamp(-32767, 32767)
    return (v.double() * s.double()).reshape(x.shape)


def int16_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """What the few-rows path computes, in float64: quantized activations times the
    weights' scaled codes, plus the float offsets times the exact activations."""
    ref_w, offsets = reference(w), block_offsets(w)
    return int16_activations(x) @ (ref_w - offsets).t() + x.double() @ offsets.t()


def _int8(b: torch.Tensor) -> torch.Tensor:
    s = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    return torch.round(b * inv) * s  # float32, as the kernel forms the residual


def outliers(x: torch.Tensor, t: float = OUTLIER_RMS) -> torch.Tensor:
    """Where x's values exceed t x their row's RMS (the values the kernel keeps exact), as a
    mask of x's shape."""
    x = x.float()
    rms = torch.sqrt((x * x).sum(-1) / x.shape[1])
    return x.abs() > t * rms[:, None]


def int8_activations(x: torch.Tensor, t: float = OUTLIER_RMS) -> torch.Tensor:
    """`x` as the many-rows path multiplies it: its outliers (above t x the row's RMS) exact;
    the other values per block of 32 as int8 v = round(x / s), s = their max|x| / 127."""
    x = x.float()
    big = outliers(x, t)
    small = torch.where(big, 0.0, x).reshape(x.shape[0], -1, 32)
    out = _int8(small).double().reshape(x.shape) + torch.where(big, x, 0.0).double()
    return out


def int8_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return int8_activations(x) @ reference(w).t()


def expected(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return int8_reference(x, w) if x.shape[0] >= GEMM8_MIN_ROWS else int16_reference(x, w)


def scale_of(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    return x.double().abs() @ reference(w).abs().t()


def activations(m: int, cols: int, seed: int) -> torch.Tensor:
    """Rows of blocks of different magnitudes, with two outlier channels (values the int8
    path keeps exact)."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.rand(m, cols // 32, 1, generator=g).expand(m, cols // 32, 32).reshape(m, cols)
    x = torch.randn(m, cols, generator=g) * mags
    x[:, 5] = 40.0
    x[:, cols - 3] = -35.0
    return x


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_dequantize_matches_gguf(name):
    w = random_blocks(40, widths(QTYPES[name])[1], QTYPES[name], seed=1)
    ref = reference(w)
    assert torch.equal(w.dequantize().double(), ref)
    rows = torch.tensor([39, 0, 7, 7])
    assert torch.equal(w.dequantize(rows).double(), ref[rows])


@pytest.mark.parametrize("name", sorted(QTYPES))
@pytest.mark.parametrize("m", [1, 2, 3, TILE_MB, TILE_MB + 1, 8, 13, GEMM8_MIN_ROWS - 1,
                               GEMM8_MIN_ROWS, 130])  # fmt: skip
@pytest.mark.parametrize("wide", [False, True])
def test_matmul_matches_reference(name, m, wide):
    qtype = QTYPES[name]
    cols = widths(qtype)[wide]
    w = random_blocks(131, cols, qtype, seed=m)  # 131 rows: partial chunks and tiles
    x = activations(m, cols, seed=m)
    g = torch.Generator().manual_seed(m)
    bias = torch.randn(131, generator=g)
    scale = scale_of(x, w)

    y = w.matmul(x)
    want = expected(x, w)
    assert (y.double() - want).abs().le(REL * scale + 1e-6).all()

    yb = w.matmul(x, bias)
    assert (yb.double() - (want + bias.double())).abs().le(REL * scale + 1e-5).all()

    resid = torch.randn(m, 131, generator=g)
    before = resid.clone()
    got = w.matmul(x, out=resid, accumulate=True)
    assert got.data_ptr() == resid.data_ptr()
    assert (resid.double() - (before.double() + want)).abs().le(REL * scale + 1e-5).all()

    wide_x = torch.zeros(m, cols + 240)
    wide_x[:, 100 : 100 + cols] = x
    strided = wide_x[:, 100 : 100 + cols]  # row stride cols + 240: read in place, not copied
    assert (w.matmul(strided).double() - want).abs().le(REL * scale + 1e-5).all()


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_many_rows_equal_each_row_alone(name):
    """40 activation rows at once (each tile swept by 4 rows a pass) against each row
    alone on the same weights, and both against float64 on the dequantized weights (the
    same function up to float summation order)."""
    qtype = QTYPES[name]
    cols = 768 if BLOCK_ELEMS[qtype] == 256 else 576
    w = random_blocks(70, cols, qtype, seed=11)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(11))
    many = w.matmul(x)
    alone = torch.cat([w.matmul(x[i : i + 1]) for i in range(40)])
    scale = scale_of(x, w)
    assert (many.double() - alone.double()).abs().le(REL * scale).all()
    exact = x.double() @ reference(w).t()
    assert (many.double() - exact).abs().le(1e-4 * scale).all()


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_quantized_activations_cost_almost_nothing(name):
    """int16 activations hold each value to half a step of max|x| / 32767 of its block:
    against exact float64 products on the same weights, within 1e-4 of the products'
    magnitude, an outlier channel included."""
    qtype = QTYPES[name]
    cols = 768 if BLOCK_ELEMS[qtype] == 256 else 576
    w = random_blocks(64, cols, qtype, seed=9)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(9))
    x[0, 5] = 40.0  # an outlier channel: its block's other values lose the most
    exact = x.double() @ reference(w).t()
    assert (w.matmul(x).double() - exact).abs().le(1e-4 * scale_of(x, w)).all()


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_int8_products_within_the_rounding_bound(name):
    """Many rows (int8): each activation is off by at most half its block's step, max|x| /
    254 over the block's values that are not outliers, and outliers not at all (an outlier
    channel of 40 among values ~1: in int8 its block's other values would lose up to 40 /
    254 each), so each product is within that sum weighted by |w| of the exact float64
    product."""
    qtype = QTYPES[name]
    cols = 768 if BLOCK_ELEMS[qtype] == 256 else 576
    w = random_blocks(64, cols, qtype, seed=13)
    x = torch.randn(80, cols, generator=torch.Generator().manual_seed(13))
    x[:, 5] = 40.0
    assert outliers(x)[:, 5].all()  # 40 > 3 x the row's RMS ~2
    small = torch.where(outliers(x), 0.0, x).double()
    half_step = small.reshape(80, -1, 32).abs().amax(-1) / 254  # [rows, blocks]
    bound = half_step.repeat_interleave(32, 1) @ reference(w).abs().t()
    exact = x.double() @ reference(w).t()
    assert (w.matmul(x).double() - exact).abs().le(bound + REL * scale_of(x, w)).all()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_int8_rows_do_not_depend_on_the_rows_beside_them(name):
    """A row's many-rows product is the same bit for bit whatever other rows share the
    call (outliers are each row's own: another row's add nothing to it), so
    a prefill computed in pieces equals one forward."""
    qtype = QTYPES[name]
    w = random_blocks(48, 768, qtype, seed=21)
    x = torch.randn(150, 768, generator=torch.Generator().manual_seed(21))
    x[100:, 40] = 60.0  # outliers in the last rows only
    x[:70, 700] = -50.0
    whole = w.matmul(x)
    assert torch.equal(w.matmul(x[:70]), whole[:70])
    assert torch.equal(w.matmul(x[70:]), whole[70:])
    assert torch.equal(w.matmul(x[30:130]), whole[30:130])


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0"])
def test_glu_product_is_the_down_projection_of_silu_gate_times_up(name):
    """`matmul_glu([gate | up])` is `(silu(gate) * up) @ W.T`: from GEMM8_MIN_ROWS rows the
    kernel forms the input row by row as it quantizes it (its own exp, within a few ulp of
    torch's: an int8 code may differ by one, so within one step per value of the int8
    product of torch's input; row for row, whatever rows share the call); fewer rows are
    torch's input through the same product, bit for bit; added into `out` with accumulate."""
    qtype = QTYPES[name]
    cols = 768 if BLOCK_ELEMS[qtype] == 256 else 576
    w = random_blocks(72, cols, qtype, seed=17)
    g = torch.Generator().manual_seed(17)
    gu = torch.randn(90, 2 * cols, generator=g) * 2
    act = torch.nn.functional.silu(gu[:, :cols]) * gu[:, cols:]
    step = act.double().reshape(90, -1, 32).abs().amax(-1) / 127  # one int8 step a block
    bound = step.repeat_interleave(32, 1) @ reference(w).abs().t()
    got = w.matmul_glu(gu)
    assert (got.double() - w.matmul(act).double()).abs().le(bound + 1e-5).all()
    assert (got.double() - act.double() @ reference(w).t()).abs().le(2 * bound + 1e-5).all()
    assert torch.equal(w.matmul_glu(gu[20:]), got[20:])
    assert torch.equal(w.matmul_glu(gu[:5]), w.matmul(act[:5]))  # below GEMM8_MIN_ROWS
    resid = torch.randn(90, 72, generator=g)
    before = resid.clone()
    assert w.matmul_glu(gu, out=resid, accumulate=True).data_ptr() == resid.data_ptr()
    assert (resid - before - got).abs().le(1e-4 * (1 + got.abs())).all()
    with pytest.raises(ValueError, match=f"expected float32 \\[M, {2 * cols}\\]"):
        w.matmul_glu(gu[:, :cols])


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0"])
def test_norm_product_is_the_projection_of_the_rms_normed_rows(name):
    """`matmul_norm(x, norm_w, eps)` is `rms_norm(x, norm_w, eps) @ W.T`: from
    GEMM8_MIN_ROWS rows the kernel norms each row as it quantizes it (its own float32 sum
    of squares, in another order than torch's: an int8 code may differ by one, so within
    one step per value of the int8 product of torch's normed rows); row for row, whatever
    rows share the call; fewer rows take torch's norm through the same product, bit for
    bit; a bias is added last, bit for bit."""
    qtype = QTYPES[name]
    cols = 768 if BLOCK_ELEMS[qtype] == 256 else 576
    w = random_blocks(72, cols, qtype, seed=19)
    g = torch.Generator().manual_seed(19)
    x = torch.randn(90, cols, generator=g) * 5
    x[:, 7] = 80.0  # an outlier channel (a residual stream's): an outlier in every row
    norm_w = torch.rand(cols, generator=g) + 0.5
    h = torch.nn.functional.rms_norm(x, (cols,), norm_w, 1e-5)
    step = h.double().reshape(90, -1, 32).abs().amax(-1) / 127  # one int8 step a block
    bound = step.repeat_interleave(32, 1) @ reference(w).abs().t()
    got = w.matmul_norm(x, norm_w, 1e-5)
    assert (got.double() - w.matmul(h).double()).abs().le(bound + 1e-5).all()
    assert (got.double() - h.double() @ reference(w).t()).abs().le(2 * bound + 1e-5).all()
    assert torch.equal(w.matmul_norm(x[20:], norm_w, 1e-5), got[20:])
    assert torch.equal(w.matmul_norm(x[:5], norm_w, 1e-5), w.matmul(h[:5]))  # below GEMM8_MIN_ROWS
    bias = torch.randn(72, generator=g)
    assert torch.equal(w.matmul_norm(x, norm_w, 1e-5, bias), got + bias)
    far = w.matmul_norm(x * 1e3, norm_w, 1e-5)  # a norm's output does not depend on the scale
    assert (far.double() - got.double()).abs().le(bound + 1e-5).all()


def test_the_reference_takes_the_kernels_outlier_thresholds():
    """int8_activations (the reference) keeps outliers at the kernel's own thresholds."""
    assert qkernel.kernel().gemm8_outlier_rms == OUTLIER_RMS
    assert qkernel.kernel().gemm8_outlier_rms_glu == OUTLIER_RMS_GLU


def test_the_int8_threshold_is_quants(monkeypatch):
    """`quant.GEMM8_MIN_ROWS` (RADIXLM_INT8_MIN_ROWS) picks the activations: raised, 70 rows
    multiply int16 activations; lowered to 2, 3 rows multiply int8 ones."""
    from radixlm.runtime.model import quant

    w = random_blocks(48, 512, Q4_K, seed=31)
    x = activations(70, 512, seed=31)
    monkeypatch.setattr(quant, "GEMM8_MIN_ROWS", 10**6)
    ok = (w.matmul(x).double() - int16_reference(x, w)).abs().le(REL * scale_of(x, w) + 1e-6)
    assert ok.all()
    monkeypatch.setattr(quant, "GEMM8_MIN_ROWS", 2)
    few = x[:3]
    assert (w.matmul(few).double() - int8_reference(few, w)).abs().le(REL * scale_of(few, w) + 1e-6).all()


def test_rows_are_addressed_not_copied():
    """`cat` and `take_rows` build new weights over the same bytes (row addresses only)
    until a weight is packed; `blocks` reads back the GGML bytes before and after packing;
    a read-only numpy array (a mapped file) serves; a packed weight's rows reorder (copied
    out of its tiles) and stack as a part of their own (its tiles as they are)."""
    for qtype in QTYPES.values():
        for cols in widths(qtype):
            w = random_blocks(7, cols, qtype, seed=cols)
            raw = w.blocks
            assert w.nbytes == raw.numel()
            other = random_blocks(3, cols, qtype, seed=1)
            both = QuantWeight.cat([w, other])
            assert int(both.rowptr[0]) == int(w.rowptr[0])  # no copy
            assert torch.equal(both.blocks[:7], raw) and both.rows == 10
            assert torch.equal(both.dequantize()[7:], other.dequantize())
            assert both.packed and torch.equal(both.blocks[:7], raw)
            order = torch.tensor([6, 0, 3, 3])
            picked = w.take_rows(order)
            assert torch.equal(picked.dequantize(), w.dequantize()[order])
            assert w.packed and torch.equal(w.take_rows(order).blocks, raw[order])
            stacked = QuantWeight.cat([w, other])
            assert stacked.nparts == 2 and stacked.parts[0] is w  # w's tiles, not a copy
            assert torch.equal(stacked.dequantize(), both.dequantize())
            ro = raw.numpy().copy()
            ro.flags.writeable = False
            mapped = QuantWeight(ro, qtype, 7, cols)
            assert torch.equal(mapped.dequantize(), w.dequantize())
    with pytest.raises(IndexError):
        w.take_rows(torch.tensor([7]))
    with pytest.raises(ValueError, match="shape"):
        QuantWeight(raw[:, 1:].contiguous(), qtype, 7, cols)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantWeight(torch.zeros(2, 144, dtype=torch.uint8), Q4_K, 2, 128)


@pytest.mark.parametrize("name", sorted(QTYPES))
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 131])
def test_packing_keeps_every_byte_and_lets_the_source_go(name, rows):
    """Tiles are the same bytes reordered: unpacked, they equal the source blocks exactly,
    whole tiles or a partial last one; packing once drops the row table and the source
    (nothing of it kept alive), and packing again changes nothing."""
    import weakref

    qtype = QTYPES[name]
    cols = widths(qtype)[1]
    src = random_blocks(rows, cols, qtype, seed=rows)
    raw = src.blocks.clone()
    w = QuantWeight(raw.clone(), qtype, rows, cols)
    gone = weakref.ref(w.owners[0])
    assert w.pack() is w and w.packed and w.rowptr is None and w.owners == ()
    assert gone() is None  # the source blocks were freed
    tiles = w.tiles
    assert tiles.numel() == qkernel.kernel().q_tiled_bytes(qtype, rows, cols)
    assert tiles.numel() == -(-rows // 8) * 8 * src.row_bytes  # whole tiles, same bytes a row
    assert torch.equal(w.blocks, raw)
    assert w.pack().tiles is tiles
    assert torch.equal(w.dequantize().double(), reference(src))


def test_weights_of_several_types_stack():
    """A fused matrix of Q4_K, Q5_0 and Q6_K rows (a K-quant mix's Q, K and V): one weight
    of three parts, whose products (few rows and many) are its parts' products side by
    side, bit for bit, and whose dequantization is theirs stacked; a stack has no one
    block layout and no row reordering."""
    parts = [random_blocks(40, 512, Q4_K, 1), random_blocks(24, 512, Q5_0, 2),
             random_blocks(24, 512, Q6_K, 3), random_blocks(8, 512, Q6_K, 4)]  # fmt: skip
    w = QuantWeight.cat(parts)
    assert w.qtype is None and w.nparts == 3 and w.rows == 96  # the two Q6_K runs are one part
    assert w.type_name == "Q4_K+Q5_0+Q6_K" and w.nbytes == sum(p.nbytes for p in parts)
    assert tuple(w.desc().shape) == (3, 3) and w.desc()[:, 0].tolist() == [40, 24, 32]
    assert torch.equal(w.dequantize(), torch.cat([p.dequantize() for p in parts]))
    for m in (1, 5, 70):
        x = activations(m, 512, seed=m)
        bias = torch.randn(96)
        side_by_side = torch.cat([p.matmul(x) for p in parts], 1)
        assert torch.equal(w.matmul(x), side_by_side)
        assert torch.equal(w.matmul(x, bias), side_by_side + bias)
    with pytest.raises(ValueError, match="one block layout"):
        _ = w.blocks
    with pytest.raises(ValueError, match="one type"):
        w.take_rows(torch.tensor([0]))
    with pytest.raises(ValueError, match="one width"):
        QuantWeight.cat([parts[0], random_blocks(8, 256, Q4_K, 5)])


def kernel_product(kern: qkernel.Kernel, x: torch.Tensor, w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, K] @ W^T, W dequantized) through one loaded kernel build (W packed by it)."""
    (m, cols), n = x.shape, w.rows
    tiles = torch.empty(kern.q_tiled_bytes(w.qtype, n, cols), dtype=torch.uint8)
    rows = w.blocks
    rowptr = rows.data_ptr() + torch.arange(n, dtype=torch.int64) * w.row_bytes
    kern.q_pack(rowptr.data_ptr(), w.qtype, cols, n, tiles.data_ptr())
    out = torch.empty(m, n)
    scratch = torch.empty(kern.q_matmul_scratch_bytes(m, cols), dtype=torch.uint8)
    kern.q_matmul(x.data_ptr(), m, cols, cols, tiles.data_ptr(), w.qtype, n, out.data_ptr(), n,
                  None, 0, scratch.data_ptr())  # fmt: skip
    deq = torch.empty(n, cols)
    kern.q_dequant_rows(tiles.data_ptr(), w.qtype, cols, None, n, deq.data_ptr())
    return out, deq


def _builds() -> dict[str, tuple[str, ...]]:
    """The builds this CPU can run: portable C, AVX2 (x86-64-v3), AVX2 with AVX-VNNI, the
    native one (here: AVX-512 with VNNI; its 512-bit paths) and, where the CPU has VBMI,
    the native one without it (its batch-1 K-quant products on the int16 passes)."""
    flags = qkernel._cpu_flags().split()
    out = {"portable": qkernel.PORTABLE_CFLAGS}
    if "avx2" in flags and "fma" in flags and "f16c" in flags:
        out["avx2"] = ("-march=x86-64-v3", *qkernel._BASE)
        if "avx_vnni" in flags:
            out["avx2-vnni"] = ("-march=x86-64-v3", "-mavxvnni", *qkernel._BASE)
    out["native"] = qkernel.CFLAGS
    if "avx512vbmi" in flags and "avx512_vnni" in flags:  # native, batch-1 K-quants on int16 passes
        out["native-no-vbmi"] = (*qkernel.CFLAGS, "-mno-avx512vbmi")
    return out


@pytest.mark.parametrize("build", sorted(_builds()))
def test_every_build_matches_the_references(build):
    """Each build of the sources (compiled once into the kernel cache) packs every type,
    dequantizes it bit-exactly to gguf-py's values, and multiplies one, several and many
    rows (int16 and int8 activations) within the same bounds of the same references."""
    kern = qkernel.load(qkernel.build(cflags=_builds()[build]))
    assert kern.simd == (0 if build == "portable" else 2)
    for name, qtype in QTYPES.items():
        for cols in widths(qtype):
            w = random_blocks(43, cols, qtype, seed=cols)
            for m in (1, 3, 5, 70):
                x = activations(m, cols, seed=m)
                out, deq = kernel_product(kern, x, w)
                assert torch.equal(deq.double(), reference(w)), (build, name)
                ok = (out.double() - expected(x, w)).abs().le(REL * scale_of(x, w) + 1e-6)
                assert ok.all(), (build, name, cols, m)


@pytest.mark.parametrize("build", sorted(_builds()))
def test_int8_products_over_several_slices_of_k(build):
    """Rows wider than one pass of the int8 path (it multiplies 64 blocks of 32 a pass, so
    a down projection's 8,192 columns come in four): every build, every type, a last
    partial pass, outliers in both passes in many rows (heavy-tailed rows, as an MLP's
    SiLU(gate) x up: outliers in half of their blocks) and 75 weight rows (a last odd group):
    within the bound of the int8 reference, and each row's product the same whatever rows
    share the call."""
    kern = qkernel.load(qkernel.build(cflags=_builds()[build]))
    g = torch.Generator().manual_seed(5)
    for name, qtype in QTYPES.items():
        cols = 2048 + widths(qtype)[1]  # 64 blocks, then 24 (K-quants) or 19
        w = random_blocks(75, cols, qtype, seed=cols)
        x = activations(140, cols, seed=7)
        x[40:100] = torch.nn.functional.silu(torch.randn(60, cols, generator=g)) * torch.randn(60, cols, generator=g) * 3
        out, _ = kernel_product(kern, x, w)
        ok = (out.double() - int8_reference(x, w)).abs().le(REL * scale_of(x, w) + 1e-6)
        assert ok.all(), (build, name)
        for part in (slice(0, 70), slice(70, 140), slice(30, 100)):
            alone, _ = kernel_product(kern, x[part].contiguous(), w)
            assert torch.equal(alone, out[part]), (build, name, part)


def test_few_row_kquant_products_on_bytes_are_the_int16_passes():
    """With AVX-512 VNNI and VBMI a K-quant product of few rows multiplies bytes (each int16
    activation as two bytes, dpbusd; qmatmul.c tile_k_d8 / tile_q6k_d8, codes packed in
    8-byte units): the same integer sums as the build without VBMI (the int16 passes, codes
    in 2-byte units), at every width, with a partial tile, for one row and for a pass of
    several plus a remainder. The float sums are in another order (16 lanes folded once per
    tile), so the products agree within float32 rounding of those sums: a few ulps of each
    term."""
    builds = _builds()
    if "native-no-vbmi" not in builds:
        pytest.skip("the CPU lacks AVX-512 VBMI or VNNI")
    on_bytes = qkernel.load(qkernel.build(cflags=builds["native"]))
    int16 = qkernel.load(qkernel.build(cflags=builds["native-no-vbmi"]))
    for qtype in (Q4_K, Q5_K, Q6_K):
        for cols in (256, 768, 2048):
            w = random_blocks(43, cols, qtype, seed=cols + qtype)
            for m in (1, 6):
                x = activations(m, cols, seed=m)
                x[0, 7] = 1e-3  # blocks of very different scales in one row
                a, _ = kernel_product(on_bytes, x, w)
                b, _ = kernel_product(int16, x, w)
                terms = 2 * cols // 32  # float terms a block of 32 (scale and min, or two halves)
                bound = terms * 2.0**-24 * scale_of(x, w)
                assert (a.double() - b.double()).abs().le(bound).all(), (qtype, cols, m)
                ok = (a.double() - int16_reference(x, w)).abs().le(REL * scale_of(x, w) + 1e-6)
                assert ok.all(), (qtype, cols, m)


def test_env_switch_loads_the_portable_build():
    """RADIXLM_KERNEL=portable makes a process load the plain-C build (the path machines
    without AVX2 take), which then computes the same products."""
    code = (
        "import torch\n"
        "from radixlm.runtime.model import qkernel\n"
        "from test_quant_kernel import random_blocks, reference\n"
        "k = qkernel.kernel(); print(k.simd)\n"
        "w = random_blocks(24, 512, 12, seed=2)\n"
        "x = torch.randn(9, 512, generator=torch.Generator().manual_seed(2))\n"
        "ref = reference(w)\n"
        "err = (w.matmul(x).double() - x.double() @ ref.t()).abs() / (x.double().abs() @ ref.abs().t())\n"
        "print(err.max().item())\n"
    )
    env = {**os.environ, qkernel.ENV_SWITCH: "portable"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    simd, err = out.stdout.split()
    assert simd == "0" and float(err) < 1e-4
    bad = subprocess.run([sys.executable, "-c", "from radixlm.runtime.model import qkernel; "
                          "qkernel.kernel()"], env={**env, qkernel.ENV_SWITCH: "avx9"},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "native" in bad.stderr


def test_loading_a_cached_kernel_builds_nothing(tmp_path, monkeypatch):
    """With the kernel in the cache (as `make install` leaves it) loading runs no compiler."""
    built = qkernel.build()  # the process's own cache: built already by `make install`
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    path = qkernel.library_path()  # where a build in this cache would put it
    path.parent.mkdir(parents=True)
    shutil.copyfile(built, path)
    calls = []
    monkeypatch.setattr(qkernel, "build", lambda *a, **k: calls.append(a) or path)
    monkeypatch.setattr(qkernel.subprocess, "run", lambda *a, **k: calls.append(a))
    qkernel.kernel.cache_clear()
    try:
        assert qkernel.kernel().path == path
    finally:
        qkernel.kernel.cache_clear()
    assert calls == []


def test_a_source_that_does_not_compile_fails_the_build_with_its_error(tmp_path, monkeypatch):
    """The sources compile side by side; one that fails stops the build with the
    compiler's message, and nothing of the build is left in the cache directory."""
    bad = tmp_path / "src" / "broken.c"
    bad.parent.mkdir()
    bad.write_text("int broken(void) { return undeclared_name; }\n")
    monkeypatch.setattr(qkernel, "SOURCES", (bad, *qkernel.SOURCES))  # (the others still compiling: stopped)
    out = tmp_path / "kernels"
    with pytest.raises(qkernel.KernelBuildError, match="undeclared_name"):
        qkernel.build(cflags=qkernel.PORTABLE_CFLAGS, directory=out)
    assert list(out.iterdir()) == []


def test_a_build_past_its_time_limit_stops_its_compilers_and_leaves_nothing(tmp_path, monkeypatch):
    """A build that outlives BUILD_TIMEOUT_S (here 0 s) is refused in one error, its
    compilers stopped, nothing of it left in the cache directory."""
    monkeypatch.setattr(qkernel, "BUILD_TIMEOUT_S", 0)
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def record(*args, **kwargs):  # noqa: ANN002, ANN003 - subprocess.Popen's
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(qkernel.subprocess, "Popen", record)
    out = tmp_path / "kernels"
    with pytest.raises(qkernel.KernelBuildError, match="took over 0 s"):
        qkernel.build(cflags=qkernel.PORTABLE_CFLAGS, directory=out)
    assert started and all(p.returncode is not None for p in started)  # stopped and waited for
    assert list(out.iterdir()) == []


def test_a_build_is_the_same_library_whatever_the_parallelism(tmp_path, monkeypatch):
    """One compiler at a time or one per CPU: the same library path, and a library that
    loads and multiplies (the portable build: the quickest to compile)."""
    one = tmp_path / "one"
    monkeypatch.setattr(qkernel.os, "sched_getaffinity", lambda _pid: {0})
    path = qkernel.build(cflags=qkernel.PORTABLE_CFLAGS, directory=one)
    monkeypatch.undo()
    assert path == qkernel.library_path(qkernel.PORTABLE_CFLAGS, one)
    assert sorted(p.name for p in one.iterdir()) == [path.name]
    kern = qkernel.load(path)
    w = random_blocks(43, 256, QTYPES["Q4_K"], seed=1)
    x = activations(3, 256, seed=1)
    out, deq = kernel_product(kern, x, w)
    assert torch.equal(deq.double(), reference(w))
    assert (out.double() - expected(x, w)).abs().le(REL * scale_of(x, w) + 1e-6).all()


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_threads_agree(name):
    """Splitting output rows across threads changes nothing (each row is one thread's)."""
    qtype = QTYPES[name]
    w = random_blocks(1024, 256, qtype, seed=3)
    before = torch.get_num_threads()
    try:
        for m in (1, 12, 70):
            x = torch.randn(m, 256, generator=torch.Generator().manual_seed(3))
            torch.set_num_threads(1)
            one = w.matmul(x)
            torch.set_num_threads(2)
            two = w.matmul(x)
            assert torch.equal(one, two)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype,levels", [(Q8_0, 127), (Q4_1, 15)])
def test_quantize_error_bound(qtype, levels):
    """Round-to-nearest: each weight within half a step (d / 2) of its block, plus float16
    rounding of the scale (and of Q4_1's minimum)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=g) * torch.rand(64, 1, generator=g)
    q = quantize(w, qtype)
    ref = reference(q)  # gguf-py reads our blocks: the format is GGML's
    blocks = w.double().reshape(64, 4, 32)
    if qtype == Q8_0:
        step = blocks.abs().amax(-1, keepdim=True) / levels
    else:
        step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / levels
    err = (ref.reshape(64, 4, 32) - blocks).abs()
    assert err.le(step * 0.5 * (1 + 2e-3) + blocks.abs() * 1e-3 + 1e-7).all()


@pytest.mark.parametrize("build", sorted(_builds()))
def test_every_build_norms_rows_as_torch(build):
    """Each build's normed product (q_gemm8_input, G8_NORM) matches its plain int8 product of torch's
    normed rows within one int8 step per value."""
    kern = qkernel.load(qkernel.build(cflags=_builds()[build]))
    w = random_blocks(40, 768, Q4_K, seed=23)
    g = torch.Generator().manual_seed(23)
    x = torch.randn(70, 768, generator=g) * 3
    norm_w = torch.rand(768, generator=g) + 0.5
    h = torch.nn.functional.rms_norm(x, (768,), norm_w, 1e-6)
    plain, _ = kernel_product(kern, h, w)
    tiles = torch.empty(kern.q_tiled_bytes(w.qtype, 40, 768), dtype=torch.uint8)  # packed by this build
    blocks = w.blocks  # (a copy out of the packed tiles: held while q_pack reads it)
    rowptr = blocks.data_ptr() + torch.arange(40, dtype=torch.int64) * w.row_bytes
    kern.q_pack(rowptr.data_ptr(), w.qtype, 768, 40, tiles.data_ptr())
    desc = torch.tensor([[40, w.qtype, tiles.data_ptr()]], dtype=torch.int64)
    normed = torch.empty(70, 40)
    scratch = torch.empty(kern.q_matmul_scratch_bytes8(70, 768, 1), dtype=torch.uint8)
    kern.q_gemm8_input(x.data_ptr(), 70, 768, 768, desc.data_ptr(), desc.shape[0], normed.data_ptr(), 40, None, 0,
                       qkernel.G8_NORM, norm_w.data_ptr(), 1e-6, scratch.data_ptr())  # fmt: skip
    step = h.double().reshape(70, -1, 32).abs().amax(-1) / 127
    bound = step.repeat_interleave(32, 1) @ reference(w).abs().t()
    assert (normed.double() - plain.double()).abs().le(bound + 1e-5).all(), build
