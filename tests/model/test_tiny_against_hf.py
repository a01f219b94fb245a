"""Decoder logits vs HF transformers on tiny random checkpoints (float32, atol 1e-4).

Scenarios, each at page sizes 1 and 16, on the torch attention backend:
(a) a whole prompt in one prefill; (b) the same prompt as a cached prefix plus a suffix
reusing the prefix's pool slots; (c) token-by-token decode; (d) a ragged batch of requests
sharing prefix slots, mixing prefills with and without a cached prefix and decodes;
(e) a batched decode of requests of different lengths (padded path); (f) a batched decode
of requests sharing a cached prompt (read once for all) with own tails of different lengths.
Slot lists come from shuffled pages, so reads really go through the slot indices.
"""

from __future__ import annotations

import pytest
import torch
from radixlm.runtime.model import BatchRequest, ModelConfig, ModelRunner
from tiny_models import TINY_VARIANTS, assert_close, load_hf_model, make_tiny_checkpoint, random_ids
from tiny_models import ModelEnv as Env

PAGE_SIZES = [1, 16]
CAPACITY = 1024  # ModelEnv's pool


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def variant(request, tmp_path_factory):
    name = request.param
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp(name), name=name,
                                     **TINY_VARIANTS[name])  # fmt: skip
    hf = load_hf_model(model_dir)
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def ref(ids) -> torch.Tensor:
        key = tuple(int(i) for i in ids)
        if key not in cache:
            with torch.no_grad():
                cache[key] = hf(torch.tensor([key])).logits[0].float()
        return cache[key]

    return model_dir, ref


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_whole_prompt_prefill(variant, page_size):
    model_dir, ref = variant
    env = Env(model_dir, page_size)
    ids = random_ids(37, 1)
    slots = env.pages.extend([], len(ids))
    (all_rows,) = env.run([BatchRequest(ids, 0, slots, all_logits=True)])
    assert_close(all_rows, ref(ids))
    (last,) = env.run([BatchRequest(ids, 0, env.pages.extend([], len(ids)))])
    assert_close(last, ref(ids)[-1:])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_b_cached_prefix_plus_suffix(variant, page_size):
    model_dir, ref = variant
    env = Env(model_dir, page_size)
    ids = random_ids(45, 2)
    cut = 21  # not page aligned: the suffix continues the prefix's last page
    prefix_slots = env.pages.extend([], cut)
    (p,) = env.run([(ids[:cut], 0, prefix_slots, True)])
    assert_close(p, ref(ids)[:cut])
    slots = env.pages.extend(prefix_slots, len(ids) - cut)
    (s,) = env.run([(ids[cut:], cut, slots, True)])
    assert_close(s, ref(ids)[cut:])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_c_token_by_token_decode(variant, page_size):
    model_dir, ref = variant
    env = Env(model_dir, page_size)
    ids = random_ids(40, 3)
    slots = env.pages.extend([], 4)
    (first,) = env.run([(ids[:4], 0, slots)])
    assert_close(first, ref(ids)[3:4])
    for pos in range(4, len(ids)):
        slots = env.pages.extend(slots, 1)
        (row,) = env.run([([ids[pos]], pos, slots)])
        assert_close(row, ref(ids)[pos : pos + 1])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_d_ragged_batch_sharing_prefix_slots(variant, page_size):
    model_dir, ref = variant
    env = Env(model_dir, page_size)
    shared = random_ids(32, 4)  # page aligned at 1 and 16
    shared_slots = env.pages.extend([], len(shared))
    (s,) = env.run([(shared, 0, shared_slots, True)])
    assert_close(s, ref(shared))
    # A request that has been running: its own prompt is cached, it now decodes one token.
    run_ids = random_ids(11, 5)
    run_slots = env.pages.extend([], 10)
    env.run([(run_ids[:10], 0, run_slots)])

    seqs = [shared + random_ids(9, 6), shared + random_ids(1, 7), shared + random_ids(23, 8), random_ids(13, 9), run_ids]
    reqs, starts = [], [32, 32, 32, 0, 10]
    for i, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
        base = shared_slots if start == 32 else (run_slots if i == 4 else [])
        slots = env.pages.extend(base, len(seq) - start)
        reqs.append(BatchRequest(seq[start:], start, slots, all_logits=i % 2 == 0))
    outs = env.run(reqs)
    for i, (seq, start, out) in enumerate(zip(seqs, starts, outs, strict=True)):
        want = ref(seq)[start:] if i % 2 == 0 else ref(seq)[-1:]
        assert_close(out, want)


