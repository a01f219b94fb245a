"""`ForwardBatch`: everything one forward pass needs, passed explicitly (no global context).

A batch is ragged: request `r` brings `extend_lens[r]` new tokens on top of a cached
prefix of `seq_lens[r] - extend_lens[r]` tokens. The new tokens of all requests are
flattened into `T = sum(extend_lens)` rows, in request order. `kv_indices` lists, per
request, the KV-pool slot of every position (prefix, then new), delimited by `kv_indptr`;
the last `extend_lens[r]` of a request's slots are also its `out_slots` (where the new K/V
is written before attention reads prefix + new from the pool).

Build one from plain lists with `ForwardBatch.build([...])` (see `BatchRequest`); both it
and the engine's scheduler build the tensors with `pack_forward_batch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import numpy as np
import torch

_I64 = np.int64


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

        All index tensors travel to `device` in one copy (`pack_forward_batch`).
        """
        if not requests:
            raise ValueError("a forward batch needs at least one request")
        tokens, slots, starts, lasts = [], [], [], []
        b = len(requests)
        ext, kv = np.empty(b, dtype=_I64), np.empty(b, dtype=_I64)
        for i, req in enumerate(requests):
            req = BatchRequest(*req)
            ids = np.asarray(req.token_ids, dtype=_I64).reshape(-1)
            sl = np.asarray(req.slots, dtype=_I64).reshape(-1)
            n, s = ids.shape[0], sl.shape[0]
            if n == 0:
                raise ValueError(f"request {i} has no new tokens")
            if s < n:
                raise ValueError(f"request {i}: {s} slots for {n} new tokens (need prefix + new)")
            start = s - n if req.start_pos is None else int(req.start_pos)
            if start < 0:
                raise ValueError(f"request {i}: negative start position {start}")
            tokens.append(ids)
            slots.append(sl)
            starts.append(start)
            lasts.append(0 if req.all_logits else n - 1)
            ext[i], kv[i] = n, s - n
        decode = bool((ext == 1).all())  # one row each, whether all_logits or not
        return pack_forward_batch(
            tokens, slots, kv, None if decode else ext,
            None if decode else np.asarray(lasts, dtype=_I64), torch.device(device),
            token_offsets=np.zeros(b, dtype=_I64), positions_from=np.asarray(starts, dtype=_I64),
        )


def pack_forward_batch(
    tokens: Sequence[np.ndarray],
    slots: Sequence[np.ndarray],
    kv_lens: np.ndarray | Sequence[int],
    extends: np.ndarray | None,
    logits_from: np.ndarray | None,
    device: torch.device,
    *,
    token_offsets: np.ndarray | None = None,
    positions_from: np.ndarray | None = None,
) -> ForwardBatch:
    """The one place that builds a batch's tensors, by slicing each request's buffers (no
    per-token Python); the engine's scheduler (`engine.batch.build_batch`) and
    `ForwardBatch.build` both call it. Arrays are int64 and indexed by request.

    Request `r` has `kv_lens[r]` cached tokens and brings `extends[r]` new ones (None: one
    each, a decode batch), `tokens[r][o : o + extends[r]]` with `o = token_offsets[r]`
    (default `kv_lens[r]`: buffers that hold the whole sequence), at positions from
    `positions_from[r]` (default `kv_lens[r]`). Its KV slots are `slots[r][: kv_lens[r] +
    extends[r]]`, the last `extends[r]` of them where the new K/V go. Logit rows are
    returned for its new tokens from offset `logits_from[r]` on (None: the last one only,
    which for a decode batch is its only one).

    Index arrays are written into one host buffer (ids, positions, out slots, KV indices,
    KV indptr, logit rows) and moved to the device in one copy.
    """
    if extends is None:
        return _pack_decode(tokens, slots, _ints(kv_lens), _ints(token_offsets), _ints(positions_from), device)
    kv_lens = np.asarray(kv_lens, dtype=_I64)
    b = len(tokens)
    ext_a = extends
    first = ext_a - 1 if logits_from is None else logits_from
    n_tok = int(ext_a.sum())
    n_rows = n_tok - int(first.sum())
    seq_a = kv_lens + ext_a
    seq = seq_a.tolist()
    n_kv = sum(seq)
    o1, o2, o3 = n_tok, 2 * n_tok, 3 * n_tok
    o4 = o3 + n_kv
    host = np.empty(o4 + b + 1 + n_rows, dtype=_I64)
    ids, pos, out = host[:o1], host[o1:o2], host[o2:o3]
    kvi, indptr, rows = host[o3:o4], host[o4 : o4 + b + 1], host[o4 + b + 1 :]
    kv = kv_lens.tolist()
    tok0 = kv if token_offsets is None else token_offsets.tolist()
    pos0 = kv_lens if positions_from is None else positions_from
    ext = ext_a.tolist()
    np.concatenate([t[k : k + e] for t, k, e in zip(tokens, tok0, ext, strict=True)], out=ids)
    np.concatenate([s[k:q] for s, k, q in zip(slots, kv, seq, strict=True)], out=out)
    q_start = np.zeros(b + 1, dtype=_I64)
    np.cumsum(ext_a, out=q_start[1:])
    pos[:] = np.arange(n_tok, dtype=_I64) + np.repeat(pos0 - q_start[:-1], ext_a)
    per_req = ext_a - first
    row_start = np.zeros(b + 1, dtype=_I64)
    np.cumsum(per_req, out=row_start[1:])
    rows[:] = np.arange(n_rows, dtype=_I64) + np.repeat(q_start[:-1] + first - row_start[:-1], per_req)
    np.concatenate([s[:q] for s, q in zip(slots, seq, strict=True)], out=kvi)
    indptr[0] = 0
    np.cumsum(seq_a, out=indptr[1:])
    return _batch(host, n_tok, n_kv, ext, seq, row_start.tolist(), device)


