"""The quantized-matmul kernel against an independent reference: gguf-py's own
dequantization of the same GGML blocks, multiplied in float64 by torch.

Blocks are random bytes with sane float16 scales, so every nibble / int8 value occurs.
Products are checked for 1..20 activation rows, with bias, accumulation into a residual,
and row-strided inputs. Up to `GEMV_MAX_ROWS` rows the kernel streams the weights with
the activations as two int8 digits per value (per block of 32: q = round(x / d), r =
round((x - q d) * 256 / d), d = max|x| / 127): the reference quantizes them the same way
in torch and keeps Q4_1's offset term on the exact x (`q8_reference`); above, the kernel
dequantizes and multiplies in float32. Float32 sums in another order than float64's: a relative bound of
1e-5 of the sum of |x|*|w| (the products' magnitude) covers that and nothing more. A
build without AVX-512 VNNI (the plain C path) must give the same products.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from radixlm.runtime.model.quant import (
    BLOCK_BYTES,
    GEMV_MAX_ROWS,
    Q4_0,
    Q4_1,
    Q8_0,
    QuantWeight,
    quantize,
)

QTYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}
REL = 1e-5


def random_blocks(rows: int, cols: int, qtype: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    nb, bb = cols // 32, BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, (rows, nb, bb), dtype=np.uint8)
    n_scales = 2 if qtype == Q4_1 else 1
    scales = rng.uniform(-0.05, 0.05, (rows, nb, n_scales)).astype(np.float16)
    raw[..., : 2 * n_scales] = scales.view(np.uint8).reshape(rows, nb, 2 * n_scales)
    return QuantWeight(torch.from_numpy(raw.reshape(rows, nb * bb)), qtype, rows, cols)


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """`x` as the kernel multiplies it: per block of 32, two int8 digits, q = round(x / d)
    and r = round((x - q d) * 256 / d) with d = max|x| / 127 (float32 arithmetic, round
    half to even, as the kernel), worth (256 q + r) d / 256."""
    b = x.float().reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv).clamp(-127, 127)
    r = torch.round((b - q * d) * (inv * 256.0)).clamp(-127, 127)
    return ((256 * q.double() + r.double()) * (d.double() / 256)).reshape(x.shape)


def block_offsets(w: QuantWeight) -> torch.Tensor:
    """Q4_1's per-block offset m for every weight (zeros for the other types)."""
    if w.qtype != Q4_1:
        return torch.zeros(w.rows, w.cols, dtype=torch.float64)
    raw = w.blocks.numpy().reshape(w.rows, w.cols // 32, 20)
    m = raw[..., 2:4].copy().view(np.float16).astype(np.float64)  # [rows, nb, 1]
    return torch.from_numpy(np.repeat(m, 32, axis=-1).reshape(w.rows, w.cols))


def q8_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """What the streaming kernel computes, in float64: quantized activations times the
    weights' scaled codes, plus Q4_1's offsets times the exact activations."""
    ref_w, offsets = reference(w), block_offsets(w)
    return q8_activations(x) @ (ref_w - offsets).t() + x.double() @ offsets.t()


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
@pytest.mark.parametrize("m", [1, 2, 5, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 20])
@pytest.mark.parametrize("cols", [160, 608])  # 5 blocks a row; 19 (a 16-block group + 3)
def test_matmul_matches_reference(name, m, cols):
    w = random_blocks(131, cols, QTYPES[name], seed=m)  # 131 rows: a partial thread chunk
    ref_w = reference(w)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, cols, generator=g) * torch.rand(m, cols // 32, 1, generator=g).expand(
        m, cols // 32, 32).reshape(m, cols)  # blocks of different magnitudes
    bias = torch.randn(131, generator=g)
    scale = x.double().abs() @ ref_w.abs().t()

    def want_for(a: torch.Tensor) -> torch.Tensor:
        return q8_reference(a, w) if m <= GEMV_MAX_ROWS else a.double() @ ref_w.t()

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
def test_quantized_activations_cost_almost_nothing(name):
    """Two int8 digits hold each activation to 1/512 of its block's step: against exact
    float64 products on the same weights, within 1e-4 of the products' magnitude."""
    w = random_blocks(64, 576, QTYPES[name], seed=9)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(9))
    x[0, 5] = 40.0  # an outlier channel: its block's other values lose the most
    exact = x.double() @ reference(w).t()
    scale = x.double().abs() @ reference(w).abs().t()
    assert (w.matmul(x).double() - exact).abs().le(1e-4 * scale).all()


