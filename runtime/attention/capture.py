"""`DecodeBuffers`: a decode batch's attention metadata at fixed addresses, for capture.

A recorded forward (a CUDA graph) reads its tensors where they were when it was recorded,
so a batch to replay is copied into the same tensors: every request's slot list padded to
`max_seq_len` (padding attends nothing), and rows past the batch padded up to the
captured batch size (they write their K/V to `pad_slot` and attend to it alone, so their
softmax is never over an empty row). The batch's own rows see exactly what an eager plan
gives them: their slots, in order, and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DecodeBuffers"]


@dataclass
class DecodeBuffers:
    kv: torch.Tensor  # [max_bs, max_seq_len] int64: pool rows of each request's positions
    mask: torch.Tensor  # [max_bs, 1, 1, max_seq_len] bool: True = attend
    out_slots: torch.Tensor  # [max_bs] int64: where each row's new K/V is written
    pad_slot: int

    @property
    def max_bs(self) -> int:
        return int(self.kv.shape[0])

    @property
    def max_seq_len(self) -> int:
        return int(self.kv.shape[1])

    @classmethod
    def allocate(
        cls, max_bs: int, max_seq_len: int, pad_slot: int, capacity: int, device: torch.device
    ) -> DecodeBuffers:
        if max_bs < 1 or max_seq_len < 1:
            raise ValueError(f"capture needs max_bs >= 1 and max_seq_len >= 1 "
                             f"(got {max_bs}, {max_seq_len})")
        if not 0 <= pad_slot < capacity:
            raise ValueError(f"pad_slot {pad_slot} is outside the pool (capacity {capacity})")
        return cls(
            kv=torch.full((max_bs, max_seq_len), pad_slot, dtype=torch.int64, device=device),
            mask=torch.zeros(max_bs, 1, 1, max_seq_len, dtype=torch.bool, device=device),
            out_slots=torch.full((max_bs,), pad_slot, dtype=torch.int64, device=device),
            pad_slot=pad_slot,
        )

    def check_size(self, bs: int) -> None:
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"batch size {bs} is outside the captured range 1..{self.max_bs}")

    def pad(self, bs: int) -> None:
        """Rows `[:bs]` as padding rows (what a capture runs over)."""
        self.check_size(bs)
        self.kv[:bs].fill_(self.pad_slot)
        self.mask[:bs].fill_(False)
        self.mask[:bs, 0, 0, 0] = True
        self.out_slots[:bs].fill_(self.pad_slot)

    def fill(self, batch, bs: int) -> None:
        """Copy decode `batch` into rows `[:batch.batch_size]` and pad the rest up to `bs`,
        in place (the tensors keep their addresses)."""
        self.check_size(bs)
        n = batch.batch_size
        if not batch.is_decode:
            raise ValueError("only decode batches (one new token per request) replay")
        if n > bs:
            raise ValueError(f"a batch of {n} requests does not fit the capture for {bs}")
        seq = np.asarray(batch.seq_lens, dtype=np.int64)
        if int(seq.max()) > self.max_seq_len:
            raise ValueError(f"a sequence of {int(seq.max())} tokens is longer than the "
                             f"captured {self.max_seq_len}")
        kv_cpu = batch.kv_indices_cpu
        if kv_cpu is None:
            kv_cpu = batch.kv_indices.cpu()
        valid = np.arange(self.max_seq_len, dtype=np.int64)[None, :] < seq[:, None]  # [n, L]
        rows = np.full((bs, self.max_seq_len), self.pad_slot, dtype=np.int64)
        rows[:n][valid] = kv_cpu.numpy()  # row-major: each request's slots in order
        mask = np.zeros((bs, self.max_seq_len), dtype=np.bool_)
        mask[:n] = valid
        mask[n:, 0] = True
        self.kv[:bs].copy_(torch.from_numpy(rows))
        self.mask[:bs].view(bs, self.max_seq_len).copy_(torch.from_numpy(mask))
        self.out_slots[:n].copy_(batch.out_slots)
        self.out_slots[n:bs].fill_(self.pad_slot)
