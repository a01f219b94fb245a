"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral) against HF transformers on
tiny random checkpoints (8 experts, 2 per token; float32 experts, atol 1e-4).

Scenarios per variant: a whole prompt (every position's logits: the rows grouped by
expert), token-by-token decode (one row: the selected experts one by one), a ragged batch
mixing prefills with and without a cached prefix and decodes, a prefill in pieces
(sliced.py), bfloat16 experts; the routing of each family as HF defines it; that a step
multiplies exactly the experts HF's router selects (each once per layer, however many rows
chose it) and no other, per op and in the fused C step (kernels/moe_step.c: the other
experts' blocks poisoned); int8 experts (quantized at load, routers dense) within the
kernel's tolerance of transformers on the dequantized weights, decoded in the fused step
and per op.
"""

from __future__ import annotations

import functools
import shutil

import numpy as np
import pytest
import torch
from radixlm.runtime.model import BatchRequest, ModelConfig
from radixlm.runtime.model import moe as moe_module
from radixlm.runtime.model.config import UnsupportedModelError
from radixlm.runtime.model.loader import quantize_state
from radixlm.runtime.model.moe import route
from radixlm.runtime.model.quant import QuantWeight
from radixlm.runtime.model.weights import load_state_dict
from safetensors.torch import save_file
from tiny_models import (
    MOE_VARIANTS,
    ModelEnv,
    assert_close,
    load_hf_model,
    make_tiny_checkpoint,
    random_ids,
    with_kernel_flags,
)

DECODE_ATOL = 5e-3  # the kernel's int16 activations (as test_model_quant_tiny.py)
CAPACITY = 1024


def Env(model_dir, page_size: int = 16, **kw) -> ModelEnv:  # noqa: N802 - makes a ModelEnv
    return ModelEnv(model_dir, page_size, capacity=CAPACITY, **kw)


@pytest.fixture(scope="module", params=sorted(MOE_VARIANTS))
def variant(request, tmp_path_factory):
    name = request.param
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp(name), name=name,
                                     **MOE_VARIANTS[name])  # fmt: skip
    hf = load_hf_model(model_dir)

    @functools.cache
    def logits_of(ids: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float()

    def ref(ids) -> torch.Tensor:
        return logits_of(tuple(int(i) for i in ids))

    return model_dir, ref, hf


def test_config_reads_each_familys_experts(variant):
    model_dir, _, hf = variant
    c = ModelConfig.from_dir(model_dir).moe
    h = hf.config
    assert c.num_experts == 8 and c.top_k == 2
    layers = hf.model.layers
    sparse = tuple(type(layer.mlp).__name__.endswith("SparseMoeBlock") or
                   hasattr(layer, "block_sparse_moe") for layer in layers)  # fmt: skip
    assert c.sparse_layers == sparse
    if h.model_type == "mixtral":
        assert (c.routing, c.intermediate_size) == ("topk_softmax", h.intermediate_size)
    else:
        assert (c.routing, c.norm_topk_prob) == ("softmax_topk", h.norm_topk_prob)
        assert c.intermediate_size == h.moe_intermediate_size
    assert c.shared_intermediate_size == getattr(h, "shared_expert_intermediate_size", 0)


def test_whole_prompt_and_token_by_token_decode(variant):
    model_dir, ref, _ = variant
    env = Env(model_dir)
    ids = random_ids(37, 1)
    (rows,) = env.run([BatchRequest(ids, 0, env.pages.extend([], len(ids)), all_logits=True)])
    assert_close(rows, ref(ids))
    slots = env.pages.extend([], 1)
    (first,) = env.run([(ids[:1], 0, slots)])
    assert_close(first, ref(ids)[:1])
    for pos in range(1, 20):
        slots = env.pages.extend(slots, 1)
        (row,) = env.run([([ids[pos]], pos, slots)])
        assert_close(row, ref(ids)[pos : pos + 1])


def test_a_ragged_batch_of_prefills_prefix_hits_and_decodes(variant):
    model_dir, ref, _ = variant
    env = Env(model_dir)
    shared = random_ids(32, 4)
    shared_slots = env.pages.extend([], len(shared))
    env.run([(shared, 0, shared_slots)])
    running = random_ids(11, 5)
    running_slots = env.pages.extend([], 10)
    env.run([(running[:10], 0, running_slots)])
    seqs = [shared + random_ids(9, 6), shared + random_ids(1, 7), random_ids(13, 9), running]
    starts = [32, 32, 0, 10]
    bases = [shared_slots, shared_slots, [], running_slots]
    reqs = [BatchRequest(seq[start:], start, env.pages.extend(base, len(seq) - start), all_logits=True)
            for seq, start, base in zip(seqs, starts, bases, strict=True)]  # fmt: skip
    for seq, start, out in zip(seqs, starts, env.run(reqs), strict=True):
        assert_close(out, ref(seq)[start:])


def test_a_prefill_in_pieces_equals_one_forward(variant):
    model_dir, _, _ = variant
    env = Env(model_dir, page_size=1)
    ids = random_ids(40, 13)
    (whole,) = env.run([BatchRequest(ids, 0, list(range(40)), all_logits=False)])
    task = env.runner.start_sliced(np.array(ids), np.arange(100, 140), 0, 40, 39, rows=8)
    logits = None
    while logits is None:
        logits = task.advance(0.0)
    assert task.pieces_run == 5 * len(env.runner.model.layers)
    assert_close(logits, whole)


def test_bfloat16_experts_track_float32(variant):
    model_dir, ref, _ = variant
    env = Env(model_dir, dtype="bfloat16")
    ids = random_ids(24, 14)
    (rows,) = env.run([BatchRequest(ids, 0, env.pages.extend([], len(ids)), all_logits=True)])
    want = ref(ids)
    assert rows.dtype == torch.float32
    # bfloat16's 8-bit mantissa: HF's own bfloat16 run is 0.8-1.3% of the logits' std off
    # float32 on average; a rounded router logit may pick another expert at a few rows
    err = (rows - want).abs().mean().item() / want.std().item()
    assert err < 0.03, err
    agree = (rows.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.85, agree


def test_int8_experts_match_transformers_on_the_dequantized_weights(variant, tmp_path, monkeypatch):
    """int8: every expert Q8_0 (one `QuantWeight` each), routers dense; transformers runs
    the same blocks dequantized (written as a checkpoint). A 250-row prefill (its rows
    grouped by expert, more than one kernel call's 64 rows for some) and decode steps
    multiply through the kernel, with int16 activations throughout (a prefill's int8 ones
    would flip some routings of these random models: their accuracy is measured, not
    exact, benchmarks/bench_quant_accuracy.py)."""
    from radixlm.runtime.model import quant

    monkeypatch.setattr(quant, "GEMM8_MIN_ROWS", 10**9)
    model_dir, _, _ = variant
    env = Env(model_dir, quantize="int8")
    moe = next(layer.moe for layer in env.runner.model.layers if layer.moe is not None)
    assert all(isinstance(w, QuantWeight) and w.packed for w in (*moe.gu, *moe.down))
    assert isinstance(moe.router_t, torch.Tensor)
    assert env.runner.fused is not None  # decode in the fused C step (Qwen2-MoE's shared expert too)
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(model_dir, ref_dir)
    state = quantize_state(load_state_dict(model_dir), "int8")
    save_file({n: w.dequantize() if isinstance(w, QuantWeight) else w for n, w in state.items()},
              str(ref_dir / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    ids = random_ids(250, 15)
    hf = load_hf_model(ref_dir)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    rows_per_expert = max(torch.bincount(c.flatten()).max().item()
                          for c in _hf_choices(hf, ids).values())  # fmt: skip
    assert rows_per_expert > 64
    (rows,) = env.run([BatchRequest(ids, 0, env.pages.extend([], len(ids)), all_logits=True)])
    assert_close(rows, want, DECODE_ATOL)
    for fused in (env.runner.fused, None):  # the fused step, then per op
        env.runner.fused = fused
        slots = env.pages.extend([], 1)
        (first,) = env.run([(ids[:1], 0, slots)])
        steps = [first]
        for pos in range(1, 30):
            slots = env.pages.extend(slots, 1)
            steps += env.run([([ids[pos]], pos, slots)])
        assert_close(torch.cat(steps), want[:30], DECODE_ATOL)


# ------------------------------------------------------------------ routing and reads


def _hf_router(family: str, top_k: int, normalize: bool):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if family == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=16, num_local_experts=8,
                                         num_experts_per_tok=top_k)  # fmt: skip
        return MixtralTopKRouter(cfg)
    cfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=top_k,
                                      norm_topk_prob=normalize)  # fmt: skip
    return Qwen3MoeTopKRouter(cfg)


@pytest.mark.parametrize(("family", "routing", "normalize"), [
    ("qwen3_moe", "softmax_topk", False), ("qwen3_moe", "softmax_topk", True),
    ("mixtral", "topk_softmax", True)])  # fmt: skip
def test_routing_is_each_familys(family, routing, normalize):
    """Qwen: softmax, top-k, renormalised when norm_topk_prob; Mixtral: softmax of the top-k."""
    router = _hf_router(family, 3, normalize)
    torch.nn.init.normal_(router.weight)
    logits, want_w, want_i = router(torch.randn(5, 16))
    got_w, got_i = route(logits, 3, routing, normalize)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w)


def _hf_choices(hf, ids: list[int]) -> dict[int, torch.Tensor]:
    """Per sparse layer, HF's router top-k expert indices of every position `[T, k]`."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    k = hf.config.num_experts_per_tok
    return {i: r.topk(k, dim=-1).indices for i, r in zip(sparse, out.router_logits, strict=True)}


def _record_products(model, monkeypatch) -> list[tuple[int, int]]:
    """(layer, expert) of every expert product the model runs from now on (gate+up and
    down each count; a stacked product counts each weight in it)."""
    owner = {}
    for i, layer in enumerate(model.layers):
        if layer.moe is not None:
            for e, (gu, down) in enumerate(zip(layer.moe.gu, layer.moe.down, strict=True)):
                owner[id(gu)] = owner[id(down)] = (i, e)
    seen: list[tuple[int, int]] = []
    matmul, stacked = QuantWeight.matmul, moe_module.matmul_stacked

    def counting(self, *args, **kwargs):
        if id(self) in owner:
            seen.append(owner[id(self)])
        return matmul(self, *args, **kwargs)

    def counting_stacked(x, weights):  # a one-row step's gate+up rows in one call
        seen.extend(owner[id(w)] for w in weights if id(w) in owner)
        return stacked(x, weights)

    monkeypatch.setattr(QuantWeight, "matmul", counting)
    monkeypatch.setattr(moe_module, "matmul_stacked", counting_stacked)
    return seen


def test_a_step_multiplies_only_the_selected_experts_once_each(tmp_path, monkeypatch):
    model_dir = make_tiny_checkpoint(tmp_path, name="qwen3_moe", **MOE_VARIANTS["qwen3_moe"])
    env = Env(model_dir, page_size=1, quantize="int8")
    hf = load_hf_model(model_dir)
    ids = random_ids(20, 16)
    choices = _hf_choices(hf, ids)
    seen = _record_products(env.runner.model, monkeypatch)
    env.run([(ids[:19], 0, list(range(19)))])  # a prefill: 19 rows, 38 (row, expert) pairs
    for layer, chosen in choices.items():
        experts = sorted(set(chosen[:19].flatten().tolist()))
        assert sorted(e for i, e in seen if i == layer) == sorted(experts * 2)  # once each
    assert {i for i, _ in seen} == set(choices)
    seen.clear()
    env.runner.fused = None  # the per-op step (the fused one: the next test)
    env.run([([ids[19]], 19, list(range(20)))])  # a decode step: top-2 of 8 per layer
    for layer, chosen in choices.items():
        assert sorted(e for i, e in seen if i == layer) == sorted(chosen[19].tolist() * 2)
    assert len(seen) == 2 * 2 * len(choices)
    total = sum(len(layer.moe.gu) for layer in env.runner.model.layers if layer.moe is not None)
    assert len({key for key in seen}) == 2 * len(choices) < total


@pytest.mark.parametrize(("family", "build"), [
    ("qwen3_moe", "native"), ("mixtral", "native"), ("qwen2_moe", "native"),
    ("qwen3_moe", "portable")])  # fmt: skip
def test_the_fused_step_reads_only_the_chosen_experts(tmp_path, monkeypatch, family, build):
    """The fused C step (kernels/moe_step.c) chooses the experts the per-op step chooses and
    reads no other: with every other expert's packed blocks overwritten by NaN scales, its
    logits are finite and those of the per-op step; on the native build and the plain-C one
    (RADIXLM_KERNEL=portable, the path of machines without AVX2)."""
    from radixlm.runtime.model import qkernel

    monkeypatch.setenv(qkernel.ENV_SWITCH, build)
    qkernel.kernel.cache_clear()
    try:
        assert build == "native" or qkernel.kernel().simd == 0
        _fused_reads_only_the_chosen(tmp_path, monkeypatch, family)
    finally:
        qkernel.kernel.cache_clear()  # (the next test loads the process's own build)


def _fused_reads_only_the_chosen(tmp_path, monkeypatch, family: str) -> None:
    model_dir = make_tiny_checkpoint(tmp_path, name=family, **MOE_VARIANTS[family])
    env = Env(model_dir, page_size=1, quantize="int8")
    fused = env.runner.fused
    assert fused is not None
    ids = random_ids(20, 17)
    env.run([(ids[:19], 0, list(range(19)))])
    seen = _record_products(env.runner.model, monkeypatch)
    env.runner.fused = None
    (want,) = env.run([([ids[19]], 19, list(range(20)))])
    assert seen
    for i, layer in enumerate(env.runner.model.layers):
        if layer.moe is None:
            continue
        for e, (gu, down) in enumerate(zip(layer.moe.gu, layer.moe.down, strict=True)):
            if (i, e) not in seen:
                with torch.inference_mode():  # (the packed tiles are inference tensors)
                    gu.tiles.fill_(0xFF)  # every fp16 scale 0xFFFF: NaN
                    down.tiles.fill_(0xFF)
    env.runner.fused = fused
    (got,) = env.run([([ids[19]], 19, list(range(20)))])  # the same step, the same slots
    assert torch.isfinite(got).all()
    assert_close(got, want, DECODE_ATOL)  # (its attention and activations as the kernel rounds them)


LENS = (40, 7, 90)  # three requests' prompts, in slots 0.., 200.., 400..


def _prefill(env: ModelEnv, prompts: list[list[int]]) -> None:
    env.run([(p, 0, list(range(200 * r, 200 * r + len(p)))) for r, p in enumerate(prompts)])


def _decode(env: ModelEnv, prompts: list[list[int]], rows: list[int], step: int) -> list[torch.Tensor]:
    """Decode step `step` (its tokens and positions after the prompts) of the requests `rows`."""
    return env.run([([5 + step], len(prompts[r]) + step,
                     list(range(200 * r, 200 * r + len(prompts[r]) + step + 1))) for r in rows])  # fmt: skip


def _fused_moe_steps(model_dir, threads: int) -> list[torch.Tensor]:
    """Logits of 12 fused decode steps after three prompts, alternately of the first request
    alone (decode_layers) and of all three (decode_rows), on `threads` threads."""
    env = Env(model_dir, page_size=1, quantize="int8")
    assert env.runner.fused is not None
    prompts = [random_ids(n, 19 + n) for n in LENS]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _prefill(env, prompts)
        return [torch.cat(_decode(env, prompts, [0] if s % 2 else [0, 1, 2], s)) for s in range(12)]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_fused_moe_rows_match_the_per_op_path_and_each_row_alone(tmp_path, family):
    """Three decode rows in one fused call (decode_rows: each expert's rows multiplied
    together) give each row what moe.py's grouped per-op step gives it, and what the fused
    one-request step gives it alone."""
    model_dir = make_tiny_checkpoint(tmp_path, name=family, **MOE_VARIANTS[family])
    env = Env(model_dir, page_size=1, quantize="int8")
    fused = env.runner.fused
    assert fused is not None
    prompts = [random_ids(n, 23 + n) for n in LENS]
    _prefill(env, prompts)
    together = torch.cat(_decode(env, prompts, [0, 1, 2], 0))
    env.runner.fused = None
    per_op = torch.cat(_decode(env, prompts, [0, 1, 2], 0))
    env.runner.fused = fused
    alone = torch.cat([_decode(env, prompts, [r], 0)[0] for r in range(3)])
    assert_close(together, per_op, DECODE_ATOL)
    assert_close(together, alone, 2e-3)  # (float sums in another order; as test_quant_tiny's rows)


def test_fused_moe_steps_are_the_same_on_any_thread_count_and_with_stealing(tmp_path, monkeypatch):
    """Every output value of the step's products is one thread's whole sum (the gate+up
    claims; the down claims add every chosen expert of their columns in order), so the
    logits of one row and of three are bit-identical on 1, 2 and 3 threads, and with a
    kernel that claims one chunk of rows at a time (-DCLAIM_BYTES=1: the threads steal each
    other's claims on every product) and shares the rows' choices out (-DCHOOSE_ALONE=0)."""
    model_dir = make_tiny_checkpoint(tmp_path, name="qwen3_moe", **MOE_VARIANTS["qwen3_moe"])
    one = _fused_moe_steps(model_dir, 1)
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(one, _fused_moe_steps(model_dir, threads), strict=True))
    stolen = with_kernel_flags(monkeypatch, ("-DCLAIM_BYTES=1", "-DCHOOSE_ALONE=0"),
                               lambda: _fused_moe_steps(model_dir, 3), tmp_path / "cache")  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(one, stolen, strict=True))


