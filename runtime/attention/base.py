"""The attention-backend interface: `plan(batch)` once per forward, then `forward` per layer;
and the hooks a runner needs to capture a decode forward once and replay it (CUDA graphs).

Capture and replay, for a backend whose `supports_capture` is true:

1. ``init_capture(max_bs, max_seq_len, pad_slot)`` once: the backend allocates every
   tensor its decode forward reads at fixed addresses, sized for `max_bs` requests of up
   to `max_seq_len` tokens (prefix + new). `pad_slot` is a pool slot no request uses (the
   runner reserves it): padding rows write their K/V there and attend to it alone.
2. ``prepare_for_capture(bs)`` per captured batch size: the backend points its next
   `forward` calls at those buffers, filled as `bs` padding rows; the runner then runs
   (and records) the decoder once over its own fixed input buffers of `bs` rows.
3. ``prepare_for_replay(batch, bs)`` per decode step with `batch.batch_size <= bs`: the
   batch's metadata is copied into the buffers in place (rows past the batch padded), with
   no allocation and no `plan`; replaying what was recorded for `bs` (after the runner
   copied the inputs into its buffers) gives the batch's outputs in its first rows.

Nothing here records or replays a graph: that is the runner's, on a device that has one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

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

    Per model (Gemma, Mistral, Phi-3): `windows[layer]` is the sliding window of that layer
    (a query at position i sees keys at i - W + 1 .. i; None: the whole context; `windows`
    None: no layer slides), `softcap` caps every score as `softcap * tanh(s / softcap)`
    before the mask and softmax (Gemma 2), and `scale` replaces `head_dim ** -0.5`.
    """

    name: str = "abstract"
    # Whether the capture hooks below work (see the module docstring); a runner asks this
    # before it captures anything.
    supports_capture: ClassVar[bool] = False

    def __init__(
        self,
        pool: KVPoolLike,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        windows: Sequence[int | None] | None = None,
        softcap: float | None = None,
        scale: float | None = None,
    ):
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.device = device
        self.dtype = dtype
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.softcap = float(softcap) if softcap else None
        self.windows: tuple[int | None, ...] | None = None
        if windows is not None and any(w is not None for w in windows):
            if len(windows) != len(pool.k):
                raise ValueError(f"{len(windows)} layer windows for a pool of {len(pool.k)} layers")
            if any(w is not None and w < 1 for w in windows):
                raise ValueError(f"sliding windows must be >= 1 token: {sorted(set(windows) - {None})}")
            self.windows = tuple(windows)

    def window(self, layer_id: int) -> int | None:
        """Layer `layer_id`'s sliding window (None: the whole context)."""
        return None if self.windows is None else self.windows[layer_id]

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None: ...

    def release(self) -> None:
        """Drop what `plan` made for host memory (masks, index tensors) once its forward is
        done: a long prefill's `[n, L]` mask would otherwise stay until the next plan.
        Backends whose plans hold nothing large keep theirs."""
        return None

    @abstractmethod
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...

    # -- capture and replay of decode batches (see the module docstring) -------------------

    def init_capture(self, max_bs: int, max_seq_len: int, pad_slot: int) -> None:
        """Allocate the fixed-address buffers for decode batches of up to `max_bs`
        requests of up to `max_seq_len` tokens; `pad_slot`: a pool slot no request uses."""
        raise NotImplementedError(f"the {self.name} attention backend does not support capture")

    def prepare_for_capture(self, bs: int) -> None:
        """Make the next `forward` calls run over the buffers as a decode batch of `bs`
        padding rows (the forward to record for `bs`)."""
        raise NotImplementedError(f"the {self.name} attention backend does not support capture")

    def prepare_for_replay(self, batch: ForwardBatch, bs: int) -> None:
        """Copy decode `batch` (at most `bs` requests) into the buffers captured for `bs`,
        in place, so that the recorded forward computes it (its rows first)."""
        raise NotImplementedError(f"the {self.name} attention backend does not support capture")
