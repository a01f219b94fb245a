"""The quantized-matmul kernel against an independent reference: gguf-py's own
dequantization of the same GGML blocks, multiplied in float64 by torch.

Blocks are random bytes with sane float16 scales, so every nibble / int8 value occurs.
Products are checked for 1..20 activation rows (the streaming kernel up to
`GEMV_MAX_ROWS`, dequantize + GEMM above), with bias, accumulation into a residual, and
row-strided inputs. Float32 sums in another order than float64's: a relative bound of
1e-5 of the sum of |x|*|w| (the products' magnitude) covers that and nothing more.
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
def test_matmul_matches_reference(name, m):
    w = random_blocks(131, 160, QTYPES[name], seed=m)  # 131 rows: a partial thread chunk
    ref_w = reference(w)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 160, generator=g)
    bias = torch.randn(131, generator=g)
    scale = x.double().abs() @ ref_w.abs().t()

    y = w.matmul(x)
    want = x.double() @ ref_w.t()
    assert (y.double() - want).abs().le(REL * scale + 1e-6).all()

    yb = w.matmul(x, bias)
    assert (yb.double() - (want + bias.double())).abs().le(REL * scale + 1e-5).all()

    resid = torch.randn(m, 131, generator=g)
    before = resid.clone()
    got = w.matmul(x, out=resid, accumulate=True)
    assert got.data_ptr() == resid.data_ptr()
    assert (resid.double() - (before.double() + want)).abs().le(REL * scale + 1e-5).all()

    wide = torch.randn(m, 400, generator=g)
    strided = wide[:, 100:260]  # row stride 400: read in place, not copied
    ys = w.matmul(strided)
    assert (ys.double() - strided.double() @ ref_w.t()).abs().le(REL * scale.max() + 1e-5).all()


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
