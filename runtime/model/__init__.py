"""radixlm.runtime.model: one decoder for Llama-family, Qwen2 and Qwen3 checkpoints.

- `ModelConfig.from_hf(dict)` / `ModelConfig.from_dir(path)`: frozen config.
- `resolve_model(spec)`: "default" / a .gguf / an HF directory → HF-style directory.
- `load_model(model_dir, device, dtype)`: → `DecoderModel`.
- `ForwardBatch` (+ `BatchRequest`, `ForwardBatch.build`): explicit inputs of a forward pass;
  `pack_forward_batch`, the one builder of its tensors (the engine's scheduler calls it too).
- `ModelRunner(model_dir, device, dtype, pool, attention)`: `forward(batch) -> logits`.
"""

from .batch import BatchRequest, ForwardBatch, build_forward_batch, pack_forward_batch
from .config import ModelConfig, RopeConfig, UnsupportedModelError
from .decoder import DecoderModel
from .gguf_convert import cache_root, convert_gguf, ensure_converted, ensure_dense_weights
from .loader import default_device, load_model, resolve_device, resolve_dtype
from .resolve import INSTALL_HINT, ModelNotFoundError, default_gguf_path, resolve_model
from .runner import KV_DTYPES, ModelRunner, resolve_kv_dtype

__all__ = [
    "INSTALL_HINT",
    "KV_DTYPES",
    "BatchRequest",
    "DecoderModel",
    "ForwardBatch",
    "ModelConfig",
    "ModelNotFoundError",
    "ModelRunner",
    "RopeConfig",
    "UnsupportedModelError",
    "build_forward_batch",
    "pack_forward_batch",
    "cache_root",
    "convert_gguf",
    "default_device",
    "default_gguf_path",
    "ensure_converted",
    "ensure_dense_weights",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "resolve_kv_dtype",
    "resolve_model",
]
