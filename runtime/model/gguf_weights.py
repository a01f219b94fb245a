"""A GGUF's tensors as stored: Q4_0/Q4_1/Q8_0 matrices stay packed (`QuantWeight`): their
rows are addresses in a read-only mapping of the file (`gguf_file`), stacked and reordered
without a copy, until the decoder packs each once into the kernel's tile layout (the same
bytes; the mapping then goes with the last reference to it). The rest (norms, F32/F16 matrices, and quant types the kernel lacks, e.g. K-quants) become
float32 tensors. `dense_state_dict` dequantizes everything to float32 instead, for dense
weights (`--dtype float32`) straight from the file, no cached float32 copy needed.

Names and the Llama Q/K row order are mapped exactly as `gguf_convert` maps them, by the
file's architecture: llama.cpp's Q/K row permutation moves whole rows, so for packed
weights it is undone by reordering the row addresses (`QuantWeight.take_rows`), never by
moving data; Gemma's norms lose the 1 llama.cpp added to them (gguf_families). A
mixture-of-experts model's 3-D expert tensors become one weight per expert, over that
expert's slab of rows (`_expert_weights`): packed where the kernel has the type, no copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .gguf_convert import hf_expert_names, hf_tensor_name, unpermute_qk
from .gguf_families import NORM_SHIFT
from .gguf_file import GGUFFile, TensorInfo
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


def _qk_heads(info: TensorInfo, num_heads: int, num_kv_heads: int, permute: bool) -> int | None:
    if permute and info.name.endswith("attn_q.weight"):
        return num_heads
    if permute and info.name.endswith("attn_k.weight"):
        return num_kv_heads
    return None


def _floats(f: GGUFFile, info: TensorInfo) -> np.ndarray:
    if info.ggml_type in (0, 1, 30):  # F32, F16, BF16
        return f.floats(info)
    import gguf  # other block types: gguf-py's numpy dequantization (only then imported)

    data = f.data(info).reshape(info.shape[0], -1) if len(info.shape) == 2 else f.data(info)
    out = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(info.ggml_type))
    return np.asarray(out, dtype=np.float32).reshape(info.shape)


def _expert_weights(f: GGUFFile, info: TensorInfo, model_type: str
                    ) -> dict[str, torch.Tensor | QuantWeight]:  # fmt: skip
    """A 3-D expert tensor `[experts, rows, cols]` as one HF-named weight per expert."""
    experts, rows, cols = info.shape
    names = hf_expert_names(info.name, experts, model_type)
    if info.ggml_type in BLOCK_BYTES:
        slabs = f.data(info).reshape(experts, rows, -1)
        return {n: QuantWeight(slabs[e], info.ggml_type, rows, cols) for e, n in enumerate(names)}
    data = torch.from_numpy(np.ascontiguousarray(_floats(f, info)))
    return dict(zip(names, data.unbind(0), strict=True))


def gguf_state_dict(
    gguf_path: str | Path, num_heads: int, num_kv_heads: int, permute_qk: bool,
    model_type: str = "",
) -> dict[str, torch.Tensor | QuantWeight]:
    """HF-named tensors of `gguf_path`: `QuantWeight`s over the mapped file where the kernel
    supports the stored type, float32 tensors otherwise (`model_type`: the HF family,
    which names a mixture-of-experts model's expert tensors)."""
    f = GGUFFile(gguf_path)
    arch = f.get("general.architecture", "llama")
    shift = NORM_SHIFT.get(arch, 0.0)
    state: dict[str, torch.Tensor | QuantWeight] = {}
    for info in f.tensors:
        if len(info.shape) == 3:
            state.update(_expert_weights(f, info, model_type))
            continue
        name = hf_tensor_name(info.name, model_type, arch)
        if name is None:
            continue
        heads = _qk_heads(info, num_heads, num_kv_heads, permute_qk)
        if info.ggml_type in BLOCK_BYTES and len(info.shape) == 2:
            rows, cols = info.shape
            w = QuantWeight(f.data(info).reshape(rows, -1), info.ggml_type, rows, cols)
            if heads is not None:
                w = w.take_rows(unpermute_qk(np.arange(rows), heads))
            state[name] = w
        else:
            data = _floats(f, info)
            if heads is not None:
                data = unpermute_qk(data, heads)
            if shift and name.endswith("norm.weight"):
                data = data - np.float32(shift)
            state[name] = torch.from_numpy(np.ascontiguousarray(data))
    return state


def dense_state_dict(
    gguf_path: str | Path, num_heads: int, num_kv_heads: int, permute_qk: bool,
    model_type: str = "",
) -> dict[str, torch.Tensor]:
    """Every tensor of `gguf_path` dequantized to float32 (HF names, HF Q/K row order)."""
    state = gguf_state_dict(gguf_path, num_heads, num_kv_heads, permute_qk, model_type)
    return {k: v.dequantize() if isinstance(v, QuantWeight) else v for k, v in state.items()}