def test_layout_round_trips_and_stacks():
    """`blocks` gives back the GGML bytes it was built from; `cat` stacks rows."""
    for qtype in QTYPES.values():
        for cols in (32, 160, 576, 608):
            w = random_blocks(7, cols, qtype, seed=cols)
            raw = random_blocks(7, cols, qtype, seed=cols).blocks
            assert torch.equal(w.blocks, raw)
            assert w.nbytes == raw.numel()
            both = QuantWeight.cat([w, random_blocks(3, cols, qtype, seed=1)])
            assert torch.equal(both.blocks[:7], raw) and both.rows == 10
            assert torch.equal(both.dequantize()[7:], random_blocks(3, cols, qtype, seed=1).dequantize())


def test_plain_c_build_computes_the_same(tmp_path):
    """The kernel compiled without AVX-512 (the portable C path) multiplies alike."""
    from radixlm.runtime.model import qkernel

    if not qkernel.kernel().has_vnni:
        pytest.skip("this CPU runs the plain C path already")
    lib = qkernel.build(cflags=qkernel.PORTABLE_CFLAGS, directory=tmp_path)
    plain = qkernel.Kernel(qkernel.ctypes.CDLL(str(lib)))
    assert not plain.has_vnni
    for name, qtype in QTYPES.items():
        w = random_blocks(40, 608, qtype, seed=4)
        x = torch.randn(3, 608, generator=torch.Generator().manual_seed(4))
        fast = w.matmul(x)
        out = torch.empty(3, 40)
        scratch = torch.empty(plain.q_matmul_scratch_bytes(3, 608), dtype=torch.uint8)
        plain.q_matmul(x.data_ptr(), 3, 608, 608, w.codes.data_ptr(), w.d.data_ptr(),
                       0 if w.m is None else w.m.data_ptr(), qtype, 40, out.data_ptr(), 40,
                       None, 0, scratch.data_ptr())  # fmt: skip
        scale = x.double().abs() @ reference(w).abs().t()
        assert (out.double() - fast.double()).abs().le(REL * scale).all(), name


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_threads_agree(name):
    """Splitting output rows across threads changes nothing (each row is one thread's)."""
    w = random_blocks(1024, 256, QTYPES[name], seed=3)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w.matmul(x)
        torch.set_num_threads(2)
        two = w.matmul(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


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


def test_bad_inputs_are_refused():
    w = random_blocks(8, 64, Q8_0, seed=0)
    with pytest.raises(ValueError, match="float32"):
        w.matmul(torch.zeros(1, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        w.matmul(torch.zeros(1, 32))
    with pytest.raises(ValueError, match="accumulate needs out"):
        w.matmul(torch.zeros(1, 64), accumulate=True)
    with pytest.raises(IndexError):
        w.dequantize(torch.tensor([8]))
    with pytest.raises(ValueError, match="K % 32 == 0"):
        quantize(torch.zeros(4, 40), Q8_0)
    with pytest.raises(ValueError, match="Q8_0 and Q4_1"):
        quantize(torch.zeros(4, 64), Q4_0)
    with pytest.raises(ValueError, match="expected uint8"):
        QuantWeight(torch.zeros(8, 10, dtype=torch.uint8), Q8_0, 8, 64)
    with pytest.raises(ValueError, match="one type"):
        QuantWeight.cat([w, random_blocks(8, 64, Q4_1, seed=0)])
