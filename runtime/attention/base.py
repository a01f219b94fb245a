"""The attention-backend interface: `plan(batch)` once per forward, then `forward` per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from radixlm.runtime.model.batch import ForwardBatch


class KVPoolLike(Protocol):
    """What a backend needs of `radixlm.cache.KVPool`: per-layer `[capacity, H, D]` tensors."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int


class AttentionBackend(ABC):
    """Attention over a slot-indexed KV pool.

    `plan(batch)` prepares per-forward metadata (index tensors, masks, kernel plans);
    `forward(layer_id, q, k, v)` writes the new tokens' K/V (`k`, `v`: `[T, num_kv_heads,
    head_dim]`) into the pool at `batch.out_slots`, then attends each request's queries
    (`q`: `[T, num_heads, head_dim]`) over its prefix + new tokens, causally within the new
    tokens (new token i sees prefix and new tokens <= i). Returns `[T, num_heads * head_dim]`.
    """

    name: str = "abstract"

    def __init__(
        self,
        pool: KVPoolLike,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.device = device
        self.dtype = dtype
        self.scale = head_dim**-0.5

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...
