"""The row-parallel half of each block: o_proj and down_proj, summed over the ranks.

Each rank multiplies its heads' (or MLP columns') activations by its columns of the
weight; the partial products are summed by one all-reduce, and the residual is added once
(by rank 0, folded into its `addmm`). With q/k/v and gate/up split by output rows
(column-parallel, shard.py), that is one all-reduce after attention and one after the MLP;
a mixture-of-experts MLP sums its experts' partial outputs with one all-reduce likewise
(`add_experts`).
"""

from __future__ import annotations

import torch
from radixlm.runtime.model.decoder import DecoderModel
from radixlm.runtime.model.moe import ExpertMlp

from .group import TPGroup


class RowParallelAdd:
    """`x + a @ w_t` summed over the ranks: `DecoderModel.add_out_proj` under TP."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def __call__(self, x: torch.Tensor, a: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(x, a, w_t) if self.group.rank == 0 else torch.mm(a, w_t)
        self.group.all_reduce(y)
        return y

    def add_experts(self, x: torch.Tensor, h: torch.Tensor, moe: ExpertMlp) -> torch.Tensor:
        """`x + moe(h)` summed over the ranks (`DecoderModel.add_experts` under TP): rank
        0 adds its experts' slices into `x`, the others into zeros."""
        y = moe(h, x if self.group.rank == 0 else torch.zeros_like(x))
        self.group.all_reduce(y)
        return y


def use_row_parallel(model: DecoderModel, group: TPGroup) -> None:
    """Make `model` (a rank's `DecoderModel`) sum its row-parallel products over `group`."""
    add = RowParallelAdd(group)
    model.add_out_proj = add
    model.add_experts = add.add_experts