def _pack_decode(tokens: Sequence[np.ndarray], slots: Sequence[np.ndarray], kv: list[int],
                 tok0: list[int] | None, pos0: list[int] | None, device: torch.device) -> ForwardBatch:
    """`pack_forward_batch` of a decode batch (one token, one logits row a request) from
    plain ints: the engine builds one every step, right after a forward whose weight
    stream has left the caches cold, where each array operation costs ~5-10 us; this
    makes no array but the buffer (measured cold: 76-85 us against 133-170 us)."""
    b = len(tokens)
    seq = [k + 1 for k in kv]
    n_kv = sum(seq)
    o3 = 3 * b
    host = np.empty(o3 + n_kv + 2 * b + 1, dtype=_I64)
    ids = [t[k] for t, k in zip(tokens, kv if tok0 is None else tok0, strict=True)]
    out = [s[k] for s, k in zip(slots, kv, strict=True)]
    host[:o3] = ids + (kv if pos0 is None else pos0) + out
    host[o3 + n_kv :] = [0, *accumulate(seq), *range(b)]  # KV indptr, logit rows
    if b == 1:
        host[o3 : o3 + n_kv] = slots[0][:n_kv]
    else:
        np.concatenate([s[:q] for s, q in zip(slots, seq, strict=True)], out=host[o3 : o3 + n_kv])
    return _batch(host, b, n_kv, [1] * b, seq, list(range(b + 1)), device)


def _batch(host: np.ndarray, n_tok: int, n_kv: int, ext: list[int], seq: list[int], logits_indptr: list[int],
           device: torch.device) -> ForwardBatch:
    """The batch whose index arrays lie in `host` (ids, positions, out slots [n_tok] each, KV
    indices [n_kv], KV indptr [B + 1], logit rows), on `device` in one copy."""
    o1, o2, o3 = n_tok, 2 * n_tok, 3 * n_tok
    o4 = o3 + n_kv
    o5 = o4 + len(ext) + 1
    cpu = torch.from_numpy(host)
    dev = cpu.to(device) if device.type != "cpu" else cpu
    kvi = dev[o3:o4]
    return ForwardBatch(
        input_ids=dev[:o1],
        positions=dev[o1:o2],
        out_slots=dev[o2:o3],
        extend_lens=ext,
        seq_lens=seq,
        kv_indices=kvi,
        kv_indptr=dev[o4:o5],
        logits_indices=dev[o5:],
        logits_indptr=logits_indptr,
        kv_indices_cpu=kvi if dev is cpu else cpu[o3:o4],
    )


def _ints(a: np.ndarray | Sequence[int] | None) -> list[int] | None:
    return None if a is None else a.tolist() if isinstance(a, np.ndarray) else list(a)


def build_forward_batch(
    requests: Sequence[BatchRequest | tuple], device: torch.device | str = "cpu"
) -> ForwardBatch:
    """Alias of `ForwardBatch.build`."""
    return ForwardBatch.build(requests, device)
