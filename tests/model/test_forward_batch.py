"""The one `ForwardBatch` builder (`pack_forward_batch`), through both of its callers
(`ForwardBatch.build` for plain lists, the engine's `build_batch` for request buffers),
against a per-token reference written from the batch's definition."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from radixlm.runtime.engine.batch import Scheduled, build_batch
from radixlm.runtime.model.batch import BatchRequest, ForwardBatch

FIELDS = ("input_ids", "positions", "out_slots", "kv_indices", "kv_indptr", "logits_indices")


def reference(requests: list[tuple[list[int], int, list[int], int]]) -> dict[str, list]:
    """Request `(new_ids, start_pos, slots, logits_from)`, one token at a time: new token j
    sits at position start_pos + j in slot slots[len(slots) - n + j]; logit rows for the
    new tokens from offset logits_from on."""
    out: dict[str, list] = {name: [] for name in FIELDS}
    out["kv_indptr"] = [0]
    logits_indptr, row = [0], 0
    for ids, start, slots, first in requests:
        n = len(ids)
        for j in range(n):
            out["input_ids"].append(ids[j])
            out["positions"].append(start + j)
            out["out_slots"].append(slots[len(slots) - n + j])
            if j >= first:
                out["logits_indices"].append(row)
            row += 1
        out["kv_indices"] += slots
        out["kv_indptr"].append(out["kv_indptr"][-1] + len(slots))
        logits_indptr.append(logits_indptr[-1] + n - first)
    out["extend_lens"] = [len(r[0]) for r in requests]
    out["seq_lens"] = [len(r[2]) for r in requests]
    out["logits_indptr"] = logits_indptr
    return out


def check(batch: ForwardBatch, want: dict[str, list]) -> None:
    for name in FIELDS:
        t = getattr(batch, name)
        assert t.dtype == torch.int64 and t.tolist() == want[name], name
    assert batch.extend_lens == want["extend_lens"] and batch.seq_lens == want["seq_lens"]
    assert batch.logits_indptr == want["logits_indptr"]
    assert batch.kv_indices_cpu is not None and batch.kv_indices_cpu.tolist() == want["kv_indices"]
    assert batch.is_decode == all(n == 1 for n in want["extend_lens"])


def random_plan(rng: np.random.Generator, b: int, decode: bool) -> list[tuple[int, int, int]]:
    """(cached, new, logits_from) per request; decode: one new token, its logits."""
    plan = []
    for _ in range(b):
        kv = int(rng.integers(0, 40))
        ext = 1 if decode else int(rng.integers(1, 12))
        first = 0 if decode else int(rng.integers(0, ext))
        plan.append((kv, ext, first))
    return plan


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_engine_build_batch_matches_the_reference(seed: int, decode: bool) -> None:
    """Request buffers longer than the sequence (as the engine allocates them), slots in
    any order; decode batches take the builder's fast path."""
    rng = np.random.default_rng(seed)
    plan, ref = [], []
    for kv, ext, first in random_plan(rng, int(rng.integers(1, 9)), decode):
        spare = int(rng.integers(0, 6))  # buffer room past the sequence
        tokens = rng.integers(3, 50_000, kv + ext + spare).astype(np.int64)
        slots = rng.permutation(10_000)[: kv + ext + spare].astype(np.int64)
        req = SimpleNamespace(tokens=tokens, slots=slots, kv_len=kv)
        plan.append(Scheduled(req, ext, first))  # type: ignore[arg-type]
        ref.append((tokens[kv : kv + ext].tolist(), kv, slots[: kv + ext].tolist(), first))
    check(build_batch(plan, torch.device("cpu")), reference(ref))


@pytest.mark.parametrize("seed", range(4))
def test_forward_batch_build_matches_the_reference(seed: int) -> None:
    """Plain lists and tuples, start positions given or implied, all or last logits, a
    mix of decode and prefill rows."""
    rng = np.random.default_rng(100 + seed)
    requests, ref = [], []
    for _ in range(int(rng.integers(1, 8))):
        kv, ext = int(rng.integers(0, 30)), int(rng.integers(1, 4) if rng.random() < 0.5 else 1)
        ids = rng.integers(3, 1000, ext).tolist()
        slots = rng.permutation(5000)[: kv + ext].tolist()
        all_logits = bool(rng.random() < 0.5)
        start = None if rng.random() < 0.5 else kv + int(rng.integers(0, 3))
        requests.append(BatchRequest(ids, start, slots, all_logits))
        ref.append((ids, kv if start is None else start, slots, 0 if all_logits else ext - 1))
    check(ForwardBatch.build(requests), reference(ref))
    decode = [BatchRequest([5], None, [9, 4]), ([6], 7, [3])]  # plain tuples too
    check(ForwardBatch.build(decode), reference([([5], 1, [9, 4], 0), ([6], 7, [3], 0)]))