def test_bytes_read_per_step_count_only_the_active_experts(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, name="mixtral", **MOE_VARIANTS["mixtral"])
    c = ModelConfig.from_dir(model_dir)
    model = Env(model_dir).runner.model
    h, e, k, w = c.hidden_size, c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size
    attn = h * c.q_size * 2 + h * c.kv_size * 2 + 2 * h  # q, o, k, v, the norms
    per_layer = attn + h * e + k * 3 * h * w  # the router and k experts
    assert model.weight_bytes() == 4 * (c.num_layers * per_layer + h * c.vocab_size + h)
    every = c.num_layers * (attn + h * e + e * 3 * h * w) + 2 * h * c.vocab_size + h
    assert model.resident_bytes() == 4 * every


def test_bad_expert_settings_are_refused(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, name="mixtral", **MOE_VARIANTS["mixtral"])
    base = ModelConfig.from_dir(model_dir).hf_config
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9 must be in 1..8"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 9})
    with pytest.raises(UnsupportedModelError, match="mixtral experts"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "num_local_experts"})
    qwen = {**base, "model_type": "qwen2_moe", "moe_intermediate_size": 32, "num_experts": 8}
    with pytest.raises(UnsupportedModelError, match="shared_expert_intermediate_size"):
        ModelConfig.from_hf(qwen)


