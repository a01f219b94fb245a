"""Tensor parallelism of mixture-of-experts models (CPU, gloo, tiny random checkpoints).

Each rank holds every expert cut by its intermediate width, the router replicated, and one
all-reduce sums the experts' partial outputs (runtime/distributed/shard.py, linear.py).
References: the same checkpoint at TP=1 (logits of a ragged batch, then decode steps, within
float32 tolerance) and HF transformers' greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from radixlm.runtime.distributed import TensorParallel, TensorParallelConfigError, check_tp_size
from radixlm.runtime.distributed.shard import shard_slices
from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner
from test_model_moe_gguf import runner_greedy
from test_tensor_parallel import _pool, hf_greedy, tp2  # noqa: F401 - tp2: a fixture
from tiny_models import MOE_VARIANTS, load_hf_model, make_tiny_checkpoint

LOGIT_TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral"])
def variant_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2-MoE (experts, a shared expert behind its gate, q/k/v biases) and Mixtral;
    test_tensor_parallel's `tp2` runs it over 2 ranks."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp-moe"), name=request.param,
                                **MOE_VARIANTS[request.param])  # fmt: skip


def _runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, "cpu", torch.float32, _pool(model_dir), attention="torch")


def test_each_rank_holds_a_slice_of_every_expert(tp2: TensorParallel, variant_dir: Path) -> None:  # noqa: F811
    full = ModelConfig.from_dir(variant_dir)
    local = tp2.runner.config
    assert local.moe.intermediate_size == full.moe.intermediate_size // 2
    assert local.moe.shared_intermediate_size == full.moe.shared_intermediate_size // 2
    moe = tp2.runner.model.layers[0].moe
    assert len(moe.gu) == full.moe.num_experts
    width = full.moe.intermediate_size // 2
    assert tuple(moe.gu[0].shape) == (full.hidden_size, 2 * width)  # [in, out] operand
    assert tuple(moe.router_t.shape) == (full.hidden_size, full.moe.num_experts)  # whole


def test_tp2_logits_match_tp1(tp2: TensorParallel, variant_dir: Path) -> None:  # noqa: F811
    """A ragged step (a prompt's rows go to many experts, grouped), then decode steps."""
    ref = _runner(variant_dir)
    a, b = list(range(5, 30)), list(range(40, 49))
    steps = [
        [(a, None, range(0, 25), True), (b, None, range(100, 109))],
        [([7], None, range(0, 26)), ([9], None, [*range(100, 109), 200])],
        [([11], None, range(0, 27))],
    ]
    for requests in steps:
        want = ref.forward(ForwardBatch.build(requests))
        got = tp2.runner.forward(ForwardBatch.build(requests))
        torch.testing.assert_close(got, want, atol=LOGIT_TOL, rtol=0)


def test_tp2_greedy_tokens_equal_tp1_and_transformers(tp2: TensorParallel, variant_dir: Path) -> None:  # noqa: F811
    prompt = [1, 17, 42, 99, 5, 250, 31, 7]
    n = 10
    want = hf_greedy(load_hf_model(variant_dir), prompt, n)
    for runner in (_runner(variant_dir), tp2.runner):
        assert runner_greedy(runner, prompt, n) == want


def test_expert_widths_that_do_not_divide_are_refused(variant_dir: Path) -> None:
    cfg = ModelConfig.from_dir(variant_dir)
    check_tp_size(cfg, 2)
    width = "moe_intermediate_size=32" if cfg.model_type == "qwen2_moe" else "intermediate_size=96"
    with pytest.raises(TensorParallelConfigError, match=f"does not divide .*{width}"):
        check_tp_size(cfg, 64)


def test_expert_slices_follow_the_experts_width(variant_dir: Path) -> None:
    cfg = ModelConfig.from_dir(variant_dir)
    width = cfg.moe.intermediate_size // 2
    block, (gate, up, down) = ("mlp", ("gate_proj", "up_proj", "down_proj")) \
        if cfg.model_type == "qwen2_moe" else ("block_sparse_moe", ("w1", "w3", "w2"))
    p = f"model.layers.0.{block}."
    assert shard_slices(p + f"experts.3.{gate}.weight", cfg, 1, 2) == (0, width, width)
    assert shard_slices(p + f"experts.3.{up}.weight", cfg, 1, 2) == (0, width, width)
    assert shard_slices(p + f"experts.3.{down}.weight", cfg, 1, 2) == (1, width, width)
    assert shard_slices(p + "gate.weight", cfg, 1, 2) == (-1, 0, 0)  # the router: whole
    if cfg.model_type == "qwen2_moe":
        shared = cfg.moe.shared_intermediate_size // 2
        assert shard_slices(p + "shared_expert.up_proj.weight", cfg, 1, 2) == (0, shared, shared)
        assert shard_slices(p + "shared_expert.down_proj.weight", cfg, 0, 2) == (1, 0, shared)
        assert shard_slices(p + "shared_expert_gate.weight", cfg, 1, 2) == (-1, 0, 0)