def _decode_rest(env, ref, seqs, slot_lists, steps: int) -> None:
    """Decode the last `steps` tokens of every sequence, the whole batch per step, each
    into a new slot after its `slot_lists` entry; logits must match the reference."""
    for back in range(steps, 0, -1):
        reqs = []
        for k, seq in enumerate(seqs):
            pos = len(seq) - back
            slot_lists[k] = env.pages.extend(slot_lists[k], 1)
            reqs.append(([seq[pos]], pos, slot_lists[k]))
        for seq, out in zip(seqs, env.run(reqs), strict=True):
            pos = len(seq) - back
            assert_close(out, ref(seq)[pos : pos + 1])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_e_batched_decode_ragged_lengths(variant, page_size):
    model_dir, ref = variant
    env = Env(model_dir, page_size)
    seqs = [random_ids(n, 10 + n) for n in (5, 17, 30, 4)]
    slot_lists = []
    for seq in seqs:
        slots = env.pages.extend([], len(seq) - 3)
        env.run([(seq[:-3], 0, slots)])
        slot_lists.append(slots)
    _decode_rest(env, ref, seqs, slot_lists, 3)  # three decode steps of the whole batch


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("contiguous", [False, True], ids=["gathered", "slice"])
def test_f_batched_decode_sharing_a_cached_prompt(variant, page_size, contiguous):
    model_dir, ref = variant
    env = Env(model_dir, page_size)
    shared = random_ids(32, 12)  # page aligned at 1 and 16
    if contiguous:  # the prompt on consecutive slots: read as a view of the pool
        shared_slots = list(range(CAPACITY - 32, CAPACITY))
        env.pages.free = [p for p in env.pages.free if (p + 1) * page_size <= CAPACITY - 32]
    else:
        shared_slots = env.pages.extend([], len(shared))
    env.run([(shared, 0, shared_slots)])
    seqs = [shared + random_ids(n, 20 + n) for n in (3, 2, 7, 4)]
    slot_lists = []
    for seq in seqs:  # each request's own cached tokens after the prompt, then 2 decodes
        slots = env.pages.extend(shared_slots, len(seq) - 2 - len(shared))
        if len(slots) > len(shared):
            env.run([(seq[len(shared) : -2], len(shared), slots)])
        slot_lists.append(slots)
    _decode_rest(env, ref, seqs, slot_lists, 2)


def test_logits_are_editable_and_float32(variant):
    model_dir, _ = variant
    env = Env(model_dir, 1)
    (out,) = env.run([(random_ids(5, 11), 0, env.pages.extend([], 5))])
    assert out.dtype == torch.float32 and out.shape == (1, env.cfg.vocab_size)
    out[:, 0] = -float("inf")  # a sampler may mask in place


def test_sharded_checkpoint_loads_identically(tmp_path):
    whole = make_tiny_checkpoint(tmp_path, "qwen3", name="whole")
    sharded = make_tiny_checkpoint(tmp_path, "qwen3", name="sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    ids = random_ids(12, 12)
    outs = []
    for d in (whole, sharded):
        env = Env(d, 1)
        (o,) = env.run([(ids, 0, env.pages.extend([], len(ids)), True)])
        outs.append(o)
    assert torch.equal(outs[0], outs[1])


def test_kv_bytes_per_token(variant):
    model_dir, _ = variant
    c = ModelConfig.from_dir(model_dir)
    want = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert ModelRunner.kv_bytes_per_token(c, torch.float32) == want
    assert ModelRunner.kv_bytes_per_token(c, "bfloat16") == want // 2
