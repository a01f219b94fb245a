"""`MoeConfig`: the mixture-of-experts settings of an HF config, read once (config.py).

| `model_type` | experts' MLP width        | routing (`route` in moe.py)                               |
|--------------|---------------------------|-----------------------------------------------------------|
| `qwen3_moe`  | `moe_intermediate_size`   | softmax over all experts, top-k, renormalised if `norm_topk_prob` |
| `qwen2_moe`  | `moe_intermediate_size`   | as qwen3_moe, plus a shared expert behind a sigmoid gate  |
| `mixtral`    | `intermediate_size`       | top-k of the logits, softmax over the k chosen            |

Which layers are sparse (Qwen): layer i unless it is in `mlp_only_layers`, and only if
`(i + 1) % decoder_sparse_step == 0`; the others keep a dense MLP of `intermediate_size`.
Every Mixtral layer is sparse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
ROUTINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class MoeConfig:
    """One model's experts: how many, how many per token, their width, how tokens are routed."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    routing: str  # one of ROUTINGS
    norm_topk_prob: bool  # softmax_topk: renormalise the k chosen probabilities to sum 1
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)

    def layer_params(self, hidden: int) -> int:
        """Parameters of one sparse layer's MLP: router, experts, shared expert and its gate."""
        shared = 3 * hidden * self.shared_intermediate_size + hidden if self.shared_intermediate_size else 0
        return self.num_experts * (hidden + 3 * hidden * self.intermediate_size) + shared


def moe_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
    """The MoE settings of an HF config dict (None for dense families); raises ValueError
    (the caller's `UnsupportedModelError`) for settings that cannot run."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    if model_type == "mixtral":
        experts = int(cfg["num_local_experts"])
        width = int(cfg["intermediate_size"])
        routing, norm, sparse = "topk_softmax", True, (True,) * num_layers
    else:
        experts = int(cfg.get("num_experts", cfg.get("num_local_experts")) or 0)
        width = int(cfg["moe_intermediate_size"])
        routing, norm = "softmax_topk", bool(cfg.get("norm_topk_prob", False))
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                       for i in range(num_layers))  # fmt: skip
    top_k = int(cfg.get("num_experts_per_tok", 0))
    if experts > 0 and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{experts} (the experts)")
    if width <= 0:
        raise ValueError(f"the experts' intermediate size must be positive, got {width}")
    shared = 0
    if model_type == "qwen2_moe":  # its every sparse block has the shared expert
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        if shared <= 0:
            raise ValueError("qwen2_moe needs shared_expert_intermediate_size > 0")
    return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=width, routing=routing,
                     norm_topk_prob=norm, sparse_layers=sparse,
                     shared_intermediate_size=shared)  # fmt: skip


# HF tensor names of a sparse block, by family: the block's prefix in a layer, and an
# expert's (gate, up, down) projections; the router is `<prefix>.gate.weight`, Qwen2-MoE's
# shared expert `<prefix>.shared_expert.{gate,up,down}_proj.weight` behind
# `<prefix>.shared_expert_gate.weight`.
EXPERT_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
