"""`ModelConfig`: the one place an HF `config.json` becomes the decoder's frozen settings.

Supported families (one decoder, no file per family):

| `model_type` | what differs                                                   |
|--------------|----------------------------------------------------------------|
| `llama`      | reference (Llama 2/3, SmolLM2); optional `attention_bias`/`mlp_bias` |
| `mistral`    | as llama (dense); `sliding_window` is recorded, not applied      |
| `qwen2`      | bias on q/k/v (not o)                                           |
| `qwen3`      | RMSNorm over each q/k head before RoPE; explicit `head_dim`      |
| `qwen3_moe`, `qwen2_moe`, `mixtral` | attention as qwen3 / qwen2 / mistral; mixture-of-experts MLPs (`moe`, moe_config.py) |

RoPE parameters are read from either spelling transformers has used: `rope_theta` +
`rope_scaling` (4.x) or `rope_parameters` (5.x).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .moe_config import MOE_MODEL_TYPES, MoeConfig, moe_from_hf

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
# Mixture-of-experts families: their attention is that of a dense family's.
_ATTENTION_OF = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this decoder does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings (HF names, flattened)."""

    theta: float = 10000.0
    type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs, read once from an HF config dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    moe: MoeConfig | None = None  # mixture-of-experts MLPs (moe_config.py); None: dense
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = ""
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `<model_dir>/config.json`."""
        path = Path(model_dir) / "config.json"
        with open(path, encoding="utf-8") as f:
            return cls.from_hf(json.load(f))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from an HF `config.json` dict; raises `UnsupportedModelError` for other models."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; radixlm runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        family = _ATTENTION_OF.get(model_type, model_type)
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        head_dim = cfg.get("head_dim") or hidden // num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        max_pos = int(cfg.get("max_position_embeddings", 2048))

        if family == "qwen2":
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        else:
            bias = bool(cfg.get("attention_bias", False))
            qkv_bias, o_bias = bias, bias

        sliding = None
        if family == "mistral" or (
            family in ("qwen2", "qwen3") and cfg.get("use_sliding_window")
        ):
            sliding = cfg.get("sliding_window")

        eos = cfg.get("eos_token_id")
        eos_ids: tuple[int, ...] = ()
        if isinstance(eos, int):
            eos_ids = (eos,)
        elif isinstance(eos, (list, tuple)):
            eos_ids = tuple(int(e) for e in eos)

        archs = cfg.get("architectures") or []
        tie = cfg.get("tie_word_embeddings", False)  # every supported family defaults to untied
        num_layers = int(cfg["num_hidden_layers"])
        try:
            moe = moe_from_hf(cfg, model_type, num_layers)
        except (KeyError, TypeError, ValueError) as e:
            raise UnsupportedModelError(f"{model_type} experts: {e}") from e
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(cfg, max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(tie),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            moe=moe,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=archs[0] if archs else "",
            hf_config=dict(cfg),
        )


def _rope_from_hf(cfg: dict[str, Any], max_pos: int) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type rope_parameters are not supported")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    orig = merged.get(
        "original_max_position_embeddings", cfg.get("original_max_position_embeddings")
    )
    if rope_type in ("llama3", "yarn") and orig is None:
        orig = max_pos
    factor = merged.get("factor")
    if factor is None:
        factor = max_pos / orig if (rope_type == "yarn" and orig) else 1.0
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(factor),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        attention_factor=(
            float(merged["attention_factor"])
            if merged.get("attention_factor") is not None
            else None
        ),
        truncate=bool(merged.get("truncate", True)),
    )
