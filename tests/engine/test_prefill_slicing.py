"""Preemptible prefill (issue 24, item 5): a long prompt chunk runs in slices and another
client's new request gets its first token while that chunk is still being computed; both
outputs are the model's own (HF transformers' greedy tokens); an abort mid-slice leaks
nothing. Slices are counted, never timed: a 1 ns slice budget runs one piece a slice."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from radixlm.runtime.engine.wire import EngineAbort
from radixlm.runtime.model.batch import pack_forward_batch
from scheduler_harness import (  # noqa: F401 - the fixtures
    hf,
    hf_greedy,
    make_harness,
    random_prompt,
    tiny_dir,
)

pytestmark = pytest.mark.timeout(300)
CHUNK = 128
ROWS = 16
LONG = 200  # chunks of 128 + 72, each 8 (5) row blocks per layer
# One piece per slice, every chunk of 64+ tokens sliced.
SLICED = dict(chunked_prefill=CHUNK, max_running=8, prefill_slice_min_tokens=64,
              prefill_slice_rows=ROWS, prefill_slice_ms=1e-6)


def _long_request(h, key):  # noqa: ANN001, ANN202
    return next(r for r in h.sched.running if r.group.key == key)


def test_a_newcomer_gets_its_first_token_during_the_long_chunk(make_harness, hf) -> None:  # noqa: ANN001, F811
    rng = np.random.default_rng(5)
    h = make_harness(**SLICED)
    long_prompt = random_prompt(rng, LONG)
    short_prompt = random_prompt(rng, 6)
    long = h.generate(long_prompt, max_tokens=4, client=b"a")
    h.step()  # the first chunk starts: one piece (layer 0, rows 0..15)
    slicer = h.sched.slicer
    assert slicer.current is not None and slicer.current.entry.req.group.key == long
    short = h.generate(short_prompt, max_tokens=4, client=b"b")
    steps = 0
    while not h.tokens[(short, 0)]:
        h.step()
        steps += 1
        assert steps <= 4, "the newcomer waited behind the long chunk"
    # The first token came while the long prompt's first chunk was still computing.
    r = _long_request(h, long)
    assert r.kv_len == 0 and r.slicing and slicer.current is not None
    task = slicer.current.task
    assert 0 < task.pieces_run < task.total_pieces
    h.run()
    assert h.output(short) == hf_greedy(hf, short_prompt, 4)
    assert h.output(long) == hf_greedy(hf, long_prompt, 4)
    assert slicer.current is None and slicer.slices >= task.total_pieces


def test_alone_sliced_equals_unsliced(make_harness, hf) -> None:  # noqa: ANN001, F811
    rng = np.random.default_rng(6)
    prompt = random_prompt(rng, LONG)
    out = []
    for opts in (SLICED, {**SLICED, "prefill_slice_ms": 0}):
        h = make_harness(**opts)
        k = h.generate(prompt, max_tokens=6)
        h.run()
        out.append(h.output(k))
    assert out[0] == out[1] == hf_greedy(hf, prompt, 6)


@pytest.mark.parametrize("chunk", [0, 1])  # abort in the first chunk; in the second
def test_an_abort_mid_slice_frees_everything(make_harness, chunk: int) -> None:  # noqa: ANN001, F811
    rng = np.random.default_rng(chunk)
    h = make_harness(**SLICED)
    long = h.generate(random_prompt(rng, LONG), max_tokens=4, client=b"a")
    other = h.generate(random_prompt(rng, 5), max_tokens=3, client=b"b")
    h.step()
    r = _long_request(h, long)
    while r.kv_len < chunk * CHUNK or not r.slicing:
        h.step()
    h.step()
    h.step()  # a few pieces into the chunk
    assert r.slicing and h.sched.slicer.current is not None
    assert h.sched.slicer.current.task.pieces_run >= 2
    chunk_start = r.kv_len
    h.send(EngineAbort(key=long))
    assert h.final[(long, 0)].finish_reason == "abort"
    assert not r.slicing
    h.step()
    assert h.sched.slicer.current is None
    h.run()
    assert h.final[(other, 0)].finish_reason == "length"
    # What the earlier chunks computed stays as cache; the aborted chunk's slots are free.
    sizes = h.cache.sizes()
    assert sizes.evictable >= chunk_start
    assert sizes.free + sizes.evictable + sizes.protected == sizes.capacity
    h.check_quiescent()


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_sliced_prefill_matches_one_forward(tiny_dir, quantize) -> None:  # noqa: ANN001, F811
    """The model-side task alone: same logits and same K/V as one forward, with and
    without a cached prefix (quantized: each layer dequantized once for its pieces)."""
    from radixlm.runtime.model import ModelRunner
    from scheduler_harness import Harness

    h = Harness(tiny_dir)
    pool = h.pool
    runner = h.runner if quantize is None else ModelRunner(tiny_dir, "cpu", None, pool, "torch",
                                                           quantize=quantize)
    assert (quantize is None) == (type(runner.model.layers[0].w_qkv_t).__name__ != "QuantWeight")
    rng = np.random.default_rng(1)
    tokens = np.asarray(random_prompt(rng, 150), np.int64)
    n = len(tokens)
    slots_a = np.arange(n, dtype=np.int64)
    slots_b = rng.permutation(np.arange(n, 2 * n, dtype=np.int64))
    for kv_len in (0, 40):
        slots_b[:kv_len] = slots_a[:kv_len]  # (prefix K/V of the first run)
        ext = n - kv_len
        batch = pack_forward_batch([tokens], [slots_a], np.array([kv_len]), np.array([ext]),
                                   np.array([ext - 10]), runner.device)
        want = runner.forward(batch)
        task = runner.start_sliced(tokens, slots_b, kv_len, ext, ext - 10, ROWS)
        got = None
        while got is None:
            got = task.advance(0.0)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for k in (*pool.k, *pool.v):
            torch.testing.assert_close(k[slots_b[kv_len:]], k[slots_a[kv_len:]],
                                       atol=1e-5, rtol=1e-5)
