"""Quantized weights (`--quantize int8|int4`) on tiny random checkpoints, two ways:

1. Exactness of the quantized path: transformers run on the *dequantized* blocks (read
   back by gguf-py, so the block format is GGML's) against our quantized runner. Decode
   (the fused one-call step, Qwen3's q/k norms included, alone and batched with another
   request) and a short prefill multiply activations held
   as one int16 per value per block (the kernel's arithmetic is checked exactly in
   model/test_quant_kernel.py): within DECODE_ATOL of the same transformers run. A long
   prefill (from GEMM8_MIN_ROWS rows) multiplies int8 activations: within PREFILL8_TOL of
   the logits' spread (its accuracy on a real model is benchmarks/bench_quant_accuracy.py's
   measure).
2. Accuracy cost against the float32 checkpoint (transformers, original weights), with the
   documented bounds below. Random tiny models are a harsh case (near-flat logits, 64-wide
   blocks of Gaussian weights), so the int4 bounds are loose; SmolLM2's are in
   test_model_quant_smollm2.py.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from radixlm.cache import KVPool
from radixlm.runtime import cli
from radixlm.runtime.engine.engine_main import build_engine
from radixlm.runtime.model import BatchRequest, ForwardBatch, ModelConfig, ModelRunner
from radixlm.runtime.model.loader import quantize_state
from radixlm.runtime.model.quant import QuantWeight
from radixlm.runtime.model.weights import load_state_dict
from tiny_models import TINY_VARIANTS, load_hf_model, make_tiny_checkpoint, with_kernel_flags

DECODE_ATOL = 5e-3  # decode's int16 activations (measured up to 1.1e-3 here)
PROMPT = 80  # >= GEMM8_MIN_ROWS: the prompt takes the int8 path
SHORT = 40  # < GEMM8_MIN_ROWS: a prompt of this many rows takes the int16 path
# int8 activations (per block of 32, max|x| / 254 a value at worst): max |logit error| /
# std of the reference logits at the position, over the 80 positions. Measured 0.07-0.14
# on these random tiny models (weights 5x HF's init: spiky activations).
PREFILL8_TOL = 0.25
# Documented accuracy bounds on the tiny random models: top-1 agreement with float32 over
# all prompt positions, and max |logit error| / std of the float32 logits of the position.
BOUNDS = {"int8": (0.85, 0.25), "int4": (0.45, 2.5)}


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def variant(request, tmp_path_factory):
    name = request.param
    return make_tiny_checkpoint(tmp_path_factory.mktemp(name), name=name, **TINY_VARIANTS[name])


@pytest.fixture(scope="module")
def runs() -> dict:
    """`_ours` results by (model dir, format), computed once per module."""
    return {}


def _cached(runs: dict, model_dir, fmt: str):
    if (model_dir, fmt) not in runs:
        runs[(model_dir, fmt)] = _ours(model_dir, fmt)
    return runs[(model_dir, fmt)]


def _ids() -> list[int]:
    return torch.randint(3, 400, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()


def _ours(model_dir, fmt: str) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, ModelRunner]:
    """((prefill logits of every position, of a short prefill), decode logits token by
    token, runner)."""
    c = ModelConfig.from_dir(model_dir)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 4 * PROMPT, 1, torch.float32, "cpu")
    runner = ModelRunner(model_dir, "cpu", "float32", pool, attention="torch", quantize=fmt)
    ids = _ids()
    short = runner.forward(ForwardBatch.build([BatchRequest(ids[:SHORT], 0, list(range(SHORT)), True)]))
    pre = runner.forward(ForwardBatch.build([BatchRequest(ids, 0, list(range(PROMPT)), True)]))
    # decode into other slots, so it reads only what it wrote itself: one request at a time
    # (the fused one-call step where the model allows it) ...
    slots = list(range(PROMPT, 2 * PROMPT))
    dec = torch.cat(
        [runner.forward(ForwardBatch.build([([t], i, slots[: i + 1])])) for i, t in enumerate(ids)]
    )
    # ... and batched with a second request (the batched one-call step, or per op for q/k
    # norms), whose first row is compared
    other = list(range(2 * PROMPT, 3 * PROMPT))
    dec2 = torch.cat([
        runner.forward(ForwardBatch.build([([t], i, other[: i + 1]), ([t], 0, [3 * PROMPT + i])]))[:1]
        for i, t in enumerate(ids)
    ])  # fmt: skip
    return (pre, short), torch.stack([dec, dec2]), runner


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([_ids()])).logits[0].float()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_matches_transformers_on_dequantized_weights(variant, runs, fmt):
    (pre, short), dec, runner = _cached(runs, variant, fmt)
    assert runner.model.weight_format == ("Q8_0" if fmt == "int8" else "Q4_1+Q8_0")
    hf = load_hf_model(variant)
    state = quantize_state(load_state_dict(variant), fmt)
    fake = {}
    for name, w in state.items():
        if isinstance(w, QuantWeight):
            deq = gguf.quants.dequantize(w.blocks.numpy(), gguf.GGMLQuantizationType(w.qtype))
            w = torch.from_numpy(np.asarray(deq, dtype=np.float32).reshape(w.rows, w.cols))
        fake[name] = w
    missing, unexpected = hf.load_state_dict(fake, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    ref = _hf_logits(hf)
    torch.testing.assert_close(short, ref[:SHORT], atol=DECODE_ATOL, rtol=0)  # int16 rows
    assert ((pre - ref).abs().amax(-1) / ref.std(-1)).max().item() <= PREFILL8_TOL  # int8 rows
    torch.testing.assert_close(dec[0], ref, atol=DECODE_ATOL, rtol=0)  # batch 1
    torch.testing.assert_close(dec[1], ref, atol=DECODE_ATOL, rtol=0)  # batch 2 (decode_rows)
    assert runner.fused is not None  # every variant decodes in the fused step (q/k norms too)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_accuracy_cost_within_bounds(variant, runs, fmt):
    (pre, _), _, _ = _cached(runs, variant, fmt)
    ref = _hf_logits(load_hf_model(variant))
    top1 = (pre.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = ((pre - ref).abs().amax(-1) / ref.std(-1)).max().item()
    min_top1, max_err = BOUNDS[fmt]
    assert top1 >= min_top1, (fmt, top1)
    assert err <= max_err, (fmt, err)
    if fmt == "int8":  # int8 strictly closer than int4 on the same model
        (pre4, _), _, _ = _cached(runs, variant, "int4")
        assert (pre - ref).abs().mean() < (pre4 - ref).abs().mean()


def test_bad_weight_options_are_refused(variant):
    c = ModelConfig.from_dir(variant)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 16, 1, torch.float32, "cpu")
    with pytest.raises(ValueError, match="not a converted GGUF"):
        ModelRunner(variant, "cpu", "gguf", pool, attention="torch")
    with pytest.raises(ValueError, match="unknown quantization"):
        ModelRunner(variant, "cpu", "float32", pool, attention="torch", quantize="int3")
    with pytest.raises(ValueError, match="disagree"):
        ModelRunner(variant, "cpu", "int8", pool, attention="torch", quantize="int4")
    with pytest.raises(ValueError, match="compute in float32"):
        ModelRunner(variant, "cpu", "bfloat16", pool, attention="torch", quantize="int8")
    with pytest.raises(ValueError, match="CPU only"):
        ModelRunner(variant, "cuda", "float32", pool, attention="torch", quantize="int8")


@pytest.mark.parametrize(
    "flags,expected",
    [(["--quantize", "int4"], "Q4_1+Q8_0"), (["--dtype", "int8"], "Q8_0"), ([], "float32")],
)
def test_serve_flags_reach_the_runner(tmp_path, flags, expected):
    variant = make_tiny_checkpoint(tmp_path, name="qwen3", **TINY_VARIANTS["qwen3"])
    args = cli.build_parser().parse_args(["serve", "--device", "cpu", "--kv-tokens", "1024", *flags])
    engine = build_engine(cli.config_from_args(args), model_dir=variant)
    assert engine.runner.model.weight_format == expected
    # the pool's default: float16 rows under quantized weights, float32 under dense ones
    want = torch.float32 if expected == "float32" else torch.float16
    assert engine.runner.pool.k[0].dtype == want


def test_bad_quantize_flag_is_refused():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--quantize", "int3"])


def test_batched_decode_rows_match_each_row_alone(variant):
    """`decode_rows` (several decode rows in one kernel call; contexts of different
    lengths, across attention chunks, one row without logits) gives each row the logits
    the one-request step gives it, and writes the same K/V."""
    c = ModelConfig.from_dir(variant)
    lens = [10, 70, 130]
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 2 * sum(lens) + 8, 1, torch.float32,
                  "cpu")  # fmt: skip
    runner = ModelRunner(variant, "cpu", "float32", pool, attention="torch", quantize="int4")
    assert runner.fused is not None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]
    bases = [0, sum(lens[:1]) + 1, sum(lens[:2]) + 2]

    def prefill_all() -> None:
        runner.forward(ForwardBatch.build([
            BatchRequest(p, 0, list(range(b, b + len(p)))) for p, b in zip(prompts, bases, strict=True)
        ]))  # fmt: skip

    def step(rows: list[int], logits_of: list[int]) -> ForwardBatch:
        reqs = [BatchRequest([7 + r], lens[r], list(range(bases[r], bases[r] + lens[r] + 1)))
                for r in rows]  # fmt: skip
        batch = ForwardBatch.build(reqs)
        batch.logits_indices = torch.tensor(logits_of)
        return batch

    prefill_all()
    together = runner.forward(step([0, 1, 2], [0, 2]))  # row 1: K/V only (a tail row)
    kv_together = [pool.k[0][bases[r] + lens[r]].clone() for r in range(3)]
    alone = []
    for r in range(3):
        prefill_all()
        alone.append(runner.forward(step([r], [0]))[0])
        assert torch.allclose(pool.k[0][bases[r] + lens[r]], kv_together[r], atol=1e-5)
    # (float sums in another order, amplified by these random models: measured <= 5e-4)
    torch.testing.assert_close(together, torch.stack([alone[0], alone[2]]), atol=2e-3, rtol=0)


@pytest.mark.parametrize("context", [40, 255, 257, 600])
def test_fused_step_attention_alone_and_split_matches_the_per_op_path(tmp_path, context):
    """The one-request step computes short contexts' attention whole in every thread and
    splits longer ones by (KV head, chunk) across threads (ATT_ALONE_MAX = 256): either
    way the logits are the per-op path's (torch attention over the same pool)."""
    model = make_tiny_checkpoint(tmp_path, "llama", seed=4, max_position_embeddings=1024)
    c = ModelConfig.from_dir(model)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, context + 8, 1, torch.float32, "cpu")
    runner = ModelRunner(model, "cpu", "float32", pool, attention="torch", quantize="int8")
    assert runner.fused is not None
    ids = torch.randint(3, 400, (context,), generator=torch.Generator().manual_seed(5)).tolist()
    runner.forward(ForwardBatch.build([BatchRequest(ids, 0, list(range(context)))]))
    step = ForwardBatch.build([BatchRequest([9], context, list(range(context + 1)))])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fused = runner.forward(step)
        kv = pool.k[1][context].clone()
        fused_layer, runner.fused = runner.fused, None
        per_op = runner.forward(step)
        runner.fused = fused_layer
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(pool.k[1][context], kv, atol=1e-3, rtol=0)  # layer 1: after a layer
    torch.testing.assert_close(fused, per_op, atol=2e-3, rtol=0)


