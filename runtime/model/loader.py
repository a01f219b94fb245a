"""`load_model(model_dir, device, dtype)`: an HF-style directory → a ready `DecoderModel`."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig
from .decoder import DecoderModel
from .weights import load_state_dict

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
    if dtype in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def load_model(
    model_dir: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> DecoderModel:
    """Read config.json and the safetensors weights of `model_dir` into a `DecoderModel`."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    config = ModelConfig.from_dir(model_dir)
    with torch.inference_mode():
        return DecoderModel(config, load_state_dict(model_dir), device, dtype)
