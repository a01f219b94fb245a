"""`load_model(model_dir, device, dtype, quantize)`: an HF-style directory → a ready `DecoderModel`.

Weights are dense in `dtype`, or weight-only quantized on CPU (activations and KV float32):
- `gguf`: a GGUF's Q4_0/Q4_1/Q8_0 tensors as stored (the model must come from a GGUF);
- `int8`: every matrix as Q8_0 blocks;
- `int4`: projections as Q4_1 blocks, the embedding / LM head as Q8_0 (as llama.cpp's Q4_1
  files keep them: the head is the most sensitive matrix and only read once per step).
`dtype` may name these formats directly (`--dtype int8`) or `quantize` may (`--quantize`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig
from .decoder import DecoderModel
from .gguf_convert import QK_PERMUTED, has_dense_weights
from .gguf_weights import dense_state_dict, gguf_state_dict, source_gguf
from .quant import Q4_1, Q8_0, QuantWeight, quantize
from .weights import load_state_dict

WEIGHT_FORMATS = ("int8", "int4", "gguf")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
}  # fmt: skip


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    return default_device() if device in (None, "auto") else torch.device(device)


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str) -> torch.dtype:
    """float32 on CPU and bfloat16 on CUDA unless a dtype (or its name) is given."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in WEIGHT_FORMATS:
        return torch.float32  # quantized weights: float32 activations and KV
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def engine_weight_format(dtype: str, quantize: str | None, model_dir: str | Path,
                         device: torch.device) -> str | None:
    """The weight format an engine loads: as asked (`weight_format`), except that "auto"
    on CPU keeps a converted GGUF's quantized blocks as stored ("gguf"): llama.cpp's
    choice, and on SmolLM2 a batch-1 decode step 3-4x faster than float32 weights (97 MB
    read per token instead of 538 MB) with decode logits within 0.005 std of float32.
    Large decode batches (above ~32 rows) run faster on float32: `--dtype float32`."""
    fmt = weight_format(dtype, quantize)
    if fmt is None and dtype in (None, "auto") and device.type == "cpu" and (
            source_gguf(model_dir) is not None):  # fmt: skip
        return "gguf"
    return fmt


def weight_format(dtype: torch.dtype | str | None, quantize: str | None) -> str | None:
    """The quantized weight format asked for by `dtype` or `quantize` (None: dense)."""
    by_dtype = dtype if isinstance(dtype, str) and dtype in WEIGHT_FORMATS else None
    if quantize in (None, "", "none"):
        return by_dtype
    if quantize not in WEIGHT_FORMATS:
        raise ValueError(f"unknown quantization {quantize!r}; use one of {list(WEIGHT_FORMATS)}")
    if by_dtype is not None and by_dtype != quantize:
        raise ValueError(f"dtype {dtype!r} and quantize {quantize!r} disagree")
    dense = dtype not in (None, "auto", quantize) and resolve_dtype(dtype, "cpu") != torch.float32
    if dense:
        raise ValueError(f"quantized weights compute in float32, not dtype {dtype!r}")
    return quantize


# Mixture-of-experts routers stay dense, as llama.cpp keeps them (F32): small, and a
# rounded logit may pick another expert.
_ROUTERS = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".shared_expert_gate.weight")


def _quantizable(name: str, t: torch.Tensor) -> bool:
    return (t.dim() == 2 and t.shape[1] % 32 == 0 and name.endswith(".weight")
            and "norm" not in name and not name.endswith(_ROUTERS))  # fmt: skip


def quantize_state(state: dict, fmt: str) -> dict:
    """`state` with its matrices packed for `fmt` ('int8' or 'int4'; see the module doc).
    Matrices whose input width is not a multiple of 32 stay dense."""
    out = {}
    for name, t in state.items():
        if isinstance(t, QuantWeight):
            t = t.dequantize()  # requantizing a GGUF's blocks to another format
        if _quantizable(name, t):
            head = name in ("model.embed_tokens.weight", "lm_head.weight")
            t = quantize(t, Q8_0 if fmt == "int8" or head else Q4_1)
        out[name] = t
    return out


def load_model(
    model_dir: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    quantize: str | None = None,
) -> DecoderModel:
    """Read config.json and the weights of `model_dir` into a `DecoderModel`: dense
    safetensors, or quantized weights (see the module docstring)."""
    device = resolve_device(device)
    fmt = weight_format(dtype, quantize)
    dtype = resolve_dtype(dtype, device)
    config = ModelConfig.from_dir(model_dir)
    if fmt is not None and device.type != "cpu":
        raise ValueError(f"quantized weights ({fmt}) run on CPU only, not on {device}")
    src = source_gguf(model_dir)
    heads = (config.num_heads, config.num_kv_heads, config.model_type in QK_PERMUTED,
             config.model_type)  # fmt: skip
    with torch.inference_mode():
        if fmt == "gguf":
            if src is None:
                raise ValueError(
                    f"dtype 'gguf' keeps a GGUF's tensors as stored, but {model_dir} is not a "
                    "converted GGUF; use --quantize int8|int4 for HF checkpoints"
                )
            state = gguf_state_dict(src, *heads, packed=True)  # (through the tile cache)
        else:
            if src is not None and not has_dense_weights(model_dir):
                state = dense_state_dict(src, *heads)  # dequantized from the GGUF, no copy kept
            else:
                state = load_state_dict(model_dir)
            if fmt is not None:
                state = quantize_state(state, fmt)
        return DecoderModel(config, state, device, dtype)
