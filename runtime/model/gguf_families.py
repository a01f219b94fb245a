"""GGUF ↔ HF for the families whose llama.cpp layout differs from Llama's: gemma2, gemma3
and phi3 (the facts are llama.cpp's: its converter's tensor names and metadata keys, its
loader's defaults).

- Names: Gemma's four norms a layer are `attn_norm` (input), `post_attention_norm`,
  `ffn_norm` (HF's pre_feedforward_layernorm, not post_attention_layernorm as for Llama)
  and `post_ffw_norm`; Phi-3's fused projections are `attn_qkv` and `ffn_up` (gate then
  up rows), and its longrope factors the top-level `rope_factors_long` / `_short`.
- Gemma's RMSNorm weights are stored with the 1 of its (1 + w) added (`NORM_SHIFT`); the
  HF-named state has it taken off again, so both sources load alike.
- Metadata llama.cpp leaves out and infers: Gemma's sliding-window pattern (2 for gemma2,
  6 for gemma3, unless `attention.sliding_window_pattern` says), the local RoPE base of
  gemma3 (10000 unless `rope.freq_base_swa`), gemma2's soft-caps (50 / 30 unless given),
  and query_pre_attn_scalar: hidden / heads for the 27B models (gemma2 with 46 layers,
  gemma3 with 62), head_dim otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

ARCHS = {
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
_GEMMA_LAYER = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
}
LAYER_NAMES = {
    "gemma2": _GEMMA_LAYER,
    "gemma3": _GEMMA_LAYER,
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
SKIP = {"phi3": set(ROPE_FACTORS)}
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}
_PATTERN = {"gemma2": 2, "gemma3": 6}
_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gguf_arch_of(model_type: str) -> str | None:
    """The GGUF architecture name of an HF model type of these families (else None)."""
    return next((arch for arch, (_, mt) in ARCHS.items() if mt == model_type), None)


def family_config(arch: str, get: Callable[[str, Any], Any], cfg: dict[str, Any],
                  rope_factors: Callable[[str], list[float] | None]) -> dict[str, Any]:  # fmt: skip
    """`cfg` (gguf_convert's Llama-like HF config of the file) completed for `arch`;
    `get(key, default)` reads `<arch>.<key>`, `rope_factors(name)` a factor tensor."""
    if arch == "phi3":
        return _phi3(get, cfg, rope_factors)
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg.pop("hidden_act", None)
    n, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    big = n == _27B_LAYERS[arch]
    cfg["query_pre_attn_scalar"] = hidden // heads if big else cfg["head_dim"]
    window = get("attention.sliding_window", 4096 if arch == "gemma2" else None)
    pattern = get("attention.sliding_window_pattern", _PATTERN[arch])
    if window:
        cfg["sliding_window"] = int(window)
        if isinstance(pattern, list):  # per layer: true = sliding
            sliding = [bool(p) for p in pattern[:n]]
        else:  # llama.cpp's rule: layer i slides unless i % pattern == pattern - 1
            sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(n)]
        cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    else:
        cfg["sliding_window"] = None
        cfg["layer_types"] = ["full_attention"] * n
    if arch == "gemma2":
        cfg["attn_logit_softcapping"] = float(get("attn_logit_softcapping", 50.0))
        cfg["final_logit_softcapping"] = float(get("final_logit_softcapping", 30.0))
    else:
        cfg["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
        cfg["attn_logit_softcapping"] = None
        cap = get("final_logit_softcapping", None)
        cfg["final_logit_softcapping"] = float(cap) if cap else None
    return cfg


def _phi3(get: Callable[[str, Any], Any], cfg: dict[str, Any],
          rope_factors: Callable[[str], list[float] | None]) -> dict[str, Any]:  # fmt: skip
    # Phi-3 has no head_dim of its own (llama.cpp writes no key_length): hidden / heads;
    # rope.dimension_count is the rotated part (Phi-4-mini: 96 of 128).
    head_dim = get("attention.key_length", None) or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["head_dim"] = head_dim
    rot = get("rope.dimension_count", head_dim)
    if rot != head_dim:
        cfg["partial_rotary_factor"] = rot / head_dim
    window = get("attention.sliding_window", 0)
    cfg["sliding_window"] = int(window) if window else None  # 0: none (Phi-4)
    orig = get("rope.scaling.original_context_length", None)
    if orig:
        cfg["original_max_position_embeddings"] = int(orig)
    long_f, short_f = (rope_factors(name) for name in ROPE_FACTORS)
    if long_f and short_f:
        rs: dict[str, Any] = {"rope_type": "longrope", "long_factor": long_f, "short_factor": short_f}
        attn = get("rope.scaling.attn_factor", None)
        ratio = cfg["max_position_embeddings"] / (orig or cfg["max_position_embeddings"])
        usual = math.sqrt(1 + math.log(ratio) / math.log(orig)) if ratio > 1 else 1.0
        if attn and abs(float(attn) - usual) > 1e-4:  # (stored as float32: else the rule's)
            rs["attention_factor"] = float(attn)
        cfg["rope_scaling"] = rs
    return cfg