def _fused_steps_by_threads(tmp_path, thread_counts) -> dict[int, list[torch.Tensor]]:
    """Logits of 20 fused steps (alternately one row and three rows) of one int4 tiny
    llama, for each thread count, from the same prompts."""
    model = make_tiny_checkpoint(tmp_path, "llama", seed=6, max_position_embeddings=1024)
    c = ModelConfig.from_dir(model)
    lens = [30, 300, 90]
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, sum(lens) + 8, 1, torch.float32, "cpu")
    runner = ModelRunner(model, "cpu", "float32", pool, attention="torch", quantize="int4")
    assert runner.fused is not None
    g = torch.Generator().manual_seed(8)
    bases = [0, lens[0] + 1, lens[0] + lens[1] + 2]
    for n, b in zip(lens, bases, strict=True):
        ids = torch.randint(3, 400, (n,), generator=g).tolist()
        runner.forward(ForwardBatch.build([BatchRequest(ids, 0, list(range(b, b + n)))]))

    def steps() -> list[torch.Tensor]:
        out = []
        for s in range(20):
            rows = [s % 3] if s % 2 else [0, 1, 2]  # alternately one row and all three
            out.append(runner.forward(ForwardBatch.build([
                BatchRequest([5 + s], lens[r], list(range(bases[r], bases[r] + lens[r] + 1)))
                for r in rows
            ])))  # fmt: skip
        return out

    before = torch.get_num_threads()
    try:
        results = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            results[threads] = steps()
    finally:
        torch.set_num_threads(before)
    return results


