"""The quantized-matmul kernel against an independent reference: gguf-py's own
dequantization of the same GGML blocks, multiplied in float64 by torch.

Blocks are random bytes with sane float16 scales, so every nibble / int8 value occurs.
Products are checked for 1..70 activation rows (the integer path on tiles of 8 weight rows
up to 64, up to 4 activation rows a pass; dequantize + float32 GEMM above), with bias,
accumulation into a residual, and row-strided inputs. The kernel's integer paths multiply activations held as
one int16 per value per block of 32 (v = round(x / s), s = max|x| / 32767): the reference
quantizes them the same way in torch and keeps Q4_1's offset term on the exact x
(`int16_reference`). Float32 sums in another order than float64's: a relative bound of
1e-5 of the sum of |x|*|w| (the products' magnitude) covers that and nothing more. The
portable build (plain C, no AVX2) must give the same products, and so must several rows
at once and each row alone.
"""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from radixlm.runtime.model import qkernel
from radixlm.runtime.model.quant import (
    BLOCK_BYTES,
    DEQUANT_MIN_ROWS,
    Q4_0,
    Q4_1,
    Q8_0,
    QuantWeight,
    quantize,
)

QTYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}
REL = 1e-5
TILE_MB = 4  # kernels/qmatmul.c: activation rows per pass over a tile


def random_blocks(rows: int, cols: int, qtype: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    nb, bb = cols // 32, BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows, nb, bb), dtype=np.uint8)
    n_scales = 2 if qtype == Q4_1 else 1
    scales = rng.uniform(-0.05, 0.05, (rows, nb, n_scales)).astype(np.float16)
    raw[..., : 2 * n_scales] = scales.view(np.uint8).reshape(rows, nb, 2 * n_scales)
    return QuantWeight(torch.from_numpy(raw.reshape(rows, nb * bb)), qtype, rows, cols)


def int16_activations(x: torch.Tensor) -> torch.Tensor:
    """`x` as the kernel multiplies it: per block of 32, v = round(x / s) with s = max|x| /
    32767 (float32 arithmetic, round half to even, as the kernel), worth v s."""
    b = x.float().reshape(x.shape[0], -1, 32)
    s = b.abs().amax(-1, keepdim=True) / 32767.0
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    v = torch.round(b * inv).clamp(-32767, 32767)
    return (v.double() * s.double()).reshape(x.shape)


def block_offsets(w: QuantWeight) -> torch.Tensor:
    """Q4_1's per-block offset m for every weight (zeros for the other types)."""
    if w.qtype != Q4_1:
        return torch.zeros(w.rows, w.cols, dtype=torch.float64)
    raw = w.blocks.numpy().reshape(w.rows, w.cols // 32, 20)
    m = raw[..., 2:4].copy().view(np.float16).astype(np.float64)  # [rows, nb, 1]
    return torch.from_numpy(np.repeat(m, 32, axis=-1).reshape(w.rows, w.cols))


def int16_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """What the integer paths compute, in float64: quantized activations times the
    weights' scaled codes, plus Q4_1's offsets times the exact activations."""
    ref_w, offsets = reference(w), block_offsets(w)
    return int16_activations(x) @ (ref_w - offsets).t() + x.double() @ offsets.t()


def reference(w: QuantWeight) -> torch.Tensor:
    """gguf-py's dequantization (float64)."""
    deq = gguf.quants.dequantize(w.blocks.numpy(), gguf.GGMLQuantizationType(w.qtype))
    return torch.from_numpy(np.asarray(deq, dtype=np.float64)).reshape(w.rows, w.cols)


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_dequantize_matches_gguf(name):
    w = random_blocks(40, 96, QTYPES[name], seed=1)
    ref = reference(w)
    assert torch.equal(w.dequantize().double(), ref)
    rows = torch.tensor([39, 0, 7, 7])
    assert torch.equal(w.dequantize(rows).double(), ref[rows])


@pytest.mark.parametrize("name", sorted(QTYPES))
@pytest.mark.parametrize("m", [1, 2, 3, TILE_MB, TILE_MB + 1, 7, 8, 13, DEQUANT_MIN_ROWS - 1,
                               DEQUANT_MIN_ROWS])  # fmt: skip
@pytest.mark.parametrize("cols", [160, 608])  # 5 blocks a row; 19
def test_matmul_matches_reference(name, m, cols):
    w = random_blocks(131, cols, QTYPES[name], seed=m)  # 131 rows: partial chunks and tiles
    ref_w = reference(w)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, cols, generator=g) * torch.rand(m, cols // 32, 1, generator=g).expand(
        m, cols // 32, 32).reshape(m, cols)  # blocks of different magnitudes
    bias = torch.randn(131, generator=g)
    scale = x.double().abs() @ ref_w.abs().t()

    def want_for(a: torch.Tensor) -> torch.Tensor:
        return int16_reference(a, w) if m < DEQUANT_MIN_ROWS else a.double() @ ref_w.t()

    y = w.matmul(x)
    want = want_for(x)
    assert (y.double() - want).abs().le(REL * scale + 1e-6).all()

    yb = w.matmul(x, bias)
    assert (yb.double() - (want + bias.double())).abs().le(REL * scale + 1e-5).all()

    resid = torch.randn(m, 131, generator=g)
    before = resid.clone()
    got = w.matmul(x, out=resid, accumulate=True)
    assert got.data_ptr() == resid.data_ptr()
    assert (resid.double() - (before.double() + want)).abs().le(REL * scale + 1e-5).all()

    wide = torch.randn(m, cols + 240, generator=g)
    strided = wide[:, 100 : 100 + cols]  # row stride cols + 240: read in place, not copied
    ys = w.matmul(strided)
    assert (ys.double() - want_for(strided)).abs().le(REL * scale.max() + 1e-5).all()


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_many_rows_equal_each_row_alone(name):
    """40 activation rows at once (each tile swept by 4 rows a pass) against each row
    alone on the same weights, and both against float64 on the dequantized weights (the
    same function up to float summation order)."""
    w = random_blocks(70, 576, QTYPES[name], seed=11)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(11))
    many = w.matmul(x)
    alone = torch.cat([w.matmul(x[i : i + 1]) for i in range(40)])
    scale = x.double().abs() @ reference(w).abs().t()
    assert (many.double() - alone.double()).abs().le(REL * scale).all()
    exact = x.double() @ reference(w).t()
    assert (many.double() - exact).abs().le(1e-4 * scale).all()


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_quantized_activations_cost_almost_nothing(name):
    """int16 activations hold each value to half a step of max|x| / 32767 of its block:
    against exact float64 products on the same weights, within 1e-4 of the products'
    magnitude, an outlier channel included."""
    w = random_blocks(64, 576, QTYPES[name], seed=9)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(9))
    x[0, 5] = 40.0  # an outlier channel: its block's other values lose the most
    exact = x.double() @ reference(w).t()
    scale = x.double().abs() @ reference(w).abs().t()
    assert (w.matmul(x).double() - exact).abs().le(1e-4 * scale).all()


