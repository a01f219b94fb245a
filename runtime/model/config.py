"""`ModelConfig`: the one place an HF `config.json` becomes the decoder's frozen settings.

Supported families (one decoder, no file per family):

| `model_type` | what differs                                                   |
|--------------|----------------------------------------------------------------|
| `llama`      | reference (Llama 2/3, SmolLM2); optional `attention_bias`/`mlp_bias` |
| `mistral`    | as llama (dense); every layer on its `sliding_window`           |
| `qwen2`      | bias on q/k/v (not o)                                           |
| `qwen3`      | RMSNorm over each q/k head before RoPE; explicit `head_dim`      |
| `qwen3_moe`, `qwen2_moe`, `mixtral` | attention as qwen3 / qwen2 / mistral; mixture-of-experts MLPs (`moe`, moe_config.py) |
| `gemma2`     | `Variations` (variants.py): GeGLU, (1 + w) norms, sandwich norms, soft-caps, alternating sliding layers |
| `gemma3_text`| as gemma2 without the attention soft-cap, with q/k norms and a local RoPE base for sliding layers (`local_rope`); `gemma3` (multimodal) checkpoints run as their text decoder |
| `phi3`       | fused qkv/gate_up in the checkpoint; longrope ("su") scaling; partial rotary (Phi-4-mini) |

RoPE parameters are read from either spelling transformers has used: `rope_theta` +
`rope_scaling` (4.x) or `rope_parameters` (5.x), flat or per layer type (Gemma 3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .moe_config import MOE_MODEL_TYPES, MoeConfig, moe_from_hf
from .variants import Variations, hidden_act, sliding_window_of, text_config, variations_from_hf

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES,
                         "gemma2", "gemma3_text", "gemma3", "phi3")  # fmt: skip
# Mixture-of-experts families: their attention is that of a dense family's.
_ATTENTION_OF = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "mistral"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "su")


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
    attention_factor: float | None = None  # yarn, longrope
    truncate: bool = True
    # longrope ("su", Phi-3): per-frequency divisors, short below the original context
    long_factor: tuple[float, ...] | None = None
    short_factor: tuple[float, ...] | None = None
    partial_rotary_factor: float = 1.0  # the share of each head's dims RoPE rotates


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
    # Gemma 3: the RoPE of the sliding-window layers (None: `rope` for every layer)
    local_rope: RopeConfig | None = None
    variations: Variations = field(default_factory=Variations)
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within (None: the whole context)."""
        sliding = self.variations.sliding_layers
        return self.sliding_window if sliding and sliding[layer] else None

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE of layer `layer` (Gemma 3's sliding layers have their own base)."""
        if self.local_rope is not None and self.layer_window(layer) is not None:
            return self.local_rope
        return self.rope

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
        cfg = text_config(cfg)
        model_type = cfg["model_type"]
        family = _ATTENTION_OF.get(model_type, model_type)
        try:
            hidden_act(cfg)
        except ValueError as e:
            raise UnsupportedModelError(str(e)) from None
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

        sliding = sliding_window_of(cfg, family)
        num_layers = int(cfg["num_hidden_layers"])
        try:
            variations = variations_from_hf(cfg, family, num_layers, sliding)
        except ValueError as e:
            raise UnsupportedModelError(str(e)) from None
        rope, local_rope = _ropes_from_hf(cfg, max_pos, int(head_dim), model_type)

        eos = cfg.get("eos_token_id")
        eos_ids: tuple[int, ...] = ()
        if isinstance(eos, int):
            eos_ids = (eos,)
        elif isinstance(eos, (list, tuple)):
            eos_ids = tuple(int(e) for e in eos)

        archs = cfg.get("architectures") or []
        tie = cfg.get("tie_word_embeddings", False)  # Gemma's default (True) is in text_config
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
            rope=rope,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(tie),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "gemma3_text"),
            sliding_window=sliding,
            moe=moe,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=archs[0] if archs else "",
            hf_config=dict(cfg),
            local_rope=local_rope,
            variations=variations,
        )


def _ropes_from_hf(cfg: dict[str, Any], max_pos: int, head_dim: int,
                   model_type: str) -> tuple[RopeConfig, RopeConfig | None]:  # fmt: skip
    """`(rope, local_rope)`: the global RoPE and, for Gemma 3, its sliding layers' own."""
    params = cfg.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        unknown = set(params) - {"full_attention", "sliding_attention"}
        if unknown or "full_attention" not in params:
            raise UnsupportedModelError(f"per-layer-type rope_parameters {sorted(params)} "
                                        "are not supported")  # fmt: skip
        rope = _rope_from_hf({**cfg, "rope_parameters": params["full_attention"]}, max_pos, head_dim)
        local = params.get("sliding_attention")
        if local is None or model_type != "gemma3_text":
            return rope, None
        return rope, _rope_from_hf({**cfg, "rope_parameters": local, "rope_scaling": None},
                                   max_pos, head_dim)  # fmt: skip
    rope = _rope_from_hf(cfg, max_pos, head_dim)
    if model_type != "gemma3_text":
        return rope, None
    base = float(cfg.get("rope_local_base_freq") or 10000.0)
    return rope, RopeConfig(theta=base)


def _rope_from_hf(cfg: dict[str, Any], max_pos: int, head_dim: int) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = float(merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if not 0 < partial <= 1 or int(head_dim * partial) % 2:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} does not rotate an even "
                                    f"number of head_dim={head_dim}'s dims")  # fmt: skip
    orig = merged.get(
        "original_max_position_embeddings", cfg.get("original_max_position_embeddings")
    )
    if rope_type in ("longrope", "su"):
        # Phi-3's rule (as transformers): the top-level value wins over the rope dict's.
        rope_type = "longrope"
        orig = cfg.get("original_max_position_embeddings") or orig or max_pos
    if rope_type in ("llama3", "yarn") and orig is None:
        orig = max_pos
    factor = merged.get("factor")
    if factor is None:
        scaled = rope_type in ("yarn", "longrope") and orig
        factor = max_pos / orig if scaled else 1.0
    long_factor = short_factor = None
    if rope_type == "longrope":
        long_factor, short_factor = _longrope_factors(merged, int(head_dim * partial))
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
        long_factor=long_factor,
        short_factor=short_factor,
        partial_rotary_factor=partial,
    )


def _longrope_factors(merged: dict[str, Any], rotary_dim: int
                      ) -> tuple[tuple[float, ...], tuple[float, ...]]:  # fmt: skip
    long_f, short_f = merged.get("long_factor"), merged.get("short_factor")
    if not long_f or not short_f:
        raise UnsupportedModelError("longrope scaling needs long_factor and short_factor")
    if len(long_f) != rotary_dim // 2 or len(short_f) != rotary_dim // 2:
        raise UnsupportedModelError(
            f"longrope factors have {len(long_f)} and {len(short_f)} entries; the rotary "
            f"dims ({rotary_dim}) need {rotary_dim // 2}"
        )
    return tuple(float(f) for f in long_f), tuple(float(f) for f in short_f)
