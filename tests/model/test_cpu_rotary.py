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
