"""How tensor parallelism cuts a mixture-of-experts checkpoint (shard.py, load.py), read
in process; TP=2 against TP=1 and transformers runs in test_tensor_parallel.py (its
variants include Qwen2-MoE and Mixtral).

Each rank holds every expert cut by its intermediate width (gate/up rows, down columns,
the shared expert alike) and the whole router; a width the ranks do not divide is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from radixlm.runtime.distributed import TensorParallelConfigError, check_tp_size
from radixlm.runtime.distributed.load import load_shard
from radixlm.runtime.distributed.shard import shard_slices
from radixlm.runtime.model import ModelConfig
from radixlm.runtime.model.weights import load_state_dict
from tiny_models import MOE_VARIANTS, make_tiny_checkpoint


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp-moe"), name=request.param,
                                **MOE_VARIANTS[request.param])  # fmt: skip


def _names(model_type: str) -> tuple[str, tuple[str, str, str]]:
    if model_type == "mixtral":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def test_rank_1_of_2_holds_its_slice_of_every_expert(moe_dir: Path) -> None:
    full = ModelConfig.from_dir(moe_dir)
    state = load_state_dict(moe_dir)
    model = load_shard(moe_dir, torch.device("cpu"), torch.float32, 1, 2)
    block, (gate, up, down) = _names(full.model_type)
    width = full.moe.intermediate_size // 2
    assert model.config.moe.intermediate_size == width
    moe = model.layers[0].moe
    assert len(moe.gu) == len(moe.down) == full.moe.num_experts
    for e in (0, 5):
        p = f"model.layers.0.{block}.experts.{e}."
        want_gu = torch.cat([state[p + f"{gate}.weight"][width:], state[p + f"{up}.weight"][width:]])
        torch.testing.assert_close(moe.gu[e], want_gu.t(), rtol=0, atol=0)  # [in, out] operand
        torch.testing.assert_close(moe.down[e], state[p + f"{down}.weight"][:, width:].t(),
                                   rtol=0, atol=0)  # fmt: skip
    router = state[f"model.layers.0.{block}.gate.weight"]
    torch.testing.assert_close(moe.router_t, router.t(), rtol=0, atol=0)  # whole on every rank
    if full.moe.shared_intermediate_size:
        half = full.moe.shared_intermediate_size // 2
        assert model.config.moe.shared_intermediate_size == half
        s = state["model.layers.0.mlp.shared_expert.down_proj.weight"]
        torch.testing.assert_close(moe.shared_down, s[:, half:].t(), rtol=0, atol=0)


def test_expert_widths_that_do_not_divide_are_refused(moe_dir: Path) -> None:
    cfg = ModelConfig.from_dir(moe_dir)
    check_tp_size(cfg, 2)
    width = "moe_intermediate_size=32" if cfg.model_type == "qwen2_moe" else "intermediate_size=96"
    with pytest.raises(TensorParallelConfigError, match=f"does not divide .*{width}"):
        check_tp_size(cfg, 64)


def test_expert_slices_follow_the_experts_width(moe_dir: Path) -> None:
    cfg = ModelConfig.from_dir(moe_dir)
    width = cfg.moe.intermediate_size // 2
    block, (gate, up, down) = _names(cfg.model_type)
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
