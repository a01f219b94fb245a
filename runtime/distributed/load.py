"""One rank's decoder: its slices of the checkpoint, read straight from the safetensors
(`get_slice`: a rank never reads the other ranks' parts of a split matrix)."""

from __future__ import annotations

from pathlib import Path

import torch
from radixlm.runtime.model.config import ModelConfig
from radixlm.runtime.model.decoder import DecoderModel
from radixlm.runtime.model.loader import weight_format
from radixlm.runtime.model.weights import safetensors_files
from safetensors import safe_open

from .shard import TensorParallelConfigError, shard_config, shard_slices


def check_dense(dtype: str, quantize: str | None, world: int) -> None:
    """Tensor parallelism splits dense matrices only (shard.py): refuse quantized formats."""
    fmt = weight_format(dtype, quantize)
    if fmt is not None:
        raise TensorParallelConfigError(
            f"--tensor-parallel-size {world} runs dense weights; {fmt!r} quantized weights "
            "cannot be split: use --dtype float32, bfloat16 or float16 and --quantize none"
        )


def load_shard(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype, rank: int, world: int
) -> DecoderModel:
    """Rank `rank` of `world`'s `DecoderModel` (its heads, KV heads and MLP columns)."""
    config = ModelConfig.from_dir(model_dir)
    local = shard_config(config, world)
    state: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for path in safetensors_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    dim, start, size = shard_slices(name, config, rank, world)
                    if dim < 0:
                        state[name] = f.get_tensor(name)
                        continue
                    index = [slice(None)] * (dim + 1)
                    index[dim] = slice(start, start + size)
                    state[name] = f.get_slice(name)[tuple(index)]
        return DecoderModel(local, state, device, dtype)
