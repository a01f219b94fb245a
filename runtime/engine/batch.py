"""One step's work as a `ForwardBatch`, built with numpy slices of the requests' buffers.

Every scheduled request extends its KV by `extend` tokens from `kv_len` on (a prefill
chunk, or 1 for a decode); the tokens and slots are already in the request's buffers,
so building the batch is slicing and concatenating, with no per-token Python. All index
arrays travel to the device in one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from radixlm.runtime.engine.request import Request
from radixlm.runtime.model.batch import ForwardBatch

_I64 = np.int64


class Scheduled(NamedTuple):
    """A request's share of one forward: `extend` new tokens; logits are returned for
    its extend offsets `logits_from .. extend - 1` (the last one samples the next token,
    earlier ones are prompt-logprob positions)."""

    req: Request
    extend: int
    logits_from: int


def build_batch(plan: Sequence[Scheduled], device: torch.device) -> ForwardBatch:
    """Index arrays are written into one host buffer (ids, positions, out slots, KV
    indices, KV indptr, logit rows) and moved to the device in one copy."""
    reqs = [s.req for s in plan]
    b = len(plan)
    kv0 = np.fromiter([r.kv_len for r in reqs], _I64, b)
    decode = all(s.extend == 1 and s.logits_from == 0 for s in plan)
    if decode:  # one token and one logits row per request: no ragged bookkeeping
        ext_a = np.ones(b, dtype=_I64)
        n_tok = n_rows = b
    else:
        ext_a = np.fromiter([s.extend for s in plan], _I64, b)
        first = np.fromiter([s.logits_from for s in plan], _I64, b)
        n_tok = int(ext_a.sum())
        n_rows = n_tok - int(first.sum())
    seq_a = kv0 + ext_a
    seq = seq_a.tolist()
    n_kv = sum(seq)
    o1, o2, o3 = n_tok, 2 * n_tok, 3 * n_tok
    o4 = o3 + n_kv
    o5 = o4 + b + 1
    host = np.empty(o5 + n_rows, dtype=_I64)
    ids, pos, out = host[:o1], host[o1:o2], host[o2:o3]
    kvi, indptr, rows = host[o3:o4], host[o4:o5], host[o5:]
    if decode:
        kv = kv0.tolist()
        ids[:] = np.fromiter((r.tokens[k] for r, k in zip(reqs, kv, strict=True)), _I64, b)
        out[:] = np.fromiter((r.slots[k] for r, k in zip(reqs, kv, strict=True)), _I64, b)
        pos[:] = kv0
        rows[:] = np.arange(b, dtype=_I64)
        logits_indptr = list(range(b + 1))
    else:
        kv = kv0.tolist()
        np.concatenate([r.tokens[k:s] for r, k, s in zip(reqs, kv, seq, strict=True)], out=ids)
        np.concatenate([r.slots[k:s] for r, k, s in zip(reqs, kv, seq, strict=True)], out=out)
        q_start = np.zeros(b + 1, dtype=_I64)
        np.cumsum(ext_a, out=q_start[1:])
        pos[:] = np.arange(n_tok, dtype=_I64) + np.repeat(kv0 - q_start[:-1], ext_a)
        per_req = ext_a - first
        row_start = np.zeros(b + 1, dtype=_I64)
        np.cumsum(per_req, out=row_start[1:])
        rows[:] = np.arange(n_rows, dtype=_I64) + np.repeat(
            q_start[:-1] + first - row_start[:-1], per_req
        )
        logits_indptr = row_start.tolist()
    np.concatenate([r.slots[:s] for r, s in zip(reqs, seq, strict=True)], out=kvi)
    indptr[0] = 0
    np.cumsum(seq_a, out=indptr[1:])

    cpu = torch.from_numpy(host)
    dev = cpu.to(device) if device.type != "cpu" else cpu
    return ForwardBatch(
        input_ids=dev[:o1],
        positions=dev[o1:o2],
        out_slots=dev[o2:o3],
        extend_lens=[1] * b if decode else ext_a.tolist(),
        seq_lens=seq,
        kv_indices=dev[o3:o4],
        kv_indptr=dev[o4:o5],
        logits_indices=dev[o5:],
        logits_indptr=logits_indptr,
        kv_indices_cpu=cpu[o3:o4],
    )
