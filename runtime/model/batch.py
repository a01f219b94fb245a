"""`ForwardBatch`: everything one forward pass needs, passed explicitly (no global context).

A batch is ragged: request `r` brings `extend_lens[r]` new tokens on top of a cached
prefix of `seq_lens[r] - extend_lens[r]` tokens. The new tokens of all requests are
flattened into `T = sum(extend_lens)` rows, in request order. `kv_indices` lists, per
request, the KV-pool slot of every position (prefix, then new), delimited by `kv_indptr`;
the last `extend_lens[r]` of a request's slots are also its `out_slots` (where the new K/V
is written before attention reads prefix + new from the pool).

Build one from plain lists with `ForwardBatch.build([...])` (see `BatchRequest`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class BatchRequest(NamedTuple):
    """One request's share of a forward pass.

    - `token_ids`: the new tokens (not yet in the pool), at least one.
    - `start_pos`: position id of the first new token (None: `len(slots) - len(token_ids)`,
      i.e. the number of cached prefix tokens).
    - `slots`: the request's full slot list, cached prefix then one slot per new token.
    - `all_logits`: return logits for every new token (prompt logprobs) instead of the last.
    """

    token_ids: Sequence[int] | np.ndarray
    start_pos: int | None
    slots: Sequence[int] | np.ndarray
    all_logits: bool = False


@dataclass
class ForwardBatch:
    """Inputs of one forward pass; tensors live on the model's device.

    Logit rows come back in request order: request `r` owns rows
    `logits_indptr[r]:logits_indptr[r + 1]` of the returned `[L, vocab]` tensor.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64
    extend_lens: list[int]  # [B] new tokens per request
    seq_lens: list[int]  # [B] prefix + new
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64
    kv_indptr: torch.Tensor  # [B + 1] int64
    logits_indices: torch.Tensor  # [L] int64, rows of the T tokens
    logits_indptr: list[int] | None = None  # [B + 1]; None: one row per request
    kv_indices_cpu: torch.Tensor | None = None  # host copy of kv_indices, if the builder had one

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens, strict=True)]

    @property
    def is_decode(self) -> bool:
        """Every request brings exactly one new token."""
        return all(e == 1 for e in self.extend_lens)

    @classmethod
    def build(
        cls,
        requests: Sequence[BatchRequest | tuple],
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Assemble a batch from per-request `(token_ids, start_pos, slots[, all_logits])`.

        All index tensors travel to `device` in one copy.
        """
        if not requests:
            raise ValueError("a forward batch needs at least one request")
        ids_parts, pos_parts, slot_parts, logit_parts = [], [], [], []
        extend_lens, seq_lens, logits_indptr = [], [], [0]
        offset = 0
        for i, req in enumerate(requests):
            req = BatchRequest(*req)
            ids = np.asarray(req.token_ids, dtype=np.int64).reshape(-1)
            slots = np.asarray(req.slots, dtype=np.int64).reshape(-1)
            n, s = ids.shape[0], slots.shape[0]
            if n == 0:
                raise ValueError(f"request {i} has no new tokens")
            if s < n:
                raise ValueError(f"request {i}: {s} slots for {n} new tokens (need prefix + new)")
            start = s - n if req.start_pos is None else int(req.start_pos)
            if start < 0:
                raise ValueError(f"request {i}: negative start position {start}")
            ids_parts.append(ids)
            pos_parts.append(np.arange(start, start + n, dtype=np.int64))
            slot_parts.append(slots)
            if req.all_logits:
                logit_parts.append(np.arange(offset, offset + n, dtype=np.int64))
            else:
                logit_parts.append(np.array([offset + n - 1], dtype=np.int64))
            logits_indptr.append(logits_indptr[-1] + logit_parts[-1].shape[0])
            extend_lens.append(n)
            seq_lens.append(s)
            offset += n
        kv_indices = np.concatenate(slot_parts)
        kv_indptr = np.zeros(len(seq_lens) + 1, dtype=np.int64)
        np.cumsum(seq_lens, out=kv_indptr[1:])
        out_slots = np.concatenate(
            [sl[sl.shape[0] - n :] for sl, n in zip(slot_parts, extend_lens, strict=True)]
        )
        parts = [
            np.concatenate(ids_parts),
            np.concatenate(pos_parts),
            out_slots,
            kv_indices,
            kv_indptr,
            np.concatenate(logit_parts),
        ]
        sizes = [p.shape[0] for p in parts]
        host = torch.from_numpy(np.concatenate(parts))
        dev = host.to(device, non_blocking=False)
        chunks = torch.split(dev, sizes)
        kv_cpu = host[sizes[0] + sizes[1] + sizes[2] :][: sizes[3]]
        return cls(
            input_ids=chunks[0],
            positions=chunks[1],
            out_slots=chunks[2],
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            kv_indices=chunks[3],
            kv_indptr=chunks[4],
            logits_indices=chunks[5],
            logits_indptr=logits_indptr,
            kv_indices_cpu=kv_cpu,
        )


def build_forward_batch(
    requests: Sequence[BatchRequest | tuple], device: torch.device | str = "cpu"
) -> ForwardBatch:
    """Alias of `ForwardBatch.build`."""
    return ForwardBatch.build(requests, device)
