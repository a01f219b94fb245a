"""radixlm.runtime.attention: attention backends behind one interface (see `base`).

`create_backend("auto" | "torch" | "flashinfer", ...)` picks one at start-up: "auto" is
FlashInfer when CUDA and the `flashinfer` package are present, the torch reference otherwise.
"""

from __future__ import annotations

import torch

from . import flashinfer_backend
from .base import AttentionBackend, KVPoolLike
from .torch_backend import TorchAttention

BACKENDS = ("auto", "torch", "flashinfer")


def choose_backend(name: str, device: torch.device | str) -> str:
    """Resolve "auto" to a concrete backend name for `device`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    device = torch.device(device)
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and flashinfer_backend.available() else "torch"
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer backend needs a CUDA device")
    return name


def create_backend(
    name: str,
    pool: KVPoolLike,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str,
    dtype: torch.dtype,
    **kwargs,
) -> AttentionBackend:
    device = torch.device(device)
    chosen = choose_backend(name, device)
    cls = flashinfer_backend.FlashInferAttention if chosen == "flashinfer" else TorchAttention
    return cls(pool, num_heads, num_kv_heads, head_dim, device, dtype, **kwargs)


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "KVPoolLike",
    "TorchAttention",
    "choose_backend",
    "create_backend",
]
