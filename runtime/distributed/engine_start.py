"""`start_engine_ranks(config, ...)`: the engine's one call into tensor parallelism, which
checks the options against TP, sizes the per-rank KV pool and starts the ranks."""

from __future__ import annotations

from pathlib import Path

import torch
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.pool_size import kv_capacity
from radixlm.runtime.model.config import ModelConfig

from .launch import TensorParallel
from .load import check_dense
from .shard import TensorParallelConfigError, shard_config


def start_engine_ranks(config: EngineConfig, model_dir: Path, device: torch.device,
                       dtype: torch.dtype, context: int) -> TensorParallel:  # fmt: skip
    """The ranks of `config.tensor_parallel_size`; raises `TensorParallelConfigError` for
    a model or options that cannot be split (before any process starts)."""
    world = config.tensor_parallel_size
    check_dense(config.dtype, config.quantize, world)
    if config.host_kv_tokens > 0:
        raise TensorParallelConfigError(
            "--host-kv-tokens cannot be combined with --tensor-parallel-size: the host tier "
            "would copy only rank 0's KV heads")
    local = shard_config(ModelConfig.from_dir(model_dir), world)
    # Each rank's pool holds its KV heads for the same slots: sized by one rank's share.
    capacity = kv_capacity(
        config.kv_tokens, config.kv_memory_fraction, local, device, dtype, config.page_size,
        usable_tokens=context * config.max_running,
    )  # fmt: skip
    return TensorParallel.start(
        model_dir, world, device=device, dtype=dtype, capacity=capacity,
        page_size=config.page_size, attention=config.attention, threads=config.threads,
        seed=config.seed, log_level=config.log_level,
    )  # fmt: skip
