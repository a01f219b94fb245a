"""A prefill's rotary embedding on CPU in the C kernel (kernels/rotary.c, `rope.rotate_in_place`):
the q and k heads of the qkv product rotated in their own rows, each optionally RMS-normed
first (Qwen3's q/k norms), against torch's formula (`Rotary.apply`, the path every other
device and model takes): equal to float32 rounding; the v heads untouched bit for bit; and
the cases the kernel does not take left to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from radixlm.runtime.model.config import RopeConfig
from radixlm.runtime.model.qkernel import kernel
from radixlm.runtime.model.quant import Q4_1, quantize
from radixlm.runtime.model.rope import Rotary, rotate_in_place


def _qkv(T: int, hq: int, hkv: int, D: int, seed: int) -> torch.Tensor:
    return torch.randn(T, hq + hkv, D, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(("hq", "hkv", "D"), [(12, 2, 64), (5, 1, 128), (3, 1, 32), (2, 2, 6)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotation_in_place_is_torchs(hq, hkv, D, qk_norm):
    T = 97
    rot = Rotary(RopeConfig(theta=10000.0), D, torch.device("cpu"), torch.float32)
    cos, sin = rot.cos_sin(torch.arange(1000, 1000 + T))
    qkv = _qkv(T, hq, hkv, D, seed=D + hq)
    norm = torch.rand(hq, D, generator=torch.Generator().manual_seed(1)) + 0.5 if qk_norm else None
    qk = qkv[:, :hq]
    if norm is not None:
        qk = F.rms_norm(qk, (D,), None, 1e-6) * norm
    want = rot.apply(qk, cos, sin)
    v = qkv[:, hq:].clone()
    assert rotate_in_place(qkv, hq, cos, sin, norm, 1e-6)
    assert torch.allclose(qkv[:, :hq], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, hq:], v)


def test_cases_the_kernel_does_not_take_are_left_alone():
    T, D = 9, 64
    rot = Rotary(RopeConfig(theta=10000.0), D, torch.device("cpu"), torch.float32)
    cos, sin = rot.cos_sin(torch.arange(T))
    qkv = _qkv(T, 4, 2, D, seed=2)
    before = qkv.clone()
    assert not rotate_in_place(qkv.double(), 4, cos.double(), sin.double())  # not float32
    assert not rotate_in_place(qkv, 4, cos[:1].expand(T, 1, D), sin)  # cos not one row per token
    assert not rotate_in_place(qkv, 4, cos, sin, torch.ones(3, D))  # q/k norm of another shape
    odd = _qkv(T, 4, 2, 7, seed=3)
    c7, s7 = torch.ones(T, 1, 7), torch.zeros(T, 1, 7)
    assert not rotate_in_place(odd, 4, c7, s7)  # odd head dim: no rotate-half
    assert torch.equal(qkv, before)


_ROPES = {
    "default": RopeConfig(theta=10000.0),
    "llama3": RopeConfig(theta=500000.0, type="llama3", factor=8.0, original_max_position_embeddings=64),
    "yarn": RopeConfig(theta=10000.0, type="yarn", factor=4.0, original_max_position_embeddings=64),
    "longrope": RopeConfig(theta=10000.0, type="longrope", original_max_position_embeddings=64,
                           short_factor=tuple(1.0 + i / 32 for i in range(32)),
                           long_factor=tuple(2.0 + i / 8 for i in range(32))),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_ROPES))
def test_a_decode_steps_inputs_are_the_embedding_rows_and_torchs_factors(name):
    """The fused decode step's inputs in one kernel call (kernels/decode.c, decode_inputs):
    the packed embedding's rows as `QuantWeight.dequantize` gives them, bit for bit, and
    `Rotary.cos_sin` of each position to float32 rounding (longrope's switch at position 64
    on both sides; yarn's attention factor)."""
    D, hidden = 64, 96
    rot = Rotary(_ROPES[name], D, torch.device("cpu"), torch.float32)
    embed = quantize(torch.randn(50, hidden, generator=torch.Generator().manual_seed(5)), Q4_1)
    ids = torch.tensor([7, 0, 49, 7, 31, 2])
    pos = torch.tensor([0, 1, 63, 64, 65, 70_000])
    long = rot.long_inv_freq
    x, cs = torch.empty(len(ids), hidden), torch.empty(2, len(ids), D)
    rc = kernel().decode_inputs(embed.tiles_ptr(), embed.qtype, embed.rows, hidden, ids.data_ptr(), pos.data_ptr(),
                                len(ids), rot.inv_freq.data_ptr(), 0 if long is None else long.data_ptr(),
                                rot.long_from or 0, D, rot.scale, x.data_ptr(), cs[0].data_ptr(), cs[1].data_ptr())
    assert rc == 0
    assert torch.equal(x, embed.dequantize(ids))
    cos, sin = rot.cos_sin(pos)
    assert torch.allclose(cs[0], cos[:, 0], rtol=0, atol=2e-6)
    assert torch.allclose(cs[1], sin[:, 0], rtol=0, atol=2e-6)
    bad = torch.tensor([3, 50])  # past the embedding's last row: nothing written, -1
    x.fill_(0.5)
    assert kernel().decode_inputs(embed.tiles_ptr(), embed.qtype, embed.rows, hidden, bad.data_ptr(),
                                  pos.data_ptr(), 2, rot.inv_freq.data_ptr(), 0, 0, D, rot.scale, x.data_ptr(),
                                  cs[0].data_ptr(), cs[1].data_ptr()) == -1  # fmt: skip
    assert bool((x == 0.5).all())
