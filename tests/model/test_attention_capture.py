"""The attention backends' capture hooks, on CPU (no graph is recorded here: there is no
GPU). The torch backend prepares a capture over fixed buffers, then replays decode batches
into them in place: the same tensors every time, results equal to the eager plan's and
to a float64 reference, padding rows writing nowhere but the pad slot; a whole decoder
step run over fixed input buffers that way gives the eager step's logits."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from radixlm.cache import KVPool
from radixlm.runtime.attention import AttentionBackend, TorchAttention
from radixlm.runtime.attention.flashinfer_backend import FlashInferAttention
from radixlm.runtime.model import BatchRequest, ForwardBatch, ModelConfig, ModelRunner
from tiny_models import PageSlots

LAYERS, H, HKV, D = 2, 4, 2, 8
CAPACITY = 256
PAD = CAPACITY - 1  # reserved: no request's slot lists use it
MAX_BS, MAX_SEQ = 4, 48


def make_pool(seed: int = 0) -> KVPool:
    pool = KVPool(LAYERS, HKV, D, CAPACITY, 1, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        pool.k[layer].copy_(torch.randn(CAPACITY, HKV, D, generator=g))
        pool.v[layer].copy_(torch.randn(CAPACITY, HKV, D, generator=g))
    return pool


def backend(pool: KVPool) -> TorchAttention:
    return TorchAttention(pool, H, HKV, D, torch.device("cpu"), torch.float32)


def decode_batches(seed: int) -> list[ForwardBatch]:
    """Decode batches covering the eager planner's variants: one request with consecutive
    slots (a view), a shared cached prompt (read once), ragged lengths (padded)."""
    rng = np.random.default_rng(seed)
    free = rng.permutation(PAD)  # every slot but the pad slot
    shared = free[:20].tolist()
    own = iter(np.split(free[20:200], 30))
    return [
        ForwardBatch.build([([3], None, list(range(40, 57)))]),
        ForwardBatch.build([([5], None, shared + next(own).tolist()[:k]) for k in (1, 3, 6)]),
        ForwardBatch.build([([7], None, next(own).tolist()[:k]) for k in (2, 6, 1, 5)]),
        ForwardBatch.build([([9], None, (shared + next(own).tolist())[:MAX_SEQ - 20 + k])
                            for k in (1, 20)]),
    ]


def reference(pool: KVPool, layer: int, batch: ForwardBatch, q: torch.Tensor) -> torch.Tensor:
    """Attention of each request's one query over its slots, float64, head by head."""
    out = []
    kv = batch.kv_indices.tolist()
    ptr = batch.kv_indptr.tolist()
    for r in range(batch.batch_size):
        slots = kv[ptr[r] : ptr[r + 1]]
        keys, vals = pool.k[layer][slots].double(), pool.v[layer][slots].double()
        heads = []
        for h in range(H):
            s = keys[:, h // (H // HKV)] @ q[r, h].double() * D**-0.5
            heads.append(torch.softmax(s, 0) @ vals[:, h // (H // HKV)])
        out.append(torch.cat(heads))
    return torch.stack(out).float()


def random_qkv(n: int, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Queries and new K/V for `n` requests, zero-padded to `rows` rows."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.zeros(rows, heads, D) for heads in (H, HKV, HKV))
    q[:n], k[:n], v[:n] = (torch.randn(n, heads, D, generator=g) for heads in (H, HKV, HKV))
    return q, k, v


def test_backends_say_whether_they_support_capture() -> None:
    assert TorchAttention.supports_capture
    assert not FlashInferAttention.supports_capture  # no capture code without a GPU to test it

    class Plain(AttentionBackend):  # a backend that implements only the eager interface
        name = "plain"

        def plan(self, batch: ForwardBatch) -> None: ...

        def forward(self, layer_id, q, k, v):  # type: ignore[no-untyped-def]
            return q

    plain = Plain(make_pool(), H, HKV, D, torch.device("cpu"), torch.float32)
    assert not plain.supports_capture
    for call in (lambda: plain.init_capture(2, 8, PAD), lambda: plain.prepare_for_capture(2),
                 lambda: plain.prepare_for_replay(decode_batches(0)[0], 2)):
        with pytest.raises(NotImplementedError, match="plain attention backend"):
            call()


@pytest.mark.parametrize("seed", range(3))
def test_replay_into_fixed_buffers_equals_the_eager_plan(seed: int) -> None:
    pool_eager, pool_replay = make_pool(seed), make_pool(seed)
    eager, captured = backend(pool_eager), backend(pool_replay)
    captured.init_capture(MAX_BS, MAX_SEQ, PAD)
    buf = captured.capture
    assert buf is not None
    addresses = [t.data_ptr() for t in (buf.kv, buf.mask, buf.out_slots)]
    for bs in (1, 2, MAX_BS):  # what a runner records: one forward over padding per size
        captured.prepare_for_capture(bs)
        out = captured.forward(0, *random_qkv(0, bs, seed))
        assert out.shape == (bs, H * D) and bool(torch.isfinite(out).all())
    for i, batch in enumerate(decode_batches(seed)):
        n = batch.batch_size
        bs = next(b for b in (1, 2, MAX_BS) if b >= n)
        q, k, v = random_qkv(n, bs, 1000 * seed + i)
        before = pool_replay.k[1].clone()
        captured.prepare_for_replay(batch, bs)
        assert [t.data_ptr() for t in (buf.kv, buf.mask, buf.out_slots)] == addresses
        for layer in range(LAYERS):
            eager.plan(batch)
            want = eager.forward(layer, q[:n], k[:n], v[:n])
            got = captured.forward(layer, q, k, v)
            assert got.shape == (bs, H * D)
            torch.testing.assert_close(got[:n], want, rtol=0, atol=1e-6)
            torch.testing.assert_close(got[:n], reference(pool_replay, layer, batch, q[:n]),
                                       rtol=1e-5, atol=1e-5)
            assert bool(torch.isfinite(got).all())  # padding rows too
        # The batch's new K/V landed where the eager plan puts them; padding rows wrote
        # the pad slot only.
        for layer in range(LAYERS):
            assert torch.equal(pool_replay.k[layer][:PAD], pool_eager.k[layer][:PAD])
            assert torch.equal(pool_replay.v[layer][:PAD], pool_eager.v[layer][:PAD])
        changed = (pool_replay.k[1] != before).any(-1).any(-1).nonzero().flatten().tolist()
        assert set(changed) <= set(batch.out_slots.tolist()) | {PAD}


def test_replay_refuses_what_the_capture_cannot_hold() -> None:
    attn = backend(make_pool())
    batch = decode_batches(0)[2]  # 4 requests
    with pytest.raises(RuntimeError, match="init_capture"):
        attn.prepare_for_capture(2)
    attn.init_capture(MAX_BS, 16, PAD)
    with pytest.raises(RuntimeError, match="already"):
        attn.init_capture(MAX_BS, 16, PAD)
    with pytest.raises(ValueError, match="no capture for batch size 4"):
        attn.prepare_for_replay(batch, 4)
    attn.prepare_for_capture(2)
    attn.prepare_for_capture(4)
    with pytest.raises(ValueError, match="outside the captured range"):
        attn.prepare_for_capture(MAX_BS + 1)
    with pytest.raises(ValueError, match="does not fit"):
        attn.prepare_for_replay(batch, 2)
    prefill = ForwardBatch.build([([1, 2], 0, [4, 5])])
    with pytest.raises(ValueError, match="only decode batches"):
        attn.prepare_for_replay(prefill, 2)
    long = ForwardBatch.build([([1], None, list(range(17)))])
    with pytest.raises(ValueError, match="longer than the captured 16"):
        attn.prepare_for_replay(long, 2)
    attn.prepare_for_replay(batch, 4)  # the refusals changed nothing: this one still works
    for bad in ((0, 8, PAD), (2, 0, PAD), (2, 8, CAPACITY), (2, 8, -1)):
        with pytest.raises(ValueError):
            backend(make_pool()).init_capture(*bad)


def test_a_decoder_step_over_fixed_buffers_equals_the_eager_step(tiny_model_dir: Path) -> None:
    """What a runner does around a graph, without the graph: input buffers of `bs` rows,
    `prepare_for_capture` then the decoder once, and per step the batch copied into the
    buffers, `prepare_for_replay`, the same decoder call. Greedy decoding of three requests
    of different lengths matches the eager runner token for token, logits within 1e-5."""
    cfg = ModelConfig.from_dir(tiny_model_dir)
    capacity, bs, steps = 512, 4, 6

    def runner() -> ModelRunner:
        pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, 1,
                      torch.float32, "cpu")
        return ModelRunner(tiny_model_dir, "cpu", "float32", pool, attention="torch")

    eager, replay = runner(), runner()
    attn = replay.attn
    assert attn.supports_capture
    attn.init_capture(bs, 64, capacity - 1)
    ids_buf, pos_buf = torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64)
    fixed = SimpleNamespace(input_ids=ids_buf, positions=pos_buf,
                            logits_indices=torch.arange(bs))  # what the decoder reads
    with torch.inference_mode():
        attn.prepare_for_capture(bs)
        replay.model.forward_hidden(fixed, attn)  # the forward a graph would record

    pages = PageSlots(capacity - 1, 1)
    prompts = [[5, 9, 13, 2, 7], [11, 4], [8, 8, 3, 1, 6, 2, 9, 10, 12]]
    slots = [pages.extend([], len(p)) for p in prompts]
    prefill = [BatchRequest(p, 0, s) for p, s in zip(prompts, slots, strict=True)]
    last = [int(t) for t in eager.forward(ForwardBatch.build(prefill)).argmax(-1)]
    replay.forward(ForwardBatch.build(prefill))  # the prompts' K/V in the replay pool too
    for _ in range(steps):
        slots = [pages.extend(s, 1) for s in slots]
        batch = ForwardBatch.build([([t], None, s) for t, s in zip(last, slots, strict=True)])
        want = eager.forward(batch)
        n = batch.batch_size
        ids_buf[:n], ids_buf[n:] = batch.input_ids, 0
        pos_buf[:n], pos_buf[n:] = batch.positions, 0
        with torch.inference_mode():
            attn.prepare_for_replay(batch, bs)
            hidden = replay.model.forward_hidden(fixed, attn)
        got = replay.model.compute_logits(hidden)[:n]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        last = [int(t) for t in want.argmax(-1)]
        assert got.argmax(-1).tolist() == last
