"""One step's message from rank 0 to the other ranks: a `ForwardBatch` as int64 bytes.

Layout: a header `[op, T, B, n_kv, L, has_logits_indptr]`, then input_ids, positions,
out_slots (T each), extend_lens, seq_lens (B each), kv_indices (n_kv), kv_indptr (B + 1),
logits_indices (L) and logits_indptr (B + 1, when present). No pickle: plain numbers.
"""

from __future__ import annotations

import numpy as np
import torch
from radixlm.runtime.model.batch import ForwardBatch

OP_FORWARD = 1
OP_STOP = 2
_HEADER = 6


def encode_step(batch: ForwardBatch) -> bytes:
    """`batch` as the bytes `decode_step` reads back."""
    lip = batch.logits_indptr
    kv = batch.kv_indices_cpu if batch.kv_indices_cpu is not None else batch.kv_indices
    header = [OP_FORWARD, batch.num_tokens, batch.batch_size, int(kv.shape[0]),
              int(batch.logits_indices.shape[0]), lip is not None]  # fmt: skip
    parts = [
        np.asarray(header, dtype=np.int64),
        _host(batch.input_ids), _host(batch.positions), _host(batch.out_slots),
        np.asarray(batch.extend_lens, dtype=np.int64), np.asarray(batch.seq_lens, dtype=np.int64),
        _host(kv), _host(batch.kv_indptr), _host(batch.logits_indices),
    ]  # fmt: skip
    if lip is not None:
        parts.append(np.asarray(lip, dtype=np.int64))
    return np.concatenate(parts).tobytes()


def encode_stop() -> bytes:
    return np.asarray([OP_STOP, 0, 0, 0, 0, 0], dtype=np.int64).tobytes()


def decode_step(data: bytes, device: torch.device) -> ForwardBatch | None:
    """The batch `encode_step` wrote (its tensors on `device`), or None for a stop."""
    a = np.frombuffer(data, dtype=np.int64)
    op, t, b, n_kv, n_rows, has_lip = (int(v) for v in a[:_HEADER])
    if op == OP_STOP:
        return None
    if op != OP_FORWARD:
        raise ValueError(f"unknown tensor-parallel step op {op}")
    sizes = [t, t, t, b, b, n_kv, b + 1, n_rows] + ([b + 1] if has_lip else [])
    if a.shape[0] != _HEADER + sum(sizes):
        raise ValueError(f"tensor-parallel step of {a.shape[0]} numbers, expected "
                         f"{_HEADER + sum(sizes)}")
    cpu = torch.from_numpy(a[_HEADER:].copy())
    dev = cpu.to(device) if device.type != "cpu" else cpu
    offsets = np.cumsum([0, *sizes]).tolist()

    def part(i: int, src: torch.Tensor = dev) -> torch.Tensor:
        return src[offsets[i] : offsets[i + 1]]

    return ForwardBatch(
        input_ids=part(0),
        positions=part(1),
        out_slots=part(2),
        extend_lens=part(3, cpu).tolist(),
        seq_lens=part(4, cpu).tolist(),
        kv_indices=part(5),
        kv_indptr=part(6),
        logits_indices=part(7),
        logits_indptr=part(8, cpu).tolist() if has_lip else None,
        kv_indices_cpu=part(5, cpu),
    )


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.int64).numpy()