def test_the_dense_weight_estimate_counts_every_expert(variant):
    """The KV pool's pre-load estimate (tensor parallelism sizes the pool with it) is the
    checkpoint's parameter bytes."""
    from radixlm.runtime.engine.pool_size import weight_bytes

    model_dir, _, hf = variant
    c = ModelConfig.from_dir(model_dir)
    params = sum(p.numel() for n, p in hf.named_parameters()
                 if "norm" not in n and not n.endswith("bias"))  # (the estimate has no biases)
    norms = 2 * c.num_layers * c.hidden_size  # the estimate's norms: input and post-attention
    assert weight_bytes(c, torch.float32) == 4 * (params + norms)


def test_the_scheduler_runs_prefills_beside_decodes(variant):
    """Engine level, in process (the scheduler over the cache, invariants checked every
    step): a request decoding while two more arrive, their prompts in chunks of 16 tokens
    beside its decode rows; then one that hits a cached prompt. Greedy tokens as HF's."""
    from scheduler_harness import Harness, hf_greedy

    model_dir, _, hf = variant
    h = Harness(model_dir, page_size=4, chunked_prefill=16, capacity=1024)
    first = random_ids(20, 30)
    a = h.generate(first, max_tokens=12)
    for _ in range(4):
        h.step()
    assert h.tokens[(a, 0)] and (a, 0) not in h.final  # decoding now
    later = [random_ids(37, 31), random_ids(9, 32)]
    keys = [h.generate(p, max_tokens=6) for p in later]
    h.run()
    assert h.output(a) == hf_greedy(hf, first, 12)
    for p, k in zip(later, keys, strict=True):
        assert h.output(k) == hf_greedy(hf, p, 6)
    again = h.generate(later[0] + [5, 6], max_tokens=4)
    h.run()
    assert h.final[(again, 0)].usage.cached_tokens >= len(later[0]) - 4
    assert h.output(again) == hf_greedy(hf, later[0] + [5, 6], 4)
    h.check_quiescent()
