"""KV pools: per-layer K and V tensors addressed by slot index.

`KVPool` lives on the model's device; `HostKVPool` is the same layout in CPU memory
(pinned when CUDA is present, so copies can overlap compute) for a host tier that
keeps evicted segments. One contiguous buffer per K and per V (`[layers, capacity, H, D]`)
keeps every layer's slice contiguous and lets a host copy move all layers in one op.

In CPU memory (unpinned) the buffers are reserved, not allocated: one private anonymous
mapping each, which the OS fills with zero pages and backs with memory only where a slot
is first written. A pool sized for the whole context costs the memory of the slots in
use, and a never-written slot still reads as zeros (masked reads stay finite). Pinned
and device buffers are allocated and zeroed up front, as pinned/device memory must be.
"""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Sequence

import numpy as np
import torch

# Linux's MAP_NORESERVE (not exported by Python's mmap): no swap reservation for the
# mapping; pages are committed when written (strict overcommit ignores it and accounts).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)

SlotIndex = torch.Tensor | np.ndarray | Sequence[int]


def reserve_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose memory is committed page by page as it is written."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    buf = mmap.mmap(-1, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


def _index(slots: SlotIndex, device: torch.device) -> torch.Tensor:
    if isinstance(slots, torch.Tensor):
        return slots.to(device=device, dtype=torch.int64)
    return torch.as_tensor(np.asarray(slots, dtype=np.int64), device=device)


class KVPool:
    """Per-layer K/V tensors addressed by slot: `k[layer]`, `v[layer]` of shape
    `[capacity, H, D]`, views into one `k_buffer` / `v_buffer` of `[layers, capacity, H, D]`."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity_tokens: int,
        page_size: int = 1,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        if page_size < 1 or capacity_tokens % page_size:
            raise ValueError(
                f"capacity_tokens ({capacity_tokens}) must be a multiple of page_size "
                f"({page_size} >= 1)"
            )
        shape = (num_layers, capacity_tokens, num_kv_heads, head_dim)
        self.num_layers, self.capacity, self.num_kv_heads, self.head_dim = shape
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        # zeros, not empty: padded/masked reads of never-written slots stay finite.
        if self.device.type == "cpu" and not pin_memory:
            self.k_buffer = reserve_zeros(shape, dtype)
            self.v_buffer = reserve_zeros(shape, dtype)
        else:
            self.k_buffer = torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)
            self.v_buffer = torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin_memory)
        self.k: list[torch.Tensor] = list(self.k_buffer.unbind(0))  # k[layer]: [cap, H, D]
        self.v: list[torch.Tensor] = list(self.v_buffer.unbind(0))

    @property
    def nbytes(self) -> int:
        """K+V bytes of the whole pool (reserved; on CPU committed only where written)."""
        return self.k_buffer.nbytes + self.v_buffer.nbytes

    @property
    def bytes_per_token(self) -> int:
        """K+V bytes one slot takes, all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k_buffer.element_size()

    def k_pages(self, layer: int) -> torch.Tensor:
        """Layer K as `[num_pages, P, H, D]` (FlashInfer's NHD paged layout); a view."""
        return self.k[layer].view(-1, self.page_size, self.num_kv_heads, self.head_dim)

    def v_pages(self, layer: int) -> torch.Tensor:
        """Layer V as `[num_pages, P, H, D]`; a view."""
        return self.v[layer].view(-1, self.page_size, self.num_kv_heads, self.head_dim)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, capacity={self.capacity}, page_size={self.page_size}, "
            f"dtype={self.dtype}, device={self.device})"
        )


class HostKVPool(KVPool):
    """A CPU pool with a device pool's layout (`like`), for the host tier; slots are its own.
    Pinned when CUDA is present, so copies to and from the device can be asynchronous."""

    @classmethod
    def like(cls, pool: KVPool, capacity_tokens: int | None = None) -> HostKVPool:
        """A host pool with `pool`'s layer/head/dtype layout."""
        cap = pool.capacity if capacity_tokens is None else capacity_tokens
        return cls(pool.num_layers, pool.num_kv_heads, pool.head_dim, cap, pool.page_size,
                   pool.dtype, "cpu", pin_memory=torch.cuda.is_available())

    def _check(self, pool: KVPool) -> None:
        same = (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
        if same != (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype):
            raise ValueError(f"host/device pool layouts differ: {self!r} vs {pool!r}")

    def copy_from_device(
        self, pool: KVPool, device_slots: SlotIndex, host_slots: SlotIndex
    ) -> None:
        """Back up `pool`'s K/V at `device_slots` into this pool's `host_slots` (all layers).
        Synchronous: the data is in host memory when this returns."""
        self._check(pool)
        d = _index(device_slots, pool.device)
        h = _index(host_slots, self.device)
        if len(d) != len(h):
            raise ValueError(f"copy_from_device: {len(d)} device slots vs {len(h)} host slots")
        self.k_buffer[:, h] = pool.k_buffer[:, d].to("cpu")
        self.v_buffer[:, h] = pool.v_buffer[:, d].to("cpu")

    def copy_to_device(self, pool: KVPool, host_slots: SlotIndex, device_slots: SlotIndex) -> None:
        """Load this pool's K/V at `host_slots` into `pool` at `device_slots` (all layers).
        On CUDA the upload is queued on the current stream."""
        self._check(pool)
        d = _index(device_slots, pool.device)
        h = _index(host_slots, self.device)
        if len(d) != len(h):
            raise ValueError(f"copy_to_device: {len(h)} host slots vs {len(d)} device slots")
        pin = self.k_buffer.is_pinned()
        k = self.k_buffer[:, h]
        v = self.v_buffer[:, h]
        if pin:  # the gather made pageable tensors; pin them so the copy is asynchronous
            k, v = k.pin_memory(), v.pin_memory()
        pool.k_buffer[:, d] = k.to(pool.device, non_blocking=pin)
        pool.v_buffer[:, d] = v.to(pool.device, non_blocking=pin)
