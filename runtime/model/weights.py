"""Reading tensors out of an HF model directory (single or sharded safetensors), and the
text decoder's tensors of a multimodal checkpoint (`text_decoder_tensors`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of an HF directory: the shards its index names, or every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"missing weight shards: {', '.join(missing)}")
    return files


def iter_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` for every tensor of the checkpoint, on CPU, in stored dtype."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(model_dir))


# Gemma 3's multimodal checkpoints hold the text decoder under a prefix (transformers 4:
# `language_model.model.*`, 5: `model.language_model.*`) beside the vision tower and its
# projector, which a text decoder does not use.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))  # fmt: skip
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")  # fmt: skip


def text_decoder_tensors(state: dict) -> dict:
    """`state` with a multimodal checkpoint's text-decoder names made plain and its vision
    tensors left out; other checkpoints' states are returned as they are."""
    if not any(name.startswith(p) for name in state for p, _ in _TEXT_PREFIXES):
        return state
    out = {}
    for name, t in state.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, plain in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = plain + name[len(prefix) :]
                break
        out[name] = t
    return out
