"""KV pools of float16 / bfloat16 rows under a float32 model (`--kv-dtype`), on CPU.

Reference: the same model over a float32 pool. Prefill attends to its own new K/V (never
rounded), so its logits are identical; decode reads rounded rows, so its logits move by
about the rounding (float16: 2^-11 relative, bfloat16: 2^-8) amplified by these random
models, bounded below; greedy tokens stay those of the float32 pool for float16 (checked
over 24 steps). Both decode paths read the rows alike: the fused one-call step (C kernel,
quantized weights) and the per-op path (torch attention backend) give the same logits
over the same 16-bit pool, and write the same rounded K/V.
"""

from __future__ import annotations

import pytest
import torch
from radixlm.cache import KVPool
from radixlm.runtime import cli
from radixlm.runtime.engine.engine_main import build_engine
from radixlm.runtime.model import BatchRequest, ForwardBatch, ModelConfig, ModelRunner
from radixlm.runtime.model.runner import resolve_kv_dtype
from tiny_models import make_tiny_checkpoint

PROMPT, STEPS = 40, 24
DECODE_ATOL = {torch.float16: 2e-2, torch.bfloat16: 1.5e-1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kv"), "llama", seed=2,
                                max_position_embeddings=512)  # fmt: skip


def _runner(model_dir, kv_dtype: torch.dtype, quantize: str | None) -> ModelRunner:
    c = ModelConfig.from_dir(model_dir)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 2 * (PROMPT + STEPS), 1, kv_dtype)
    return ModelRunner(model_dir, "cpu", "float32", pool, attention="torch", quantize=quantize)


def _greedy(runner: ModelRunner, forced: list[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Prefill logits, decode logits and greedy tokens; with `forced`, those tokens are fed
    instead of the runner's own choices (so two runs decode the same sequence)."""
    ids = torch.randint(3, 400, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    slots = list(range(PROMPT + STEPS))
    pre = runner.forward(ForwardBatch.build([BatchRequest(ids, 0, slots[:PROMPT], True)]))
    toks, steps = [int(pre[-1].argmax())], []
    for s in range(STEPS):
        feed = forced[s] if forced is not None else toks[-1]
        logits = runner.forward(ForwardBatch.build([([feed], PROMPT + s, slots[: PROMPT + s + 1])]))
        steps.append(logits[0])
        toks.append(int(logits[0].argmax()))
    return pre, torch.stack(steps), toks


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16])
def test_16_bit_pool_against_float32_pool(model_dir, quantize, kv):
    ref_pre, ref_dec, ref_toks = _greedy(_runner(model_dir, torch.float32, quantize))
    runner = _runner(model_dir, kv, quantize)
    assert (runner.fused is not None) == (quantize is not None)
    pre, dec, _ = _greedy(runner, forced=ref_toks)
    assert torch.equal(pre, ref_pre)  # prefill attends to its own exact K/V
    torch.testing.assert_close(dec, ref_dec, atol=DECODE_ATOL[kv], rtol=0)
    assert not torch.equal(dec, ref_dec)  # the pool really holds rounded rows
    if kv == torch.float16:  # its own greedy choices are the float32 pool's
        assert _greedy(_runner(model_dir, kv, quantize))[2] == ref_toks


@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16])
def test_fused_and_per_op_decode_read_16_bit_rows_alike(model_dir, kv):
    runner = _runner(model_dir, kv, "int4")
    assert runner.fused is not None
    ids = torch.randint(3, 400, (PROMPT,), generator=torch.Generator().manual_seed(4)).tolist()
    slots = list(range(PROMPT + 2))
    runner.forward(ForwardBatch.build([BatchRequest(ids, 0, slots[:PROMPT])]))
    step = ForwardBatch.build([([7], PROMPT, slots[: PROMPT + 1])])
    two = ForwardBatch.build([([7], PROMPT, slots[: PROMPT + 1]), ([9], 0, [PROMPT + 1])])
    fused, fused2 = runner.forward(step), runner.forward(two)
    k_fused = runner.pool.k[1][PROMPT].clone()
    fused_step, runner.fused = runner.fused, None
    per_op, per_op2 = runner.forward(step), runner.forward(two)
    runner.fused = fused_step
    # the same K written, rounded alike (the layers' float sums differ in order only)
    assert runner.pool.k[1][PROMPT].dtype == kv
    torch.testing.assert_close(runner.pool.k[1][PROMPT].float(), k_fused.float(), atol=1e-2, rtol=0)
    torch.testing.assert_close(fused, per_op, atol=2e-3, rtol=0)
    torch.testing.assert_close(fused2, per_op2, atol=2e-3, rtol=0)


def test_kv_dtype_choice():
    f32, bf16 = torch.float32, torch.bfloat16
    assert resolve_kv_dtype("auto", "cpu", f32, quantized=True) == torch.float16
    assert resolve_kv_dtype("auto", "cpu", f32, quantized=False) == f32  # dense stays exact
    assert resolve_kv_dtype("auto", "cuda", bf16, quantized=False) == bf16
    assert resolve_kv_dtype("bfloat16", "cpu", f32, quantized=True) == bf16
    assert resolve_kv_dtype(torch.float16, "cpu", f32, quantized=False) == torch.float16
    with pytest.raises(ValueError, match="unknown KV dtype"):
        resolve_kv_dtype("int8", "cpu", f32, quantized=True)
    with pytest.raises(ValueError, match="only CPU pools"):
        resolve_kv_dtype("float16", "cuda", bf16, quantized=False)


def test_pool_dtype_must_suit_the_device(model_dir):
    c = ModelConfig.from_dir(model_dir)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 16, 1, torch.float64)
    with pytest.raises(ValueError, match="KV pool dtype"):
        ModelRunner(model_dir, "cpu", "float32", pool, attention="torch")


@pytest.mark.parametrize("flags,expected", [
    (["--quantize", "int4"], torch.float16),
    (["--quantize", "int4", "--kv-dtype", "bfloat16"], torch.bfloat16),
    ([], torch.float32),
    (["--kv-dtype", "float16"], torch.float16),
])  # fmt: skip
def test_serve_flag_reaches_the_pool(model_dir, flags, expected):
    args = cli.build_parser().parse_args(["serve", "--device", "cpu", "--kv-tokens", "256", *flags])
    engine = build_engine(cli.config_from_args(args), model_dir=model_dir)
    assert engine.runner.pool.k[0].dtype == expected


def test_bad_kv_dtype_flag_is_refused():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--kv-dtype", "int8"])
