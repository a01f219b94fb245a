"""A GGUF's tensors as stored: Q4_0/Q4_1/Q8_0 matrices stay packed (`QuantWeight`), the rest
(norms, F32/F16 matrices, and quant types the kernel lacks, e.g. K-quants) become float32.

Names and the Llama Q/K row order are mapped exactly as `gguf_convert` maps them for the
float32 directory, so both load into the same decoder. llama.cpp's Q/K row permutation is
undone on the packed rows directly: it moves whole rows, never data inside a row.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .gguf_convert import hf_tensor_name, unpermute_qk
from .quant import BLOCK_BYTES, QuantWeight

SOURCE_FILE = "radixlm_source.json"  # written beside a converted directory by gguf_convert


def source_gguf(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted model directory came from, or None for an HF checkpoint."""
    p = Path(model_dir) / SOURCE_FILE
    if not p.is_file():
        return None
    with open(p, encoding="utf-8") as f:
        src = Path(json.load(f)["gguf"])
    return src if src.is_file() else None


def gguf_state_dict(
    gguf_path: str | Path, num_heads: int, num_kv_heads: int, permute_qk: bool
) -> dict[str, torch.Tensor | QuantWeight]:
    """HF-named tensors of `gguf_path`: packed `QuantWeight`s where the kernel supports the
    stored type, float32 tensors otherwise."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    state: dict[str, torch.Tensor | QuantWeight] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        qtype = int(t.tensor_type)
        packed = qtype in BLOCK_BYTES and len(t.shape) == 2
        if packed:
            data = np.asarray(t.data)
        else:
            data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if permute_qk and t.name.endswith("attn_q.weight"):
            data = unpermute_qk(data, num_heads)
        elif permute_qk and t.name.endswith("attn_k.weight"):
            data = unpermute_qk(data, num_kv_heads)
        tensor = torch.from_numpy(np.array(data, copy=True, order="C"))  # off the read-only mmap
        if packed:
            rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims innermost first
            state[name] = QuantWeight(tensor.view(rows, -1), qtype, rows, cols)
        else:
            state[name] = tensor.float()
    return state
