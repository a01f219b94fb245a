"""Tensor parallelism over `torch.distributed` (gloo on CPU, NCCL on CUDA).

One engine runs a model over N ranks: rank 0 is the engine process (scheduler, cache,
sessions, sampling, as without TP); ranks 1..N-1 are processes it spawns. Attention heads
and KV heads, and the MLP's intermediate columns, are split over the ranks (shard.py);
q/k/v and gate/up are column-parallel, o_proj and down_proj row-parallel with one
all-reduce each (linear.py); embeddings and the LM head are replicated and only rank 0
computes logits. Each step rank 0 sends the `ForwardBatch` to the workers (step_wire.py,
launch.py), which run the same forward on their shard over their own KV pool: same slots,
their KV heads.
"""

from .engine_start import start_engine_ranks
from .launch import TensorParallel, TensorParallelRunner
from .shard import TensorParallelConfigError, check_tp_size, shard_config
from .workers import TensorParallelError

__all__ = [
    "TensorParallel",
    "TensorParallelConfigError",
    "TensorParallelError",
    "TensorParallelRunner",
    "check_tp_size",
    "shard_config",
    "start_engine_ranks",
]
