"""Which slice of each weight a tensor-parallel rank holds (Megatron-style), cut from the
HF-named state dict at load time.

- Column-parallel (output rows split): q/k/v by whole heads (`q` by attention heads, `k`
  and `v` by KV heads, GQA groups kept together), gate/up by intermediate rows, and their
  biases with them.
- Row-parallel (input columns split): o_proj by the same heads, down_proj by the same
  intermediate columns; their biases stay whole and are added once, after the sum.
- Replicated: embeddings, LM head, norms (every rank holds them; only rank 0 computes
  logits, so the head costs memory on the others but no time).
- Mixture of experts: every rank holds every expert, each cut by its intermediate width as
  a dense MLP is (gate/up rows, down columns; the same for Qwen2-MoE's shared expert); the
  routers are replicated, so each rank routes its tokens alike, and the experts' partial
  sums take one all-reduce per layer (linear.py).

Weights are dense (float32 / bfloat16 / float16): quantized blocks (GGUF, int8, int4) are
refused with `TensorParallelConfigError`, since a row-parallel split cuts each row's
blocks and the quantized kernels assume whole rows.
"""

from __future__ import annotations

from dataclasses import replace

from radixlm.runtime.model.config import ModelConfig
from radixlm.runtime.model.moe_config import EXPERT_NAMES


class TensorParallelConfigError(ValueError):
    """The model or the options cannot be split over the asked number of ranks."""


def check_tp_size(config: ModelConfig, world: int) -> None:
    """Raise `TensorParallelConfigError` unless `world` ranks can split this model."""
    if world < 1:
        raise TensorParallelConfigError(f"--tensor-parallel-size must be >= 1, got {world}")
    sizes = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
    }
    if config.moe is not None:  # (Mixtral's experts are intermediate_size wide)
        if config.moe.intermediate_size != config.intermediate_size:
            sizes["moe_intermediate_size"] = config.moe.intermediate_size
        if config.moe.shared_intermediate_size:
            sizes["shared_expert_intermediate_size"] = config.moe.shared_intermediate_size
    bad = [f"{name}={n}" for name, n in sizes.items() if n % world]
    if bad:
        raise TensorParallelConfigError(
            f"--tensor-parallel-size {world} must divide the model's "
            f"{', '.join(f'{k}={v}' for k, v in sizes.items())}; it does not divide "
            f"{', '.join(bad)}"
        )


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The config one rank's decoder runs: its share of heads, KV heads and MLP width."""
    check_tp_size(config, world)
    moe = config.moe
    if moe is not None:
        moe = replace(moe, intermediate_size=moe.intermediate_size // world,
                      shared_intermediate_size=moe.shared_intermediate_size // world)  # fmt: skip
    return replace(
        config,
        num_heads=config.num_heads // world,
        num_kv_heads=config.num_kv_heads // world,
        intermediate_size=config.intermediate_size // world,
        moe=moe,
    )


def shard_slices(name: str, config: ModelConfig, rank: int, world: int) -> tuple[int, int, int]:
    """`(dim, start, size)`: the slice of tensor `name` rank `rank` holds, or `(-1, 0, 0)`
    for a tensor every rank holds whole."""
    d = config.head_dim
    q_rows = config.num_heads // world * d
    kv_rows = config.num_kv_heads // world * d
    mlp = config.intermediate_size // world
    column = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
              "gate_proj": mlp, "up_proj": mlp}  # fmt: skip
    row = {"o_proj": q_rows, "down_proj": mlp}
    parts = name.split(".")
    proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    if world == 1:
        return -1, 0, 0
    if config.moe is not None and ((".experts." in name) or (".shared_expert." in name)):
        return _expert_slice(name, proj, config, rank, world)
    if proj in column:
        return 0, rank * column[proj], column[proj]
    if proj in row and kind == "weight":
        return 1, rank * row[proj], row[proj]
    return -1, 0, 0



def _expert_slice(name: str, proj: str, config: ModelConfig, rank: int, world: int
                  ) -> tuple[int, int, int]:  # fmt: skip
    """`shard_slices` of an expert's (or the shared expert's) projection."""
    moe = config.moe
    assert moe is not None
    if ".shared_expert." in name:
        width, (gate, up, down) = moe.shared_intermediate_size, ("gate_proj", "up_proj", "down_proj")
    else:
        width, (gate, up, down) = moe.intermediate_size, EXPERT_NAMES[config.model_type][1]
    part = width // world
    if proj in (gate, up):
        return 0, rank * part, part
    if proj == down:
        return 1, rank * part, part
    return -1, 0, 0
