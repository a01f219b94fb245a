"""How many tokens the KV pool holds: `kv_tokens` if given, else a fraction of the memory
left once the weights are in (device memory on CUDA, available RAM on CPU). On CPU the
pool is also bounded by what the engine can use at once (context length x running
requests) and by `CPU_MAX_BYTES`: RAM beyond that is only wasted (CPU decode is the
limit), and a small model must not take half of the machine. (A CPU pool is reserved, not
allocated: memory is committed as slots are written, see `radixlm.cache.kv_pool`; the
bounds keep what a full pool would take within the budget.)

The weights' size is what the loaded model holds (`DecoderModel.weight_bytes`: quantized
blocks at their packed size), or, before loading, the dense estimate `weight_bytes`."""

from __future__ import annotations

import logging
import os

import torch
from radixlm.cache.pages import align_down
from radixlm.runtime.model import ModelConfig, ModelRunner

log = logging.getLogger(__name__)

CPU_MAX_TOKENS = 262_144  # a CPU pool beyond this only wastes RAM: CPU decode is the limit
CPU_MAX_BYTES = 2 * 2**30  # nor beyond this many bytes of KV
MIN_TOKENS = 256


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """The decoder's parameter bytes in `dtype` (projections, MLP, embeddings)."""
    h, i = config.hidden_size, config.intermediate_size
    per_layer = h * config.q_size * 2 + h * config.kv_size * 2 + 3 * h * i + 2 * h
    embed = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    item = torch.empty((), dtype=dtype).element_size()
    experts = 0
    if config.moe is not None:  # a sparse layer's experts in place of its dense MLP
        experts = sum(config.moe.layer_params(h) - 3 * h * i for s in config.moe.sparse_layers if s)
    return (config.num_layers * per_layer + embed + experts) * item


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (Linux), else physical pages available."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_capacity(
    kv_tokens: int,
    fraction: float,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    page_size: int,
    usable_tokens: int = 0,
    weights: int | None = None,
) -> int:
    """Pool capacity in tokens, a multiple of `page_size`; `dtype` is the pool's. The
    weights' bytes (`weights`; None: the dense estimate in `dtype`) are taken out of the
    free memory measured now (on CPU, memory-mapped weights not yet read count as free:
    the page cache holds them). `usable_tokens`: the most the engine can hold at once
    (context length x max running requests; 0 = unknown)."""
    if kv_tokens > 0:
        tokens = kv_tokens
    else:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {fraction}")
        per_token = ModelRunner.kv_bytes_per_token(config, dtype)
        if weights is None:
            weights = weight_bytes(config, dtype)
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            tokens = int(fraction * max(0, free - weights) // per_token)
        else:
            budget = min(fraction * max(0, available_ram() - weights), CPU_MAX_BYTES)
            tokens = min(int(budget // per_token), CPU_MAX_TOKENS, usable_tokens or CPU_MAX_TOKENS)
        log.info(
            "KV pool sized from memory: %.1f MiB per 1k tokens (%s), weights %.0f MiB",
            per_token * 1000 / 2**20, str(dtype).removeprefix("torch."), weights / 2**20,
        )  # fmt: skip
    tokens = align_down(tokens, page_size)
    if tokens < MIN_TOKENS and kv_tokens > 0:
        raise ValueError(f"--kv-tokens {kv_tokens} is below the smallest KV pool, "
                         f"{MIN_TOKENS} tokens (with --page-size {page_size}); give more")
    if tokens < MIN_TOKENS:
        raise ValueError(f"free memory leaves room for a KV pool of only {tokens} tokens; "
                         f"free memory, or give --kv-tokens {MIN_TOKENS} or more")
    return tokens