def test_rows_are_addressed_not_copied():
    """`cat` and `take_rows` build new weights over the same bytes (row addresses only)
    until a weight is packed; `blocks` reads back the GGML bytes before and after packing;
    a read-only numpy array (a mapped file) serves; a packed weight's rows still stack and
    reorder (copied out of its tiles)."""
    for qtype in QTYPES.values():
        for cols in (32, 160, 576, 608):
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
            assert torch.equal(QuantWeight.cat([w, other]).blocks, both.blocks)
            ro = raw.numpy().copy()
            ro.flags.writeable = False
            mapped = QuantWeight(ro, qtype, 7, cols)
            assert torch.equal(mapped.dequantize(), w.dequantize())
    with pytest.raises(IndexError):
        w.take_rows(torch.tensor([7]))
    with pytest.raises(ValueError, match="shape"):
        QuantWeight(raw[:, 1:].contiguous(), Q8_0, 7, 608)


@pytest.mark.parametrize("name", sorted(QTYPES))
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 131])
def test_packing_keeps_every_byte_and_lets_the_source_go(name, rows):
    """Tiles are the same bytes reordered: unpacked, they equal the source blocks exactly,
    whole tiles or a partial last one; packing once drops the row table and the source
    (nothing of it kept alive), and packing again changes nothing."""
    import weakref

    qtype = QTYPES[name]
    src = random_blocks(rows, 608, qtype, seed=rows)
    raw = src.blocks.clone()
    w = QuantWeight(raw.clone(), qtype, rows, 608)
    gone = weakref.ref(w.owners[0])
    assert w.pack() is w and w.packed and w.rowptr is None and w.owners == ()
    assert gone() is None  # the source blocks were freed
    tiles = w.tiles
    assert tiles.numel() == qkernel.kernel().q_tiled_bytes(qtype, rows, 608)
    assert tiles.numel() == -(-rows // 8) * 8 * src.row_bytes  # whole tiles, same bytes a row
    assert torch.equal(w.blocks, raw)
    assert w.pack().tiles is tiles
    assert torch.equal(w.dequantize().double(), reference(src))


def kernel_product(kern: qkernel.Kernel, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ W^T through one loaded kernel build's q_matmul (W packed by that build)."""
    (m, cols), n = x.shape, w.rows
    tiles = torch.empty(kern.q_tiled_bytes(w.qtype, n, cols), dtype=torch.uint8)
    rows = w.blocks
    rowptr = rows.data_ptr() + torch.arange(n, dtype=torch.int64) * w.row_bytes
    kern.q_pack(rowptr.data_ptr(), w.qtype, cols, n, tiles.data_ptr())
    out = torch.empty(m, n)
    scratch = torch.empty(kern.q_matmul_scratch_bytes(m, cols), dtype=torch.uint8)
    kern.q_matmul(x.data_ptr(), m, cols, cols, tiles.data_ptr(), w.qtype, n, out.data_ptr(), n,
                  None, 0, scratch.data_ptr())  # fmt: skip
    return out


def test_portable_build_computes_the_same(tmp_path):
    """The kernel compiled without AVX2 (the portable C path) packs and multiplies alike:
    one and several activation rows, a partial last tile."""
    k = qkernel.kernel()
    if k.simd == 0:
        pytest.skip("this CPU runs the portable path already")
    plain = qkernel.load(qkernel.build(cflags=qkernel.PORTABLE_CFLAGS, directory=tmp_path))
    assert plain.simd == 0
    for name, qtype in QTYPES.items():
        w = random_blocks(43, 608, qtype, seed=4)
        for m in (1, 3, 20):
            x = torch.randn(m, 608, generator=torch.Generator().manual_seed(4))
            fast = w.matmul(x)
            out = kernel_product(plain, x, w)
            scale = x.double().abs() @ reference(w).abs().t()
            assert (out.double() - fast.double()).abs().le(REL * scale).all(), (name, m)


def test_native_build_computes_the_same_as_avx2(tmp_path):
    """On a CPU with more than AVX2 (AVX-512, VNNI: the native build may fuse a
    multiply-add's sum), the AVX2 build (x86-64-v3) of the same sources gives the same
    products: one and several rows, 18, 19 and 64 blocks a row, every format."""
    flags = qkernel._cpu_flags().split()
    if "avx512f" not in flags:
        pytest.skip("no AVX-512 on this CPU: the native build is the AVX2 one")
    k = qkernel.kernel()
    avx2 = qkernel.load(qkernel.build(cflags=("-march=x86-64-v3", *qkernel._BASE), directory=tmp_path))
    assert avx2.simd == 2 and k.simd == 2
    g = torch.Generator().manual_seed(9)
    for name, qtype in QTYPES.items():
        for cols in (576, 608, 2048):
            w = random_blocks(70, cols, qtype, seed=cols)
            for m in (1, 5):
                x = torch.randn(m, cols, generator=g)
                outs = [kernel_product(kern, x, w) for kern in (k, avx2)]
                scale = x.double().abs() @ reference(w).abs().t()
                assert (outs[0].double() - outs[1].double()).abs().le(REL * scale).all(), (name, cols)


def test_env_switch_loads_the_portable_build():
    """RADIXLM_KERNEL=portable makes a process load the plain-C build (the path machines
    without AVX2 take), which then computes the same products."""
    code = (
        "import torch\n"
        "from radixlm.runtime.model import qkernel\n"
        "from test_quant_kernel import random_blocks, reference\n"
        "k = qkernel.kernel(); print(k.simd)\n"
        "w = random_blocks(24, 160, 3, seed=2)\n"
        "x = torch.randn(9, 160, generator=torch.Generator().manual_seed(2))\n"
        "err = (w.matmul(x).double() - x.double() @ reference(w).t()).abs().max().item()\n"
        "print(err)\n"
    )
    env = {**os.environ, qkernel.ENV_SWITCH: "portable"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    simd, err = out.stdout.split()
    assert simd == "0" and float(err) < 1e-3
    bad = subprocess.run([sys.executable, "-c", "from radixlm.runtime.model import qkernel; "
                          "qkernel.kernel()"], env={**env, qkernel.ENV_SWITCH: "avx9"},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "native" in bad.stderr


def test_loading_a_cached_kernel_builds_nothing(tmp_path, monkeypatch):
    """With the kernel in the cache (as `make install` leaves it) loading runs no compiler."""
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    path = qkernel.build()  # what make install does
    calls = []
    monkeypatch.setattr(qkernel, "build", lambda *a, **k: calls.append(a) or path)
    monkeypatch.setattr(qkernel.subprocess, "run", lambda *a, **k: calls.append(a))
    qkernel.kernel.cache_clear()
    try:
        assert qkernel.kernel().path == path
    finally:
        qkernel.kernel.cache_clear()
    assert calls == []


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_threads_agree(name):
    """Splitting output rows across threads changes nothing (each row is one thread's)."""
    w = random_blocks(1024, 256, QTYPES[name], seed=3)
    before = torch.get_num_threads()
    try:
        for m in (1, 12):
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
