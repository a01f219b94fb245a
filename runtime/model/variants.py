"""`Variations`: how a family's decoder differs from Llama's, read from an HF config in one
place (`variations_from_hf`). The decoder, the attention backends and the fused decode
step read these fields; a Llama, Mistral or Qwen config has the defaults (none apply).

| family            | variations                                                        |
|-------------------|-------------------------------------------------------------------|
| Gemma 2           | GeGLU (gelu-tanh), (1 + w) RMSNorm, embeddings x sqrt(hidden),     |
|                   | sandwich norms, query_pre_attn_scalar, attention and logit        |
|                   | soft-caps, every other layer on a sliding window                  |
| Gemma 3 (text)    | as Gemma 2 without the attention soft-cap; q/k norms; five of six |
|                   | layers sliding, with their own RoPE base (config.py `local_rope`) |
| Phi-3 / 3.5 / 4   | fused qkv_proj / gate_up_proj in the checkpoint (split by the     |
|                   | decoder's loader), longrope, partial rotary (rope.py)             |

Which layers slide follows transformers: `layer_types` when the config lists them, else
each family's rule (`_sliding_layers`). A sliding layer's query at position i attends
the keys at positions i - W + 1 .. i (W = `sliding_window`, the query's own included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA_TYPES = ("gemma2", "gemma3_text")
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


@dataclass(frozen=True)
class Variations:
    """The decoder's departures from Llama (defaults: none)."""

    mlp_act: str = "silu"  # "silu" or "gelu_tanh" (Gemma's GeGLU)
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + w); added to w at load
    embed_scale: float | None = None  # Gemma: input embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2/3: RMSNorm on the attention and MLP outputs too
    query_scale: float | None = None  # attention scale (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    sliding_layers: tuple[bool, ...] = ()  # per layer: attends `sliding_window` tokens

    @property
    def is_plain(self) -> bool:
        """No variation a Llama-shaped step would miss (windows aside)."""
        return self == Variations(sliding_layers=self.sliding_layers)


def hidden_act(cfg: dict[str, Any]) -> str:
    """The MLP activation, "silu" or "gelu_tanh"; raises ValueError for others."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act in ("silu", "swish"):
        return "silu"
    if act in GELU_TANH_NAMES:
        return "gelu_tanh"
    raise ValueError(f"hidden_act {act!r} is not supported (silu, gelu_pytorch_tanh)")


def variations_from_hf(cfg: dict[str, Any], model_type: str, num_layers: int,
                       sliding_window: int | None) -> Variations:  # fmt: skip
    """The variations of `cfg` (an HF text config dict, defaults filled in)."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (EmbeddingGemma, an encoder) is not "
                         "supported: radixlm runs causal decoders")  # fmt: skip
    sliding = _sliding_layers(cfg, model_type, num_layers) if sliding_window else ()
    if model_type not in GEMMA_TYPES:
        return Variations(mlp_act=hidden_act(cfg), sliding_layers=sliding)
    scalar = cfg.get("query_pre_attn_scalar")
    return Variations(
        mlp_act=hidden_act(cfg),
        norm_offset=1.0,
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        sandwich_norms=True,
        query_scale=float(scalar) ** -0.5 if scalar else None,
        # Gemma 3's attention ignores attn_logit_softcapping (transformers passes none).
        attn_softcap=_positive(cfg.get("attn_logit_softcapping")) if model_type == "gemma2" else None,
        final_softcap=_positive(cfg.get("final_logit_softcapping")),
        sliding_layers=sliding,
    )


def sliding_window_of(cfg: dict[str, Any], model_type: str) -> int | None:
    """The window size transformers applies (None: full attention everywhere)."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        return None
    return int(window)


def _sliding_layers(cfg: dict[str, Any], model_type: str, n: int) -> tuple[bool, ...]:
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {n}")
        return tuple(t == "sliding_attention" for t in types)
    if model_type == "gemma2":
        return tuple(bool((i + 1) % 2) for i in range(n))
    if model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return tuple(bool((i + 1) % pattern) for i in range(n))
    if model_type in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", 28))
        return tuple(i >= first for i in range(n))
    return (True,) * n  # mistral, phi3: every layer


def _positive(v: Any) -> float | None:
    return float(v) if v else None


# Defaults of the transformers config classes for the fields a checkpoint may leave out
# (Gemma 3's multimodal checkpoints give only part of their text_config).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
        query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1_000_000.0,
        rope_local_base_freq=10000.0, query_pre_attn_scalar=256, sliding_window=4096,
        sliding_window_pattern=6,
    ),
    "phi3": dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, hidden_act="silu", max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
    ),
}  # fmt: skip


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config: Gemma 3's multimodal checkpoints (model_type "gemma3")
    nest it as `text_config`; the family's defaults fill the fields left out."""
    if cfg.get("model_type") == "gemma3":
        inner = dict(cfg.get("text_config") or {})
        inner["model_type"] = "gemma3_text"
        for key in ("eos_token_id", "bos_token_id", "architectures"):
            if key in cfg and key not in inner:
                inner[key] = cfg[key]
        if "tie_word_embeddings" in cfg:
            inner.setdefault("tie_word_embeddings", cfg["tie_word_embeddings"])
        cfg = inner
    defaults = FAMILY_DEFAULTS.get(str(cfg.get("model_type")))
    if defaults:
        cfg = {**defaults, **cfg}
    return cfg