def test_fused_steps_are_identical_for_any_thread_count(tmp_path):
    """Each output of the fused steps is computed by one thread in a fixed order, so the
    logits are bit-identical for 1, 2 and 5 threads; 5 on this 2-core machine pre-empts
    threads at the kernel's spin-then-sleep barriers (`team_wait`), whose sleeping path a
    race would show up in. One-row (short and split attention) and batched steps, 20 each."""
    results = _fused_steps_by_threads(tmp_path, (1, 2, 5))
    for threads in (2, 5):
        for a, b in zip(results[1], results[threads], strict=True):
            assert torch.equal(a, b), f"{threads} threads differ from 1"


def test_stolen_product_rows_are_computed_once(tmp_path, monkeypatch):
    """The fused steps share a product's rows out by claims, and a thread done with its
    own takes the others' (decode.c, `par_product`). A kernel built with one chunk of rows
    a claim (-DCLAIM_BYTES=1; the default claims cover a tiny model's whole product) steals
    on every product with 3 and 5 threads on 2 cores: a row computed twice would add the
    residual products (o, down) twice, one skipped would leave it out. Logits bit-identical
    to the default kernel's on one thread."""
    reference = _fused_steps_by_threads(tmp_path / "ref", (1,))[1]
    results = with_kernel_flags(monkeypatch, ("-DCLAIM_BYTES=1",),
                                lambda: _fused_steps_by_threads(tmp_path / "claims", (2, 3, 5)),
                                tmp_path / "cache")  # fmt: skip
    for threads, steps in results.items():
        for a, b in zip(reference, steps, strict=True):
            assert torch.equal(a, b), f"{threads} threads with one-chunk claims differ"


def test_fused_step_with_the_head_folded_in_gives_compute_logits(tmp_path):
    """One request's step ends with the final norm and the quantized LM head in the same
    kernel call: its logits are `compute_logits` of the step's hidden state, per op."""
    model = make_tiny_checkpoint(tmp_path, "llama", seed=9, max_position_embeddings=256)
    c = ModelConfig.from_dir(model)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 48, 1, torch.float32, "cpu")
    runner = ModelRunner(model, "cpu", "float32", pool, attention="torch", quantize="int8")
    assert runner.fused is not None and runner.fused.head is not None
    ids = list(range(3, 33))
    runner.forward(ForwardBatch.build([BatchRequest(ids, 0, list(range(30)))]))
    step = ForwardBatch.build([BatchRequest([9], 30, list(range(31)))])
    folded = runner.forward(step)  # the step's own path: the head in the kernel call
    with torch.no_grad():
        per_op = runner.model.compute_logits(runner.fused.forward_hidden(step))
    assert folded.shape == (1, c.vocab_size)
    torch.testing.assert_close(folded, per_op, atol=1e-4, rtol=1e-4)
    assert folded.argmax().item() == per_op.argmax().item()
