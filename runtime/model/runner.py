"""`ModelRunner`: a loaded decoder + an attention backend over a KV pool; `forward(batch)`."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from radixlm.runtime.attention import KVPoolLike, create_backend
from radixlm.runtime.memory import trim_heap

from .batch import ForwardBatch
from .config import ModelConfig
from .decoder import DecoderModel
from .fused_decode import FusedDecode
from .loader import load_model, resolve_device, resolve_dtype
from .sliced import SlicedPrefill

log = logging.getLogger(__name__)

# A CPU forward of this many tokens (a prefill chunk) hands its temporaries' memory back to
# the OS when it ends: glibc keeps freed heap memory below its (adaptive, up to 32 MiB)
# mmap threshold, and the activations, dequantized matrices and attention buffers of a
# 2,048-token chunk would otherwise stay resident (measured: +180 MB on SmolLM2 after an
# 8k-token prompt). malloc_trim takes ~1 ms; such a forward takes seconds.
TRIM_TOKENS = 256


# KV pool element types a CPU model may use whatever it computes in (`--kv-dtype`).
KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_kv_dtype(kv_dtype: str | torch.dtype | None, device: torch.device | str,
                     compute_dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """The KV pool's dtype: as given, or for "auto"/None float16 on CPU with quantized
    weights (half the bytes attention reads, as llama.cpp's default F16 cache; the
    weights are rounded already) and the compute dtype otherwise (dense float32 stays
    exact; CUDA keeps the model's dtype, which its kernels expect)."""
    if isinstance(kv_dtype, torch.dtype):
        return kv_dtype
    if kv_dtype in (None, "", "auto"):
        return torch.float16 if torch.device(device).type == "cpu" and quantized else compute_dtype
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; use auto or one of {sorted(KV_DTYPES)}")
    dt = KV_DTYPES[kv_dtype]
    if torch.device(device).type != "cpu" and dt != compute_dtype:
        raise ValueError(f"--kv-dtype {kv_dtype} differs from the model's {compute_dtype}: "
                         "only CPU pools may hold another dtype")  # fmt: skip
    return dt


class ModelRunner:
    """Runs forward passes of one model over a `radixlm.cache.KVPool`.

    The pool must match the model: `len(pool.k) == num_layers`, each `pool.k[i]` of shape
    `[capacity, num_kv_heads, head_dim]` on its device, in the runner's dtype or (on CPU)
    in float16 / bfloat16 / float32 whatever the model computes in (`KV_DTYPES`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        pool: KVPoolLike | None = None,
        attention: str = "auto",
        quantize: str | None = None,
        **backend_kwargs,
    ):
        """`dtype` or `quantize` may name a quantized weight format ('int8', 'int4',
        'gguf'; see `load_model`); the runner then computes in float32 on CPU."""
        device = resolve_device(device)
        if pool is None:
            raise ValueError("ModelRunner needs a KV pool (radixlm.cache.KVPool)")
        model = load_model(model_dir, device, dtype, quantize)
        self._setup(model, pool, attention, **backend_kwargs)
        self.model_dir = Path(model_dir)

    @classmethod
    def from_model(
        cls, model: DecoderModel, pool: KVPoolLike, attention: str = "auto", **backend_kwargs
    ) -> ModelRunner:
        """A runner over an already built `DecoderModel` (e.g. random weights in benchmarks)."""
        self = cls.__new__(cls)
        self._setup(model, pool, attention, **backend_kwargs)
        self.model_dir = None
        return self

    def _setup(self, model: DecoderModel, pool: KVPoolLike, attention: str, **backend_kwargs):
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.config: ModelConfig = model.config
        self.pool = pool
        self._check_pool(pool)
        c = self.config
        v = c.variations
        self.attn = create_backend(
            attention, pool, c.num_heads, c.num_kv_heads, c.head_dim, self.device, self.dtype,
            windows=[c.layer_window(i) for i in range(c.num_layers)], softcap=v.attn_softcap,
            scale=v.query_scale, **backend_kwargs,
        )  # fmt: skip
        self.attention = self.attn.name
        # Batch-1 decode in one kernel call when the weights allow it (quantized, CPU).
        fused = self.attention == "torch" and FusedDecode.supported(model, pool)
        self.fused = FusedDecode(model, pool) if fused else None
        blockers = model.fused_step_blockers()
        quantized = model.weight_format != str(model.dtype).removeprefix("torch.")
        if self.attention == "torch" and quantized and blockers:
            log.info("decode runs per op (quantized products), not in the fused step: the "
                     "model has %s", ", ".join(blockers))  # fmt: skip

    def _check_pool(self, pool: KVPoolLike) -> None:
        c = self.config
        if len(pool.k) != c.num_layers or len(pool.v) != c.num_layers:
            raise ValueError(f"KV pool has {len(pool.k)} layers, the model {c.num_layers}")
        k0 = pool.k[0]
        if tuple(k0.shape[1:]) != (c.num_kv_heads, c.head_dim):
            raise ValueError(
                f"KV pool layer shape {tuple(k0.shape)} does not match the model's "
                f"[capacity, {c.num_kv_heads}, {c.head_dim}]"
            )
        if k0.dtype != self.dtype and not (self.device.type == "cpu" and k0.dtype in KV_DTYPES.values()):
            raise ValueError(f"KV pool dtype {k0.dtype} != model dtype {self.dtype}")
        if k0.device.type != self.device.type:
            raise ValueError(f"KV pool is on {k0.device}, the model on {self.device}")

    @staticmethod
    def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype | str) -> int:
        """KV-pool bytes one token occupies (K and V, all layers)."""
        dtype = resolve_dtype(dtype, "cpu")
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Write the batch's new K/V into the pool and return float32 logits `[L, vocab]`
        for the rows `batch.logits_indices` names (an ordinary tensor: editable in place)."""
        # Logits outside inference mode, so callers (sampling) may edit them in place.
        if self.fused is not None and self.fused.applies(batch):
            with torch.no_grad():
                logits = self.fused.logits(batch)
        else:
            with torch.inference_mode():
                self.attn.plan(batch)
                hidden = self.model.forward_hidden(batch, self.attn)
                self.attn.release()
            with torch.no_grad():
                logits = self.model.compute_logits(hidden)
        self._trim(batch.num_tokens)
        return logits

    def _trim(self, num_tokens: int) -> None:
        if num_tokens >= TRIM_TOKENS and self.device.type == "cpu":
            trim_heap()

    @property
    def sliceable(self) -> bool:
        """Whether `start_sliced` applies: the torch backend on CPU (sliced.py)."""
        return self.attention == "torch" and self.device.type == "cpu"

    def start_sliced(self, tokens, slots, kv_len: int, extend: int, logits_from: int,
                     rows: int) -> SlicedPrefill:
        """One request's prefill chunk as a resumable task (`SlicedPrefill.advance`);
        the same K/V and logits as `forward` of that one-request batch."""
        return SlicedPrefill(self.model, self.attn, tokens, slots, kv_len, extend,
                             logits_from, rows, self.device, self._trim)

    def build_batch(self, requests) -> ForwardBatch:
        """`ForwardBatch.build(requests, device=self.device)`."""
        return ForwardBatch.build(requests, self.device)
