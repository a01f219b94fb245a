"""Will the model fit? Before anything is loaded, the memory a CPU engine will need — its
weights as they will be held, the KV pool, the working buffers of a prefill chunk — is
estimated against the memory this process can use (MemAvailable, less under a cgroup
limit). A model that will not fit is refused in one line naming the estimate and the flags
that would make it fit (`--kv-tokens`, `--kv-dtype`), as llama.cpp's fit check does,
instead of being killed by the OOM killer in the middle of a long prompt.

Weights are counted as `load_model` will hold them: a GGUF's packed types (`quant.BLOCK_BYTES`)
at their stored size (the packed tiles are the same bytes), every other tensor as float32
(`gguf_weights` dequantizes them); dense checkpoints at the compute dtype. A CPU KV pool is
reserved, not allocated (committed as slots are written), so a pool larger than memory
starts fine and fails once a long context fills it: it is counted whole.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from .config import ModelConfig
from .gguf_file import GGML_TYPE_NAMES, GGUFFile
from .quant import BLOCK_BYTES

GIB = 2**30
# The processes' own memory besides weights, KV and buffers (Python, torch, the frontend
# and HTTP processes): about 0.4 GB measured on a default server at idle.
RUNTIME_BYTES = 400 << 20
MIN_KV_TOKENS = 256  # engine/pool_size.py's smallest pool
_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: held as float32 tensors


class WontFitError(ValueError):
    """The model, its KV pool and working buffers need more memory than is available."""


def available_memory() -> int:
    """Bytes this process can still allocate: /proc/meminfo's MemAvailable, bounded by the
    cgroup's limit less its usage where one is set (containers)."""
    avail = None
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cg = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError, ValueError):
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cg / "memory.current").read_text())
            avail = min(avail, max(0, int(limit) - used))
    return avail


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.0f} MiB"


def gguf_unpacked(gguf: str | Path | GGUFFile) -> tuple[int, int, dict[str, int]]:
    """(bytes held packed, float32 bytes of the rest, {type name: tensor count} of the
    quantized types that are dequantized) of a GGUF as `gguf_state_dict` loads it."""
    packed = dense = 0
    others: dict[str, int] = {}
    for t in (gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)).tensors:
        n = 1
        for d in t.shape:
            n *= d
        if t.ggml_type in BLOCK_BYTES and len(t.shape) in (2, 3):  # (3: experts, rows, cols)
            packed += t.nbytes
        else:
            dense += 4 * n
            if t.ggml_type not in _FLOAT_TYPES:
                name = GGML_TYPE_NAMES.get(t.ggml_type, str(t.ggml_type))
                others[name] = others.get(name, 0) + 1
    return packed, dense, others


def dense_weight_bytes(config: ModelConfig, itemsize: int) -> int:
    """Parameter bytes of the decoder in one dtype of `itemsize` bytes."""
    h, i = config.hidden_size, config.intermediate_size
    per_layer = h * config.q_size * 2 + h * config.kv_size * 2 + 3 * h * i + 2 * h
    embed = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return (config.num_layers * per_layer + embed) * itemsize


def model_weight_bytes(model_dir: str | Path, config: ModelConfig, fmt: str | None,
                       itemsize: int) -> int:
    """The weights' bytes once `load_model(model_dir, dtype, fmt)` has built the model (at
    the peak of loading for `int8` / `int4`, which quantize float32 weights)."""
    from .gguf_weights import source_gguf  # (gguf_weights imports this module)

    src = source_gguf(model_dir)
    if fmt == "gguf" and src is not None:
        packed, dense, _ = gguf_unpacked(src)
        return packed + dense
    if fmt in ("int8", "int4"):
        return dense_weight_bytes(config, 4)
    return dense_weight_bytes(config, itemsize)


def work_bytes(config: ModelConfig, chunk_tokens: int, context: int, threads: int) -> int:
    """Working buffers of one prefill chunk of `chunk_tokens` rows over `context` positions:
    the layer's activations (with temporaries), the int8 copy of the activations and each
    thread's unpacked weights (kernels/gemm8.c), the attention mask, one row of logits per
    request."""
    c = config
    hd = c.head_dim
    per_row = (3 * c.hidden_size + (2 * c.num_heads + 3 * c.num_kv_heads) * hd + 3 * c.intermediate_size)
    wide = max(c.hidden_size, c.intermediate_size, c.num_heads * hd)
    acts = 2 * 4 * per_row * chunk_tokens + (wide * 3 // 2) * chunk_tokens + threads * (1 << 20)
    return acts + chunk_tokens * context + 4 * c.vocab_size * 64


@dataclass(frozen=True)
class Footprint:
    """A CPU engine's estimated memory (bytes) and what is available."""

    weights: int
    kv: int
    work: int
    available: int
    kv_tokens: int
    kv_per_token: int
    kv_dtype: str

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.work + RUNTIME_BYTES

    @property
    def fits(self) -> bool:
        return self.total <= self.available

    def refusal(self) -> str:
        """One line: the estimate, what is available, and the flags that would fit."""
        head = (f"the model does not fit in memory: weights {fmt_bytes(self.weights)} + KV pool "
                f"{fmt_bytes(self.kv)} ({self.kv_tokens:,} tokens of {self.kv_dtype}) + working "
                f"buffers {fmt_bytes(self.work + RUNTIME_BYTES)} = {fmt_bytes(self.total)}, and "
                f"{fmt_bytes(self.available)} is available")  # fmt: skip
        room = self.available - self.weights - self.work - RUNTIME_BYTES
        tokens = room // self.kv_per_token if self.kv_per_token else 0
        if tokens < MIN_KV_TOKENS:
            return (head + "; even the smallest KV pool does not fit: use a smaller "
                    "quantization of the model (e.g. Q4_K_M) or free memory")  # fmt: skip
        fix = f"--kv-tokens {tokens // 256 * 256}"
        if self.kv_dtype == "float32":
            fix += f" (or --kv-dtype float16 --kv-tokens {min(2 * tokens, self.kv_tokens) // 256 * 256})"
        return f"{head}; {fix} would fit"


def footprint(weights: int, config: ModelConfig, kv_tokens: int, kv_itemsize: int,
              kv_dtype: str, chunk_tokens: int, context: int, threads: int,
              available: int | None = None) -> Footprint:
    """The estimate for a model of `weights` bytes with a pool of `kv_tokens` (0: sized
    from memory later, counted at its smallest)."""
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_itemsize
    tokens = kv_tokens if kv_tokens > 0 else MIN_KV_TOKENS
    return Footprint(weights, tokens * per_token, work_bytes(config, min(chunk_tokens, context), context, threads),
                     available_memory() if available is None else available, tokens, per_token,
                     kv_dtype)  # fmt: skip


def check_fits(fp: Footprint) -> None:
    """Raise `WontFitError` (one line) unless `fp` fits."""
    if not fp.fits:
        raise WontFitError(fp.refusal())


def check_model_fits(model_dir: str | Path, config: ModelConfig, fmt: str | None, dtype,
                     kv_dtype, kv_tokens: int, chunk_tokens: int, context: int,
                     threads: int) -> Footprint:
    """An engine's check before loading (CPU): raise `WontFitError` naming the estimate and
    the flags that would fit; the estimate otherwise. `dtype` / `kv_dtype`: torch dtypes."""
    weights = model_weight_bytes(model_dir, config, fmt, dtype.itemsize)
    fp = footprint(weights, config, kv_tokens, kv_dtype.itemsize, str(kv_dtype).removeprefix("torch."),
                   chunk_tokens, context, threads)  # fmt: skip
    check_fits(fp)
    return fp
