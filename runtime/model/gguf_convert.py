"""GGUF → HF-style directory (config.json, tokenizer, generation config; weights on demand).

The directory holds what the GGUF's metadata says (config, tokenizer rebuilt from its
vocabulary, chat template, generation config) and `radixlm_source.json` naming the file.
It holds no weights: packed blocks are read from the GGUF itself (`gguf_weights`, mapped,
not copied), and dense loads dequantize from it at load time. Only tools that need an HF
checkpoint on disk (transformers' `from_pretrained`, the tests' references) ask for
`ensure_dense_weights`, which writes a dequantized `model.safetensors` (float32 for models
up to 2B parameters, bfloat16 above) into the same directory once. Conversion writes into
a temporary directory beside the target and renames it into place, under a file lock:
two processes starting together convert once and never see a half-written directory.
The cache key carries `CONVERTER_VERSION`, so directories written by an older converter
(which held a float32 copy of every weight) are neither read nor overwritten.

Architectures: llama (Llama/Mistral/SmolLM2; llama.cpp's Q/K row permutation is undone;
with experts, Mixtral), qwen2, qwen3, and the mixture-of-experts qwen2moe and qwen3moe:
the experts' 3-D tensors (`ffn_{gate,up,down}_exps`, one `[rows, cols]` slab per expert)
become HF's per-expert names (`moe_tensors`); and gemma2, gemma3, phi3 (their names and
metadata: gguf_families.py). Tokenizer: gpt2-style byte-level BPE, rebuilt from the GGUF's
tokens, merges, token types and special ids the same way transformers' own GGUF loader
does, or a SentencePiece vocabulary (`llama`: Gemma, Phi-3) as llama.cpp tokenizes it
(gguf_spm.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from . import gguf_families
from .config import UnsupportedModelError
from .moe_config import EXPERT_NAMES

log = logging.getLogger(__name__)

CONVERTER_VERSION = 2  # 2: no weights in the directory (1 held a float32 copy)
SHARD_BYTES = 2 * 1024**3
F32_MAX_PARAMS = 2_000_000_000

_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    **gguf_families.ARCHS,
}
# HF model types whose GGUF (arch "llama") stores Q/K rows in llama.cpp's permuted order.
QK_PERMUTED = ("llama", "mixtral")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_SKIP = {"rope_freqs.weight"}

# Pre-tokenizer splits by `tokenizer.ggml.pre` (as transformers' GGUF loader uses them);
# other values keep the plain GPT-2 byte-level pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}  # fmt: skip


# ---------------------------------------------------------------------------- metadata


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str],
                        rope_factors=lambda name: None) -> dict[str, Any]:  # fmt: skip
    """The HF config of a GGUF's metadata; `rope_factors(name)` reads a factor tensor's
    values (Phi-3's longrope factors are tensors, not metadata)."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})"
        )
    hf_arch, model_type = _ARCHS[arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    if arch == "llama" and get("expert_count"):
        hf_arch, model_type = "MixtralForCausalLM", "mixtral"

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedModelError("per-layer KV head counts are not supported")
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length") or get("expert_feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": model_type != "llama" and "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if model_type in ("qwen3", "qwen3_moe"):
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if model_type == "qwen2_moe":
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    cfg.update(_moe_config(model_type, get, int(get("block_count")), tensor_names))
    if model_type == "llama" and "blk.0.attn_q.bias" in tensor_names:
        raise UnsupportedModelError("llama GGUFs with attention biases are not supported")
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        factor = float(get("rope.scaling.factor", 1.0))
        rs: dict[str, Any] = {"rope_type": scaling, "factor": factor}
        orig = get("rope.scaling.original_context_length")
        if orig:
            rs["original_max_position_embeddings"] = int(orig)
        if scaling not in ("linear", "yarn", "longrope"):
            raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
        if scaling != "longrope":  # longrope's factors are tensors (gguf_families)
            cfg["rope_scaling"] = rs
    if "rope_freqs.weight" in tensor_names:
        log.warning(
            "GGUF carries rope_freqs (llama3-style RoPE scaling) whose parameters it does not "
            "store; they are ignored, so contexts beyond the original length may degrade"
        )
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):  # fmt: skip
        if f"tokenizer.ggml.{key}" in meta:
            cfg[name] = int(meta[f"tokenizer.ggml.{key}"])
    if arch in gguf_families.ARCHS:
        cfg = gguf_families.family_config(arch, get, cfg, rope_factors)
    return cfg


def _moe_config(model_type: str, get, layers: int, tensor_names: set[str]) -> dict[str, Any]:
    """The HF config keys of a mixture-of-experts GGUF (none for dense ones). Layers
    without a router (`ffn_gate_inp`) are dense (Qwen's `mlp_only_layers`)."""
    if model_type not in EXPERT_NAMES:
        return {}
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    out: dict[str, Any] = {"num_experts_per_tok": int(get("expert_used_count"))}
    if model_type == "mixtral":
        if dense:
            raise UnsupportedModelError(f"llama GGUF with experts: layers {dense} have none")
        return {**out, "num_local_experts": int(get("expert_count"))}
    out.update(num_experts=int(get("expert_count")), decoder_sparse_step=1, mlp_only_layers=dense,
               moe_intermediate_size=int(get("expert_feed_forward_length")),
               # llama.cpp renormalises qwen3moe's top-k weights, never qwen2moe's
               norm_topk_prob=bool(get("expert_weights_norm", model_type == "qwen3_moe")))  # fmt: skip
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    return out


# ---------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def build_tokenizer(meta: dict[str, Any]):
    """A `tokenizers.Tokenizer` from GGUF tokenizer metadata (gpt2-style BPE or SentencePiece)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        from .gguf_spm import spm_tokenizer

        return _with_bos(spm_tokenizer(meta), meta)
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', "
            "SentencePiece 'llama')"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if not set(tok) <= alphabet:
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(
            add_prefix_space=False, trim_offsets=True, use_regex=True
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == 3 and set(t) <= alphabet
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == 4 and t in vocab
    ]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    return _with_bos(tok, meta)


def _adds_bos(meta: dict[str, Any]) -> bool:
    """`tokenizer.ggml.add_bos_token`; llama.cpp adds one to SentencePiece vocabularies
    that do not say."""
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


def _with_bos(tok, meta: dict[str, Any]):
    """`tok` with a post-processor that puts the BOS token first, if the file asks."""
    from tokenizers import processors

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if _adds_bos(meta) and bos_id is not None:
        bos = meta["tokenizer.ggml.tokens"][int(bos_id)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    return tok


def tokenizer_config_from_gguf(meta: dict[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]

    def tok(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("bos_token_id"),
        "eos_token": tok("eos_token_id"),
        "unk_token": tok("unknown_token_id"),
        "pad_token": tok("padding_token_id"),
        "add_bos_token": _adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


def generation_config_from_gguf(meta: dict[str, Any]) -> dict[str, Any]:
    gen: dict[str, Any] = {}
    if "tokenizer.ggml.bos_token_id" in meta:
        gen["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    eos = []
    for key in ("eos_token_id", "eot_token_id"):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "tokenizer.ggml.padding_token_id" in meta:
        gen["pad_token_id"] = int(meta["tokenizer.ggml.padding_token_id"])
    return gen


# ---------------------------------------------------------------------------- tensors


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Llama Q/K rows (interleaved → HF rotate-half order)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def hf_tensor_name(name: str, model_type: str = "", arch: str = "llama") -> str | None:
    """The HF name of GGUF tensor `name` in a file of architecture `arch` (None: not a
    weight of the decoder's); `model_type` names a mixture-of-experts family's router
    and shared expert."""
    if name in _SKIP or name in gguf_families.SKIP.get(arch, ()):
        return None
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    layer_names = gguf_families.LAYER_NAMES.get(arch, {})
    if len(parts) == 3 and parts[0] == "blk":
        hf = layer_names.get(parts[2]) or _LAYER_NAMES.get(parts[2])
        if hf is not None:
            return f"model.layers.{parts[1]}.{hf}"
    if len(parts) == 3 and parts[0] == "blk" and model_type in EXPERT_NAMES:
        block = EXPERT_NAMES[model_type][0]
        if parts[2] in _MOE_NAMES:
            return f"model.layers.{parts[1]}.{block}.{_MOE_NAMES[parts[2]]}"
    raise UnsupportedModelError(f"GGUF tensor {name!r} has no place in the decoder")


# A sparse block's 2-D tensors (after the block's prefix, see moe_config.EXPERT_NAMES).
_MOE_NAMES = {
    "ffn_gate_inp.weight": "gate.weight",
    "ffn_gate_inp_shexp.weight": "shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "shared_expert.down_proj.weight",
}
_EXPERT_PROJ = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}


def hf_expert_names(name: str, num_experts: int, model_type: str) -> list[str]:
    """HF names of expert 0..num_experts-1's slab of the 3-D GGUF tensor `name`
    (`blk.N.ffn_{gate,up,down}_exps.weight`, experts outermost)."""
    parts = name.split(".", 2)
    if model_type not in EXPERT_NAMES or len(parts) != 3 or parts[2] not in _EXPERT_PROJ:
        raise UnsupportedModelError(f"GGUF tensor {name!r} has no place in the decoder")
    block, projs = EXPERT_NAMES[model_type]
    proj = projs[_EXPERT_PROJ[parts[2]]]
    return [f"model.layers.{parts[1]}.{block}.experts.{e}.{proj}.weight" for e in range(num_experts)]


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write `gguf_path`'s config, tokenizer and generation config into `out_dir` (created;
    should be new). `progress` is accepted for the callers' sake: this takes ~a second."""
    from .gguf_file import GGUFFile

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    f = GGUFFile(gguf_path)
    meta = f.metadata()
    names = {t.name for t in f.tensors}
    infos = {t.name: t for t in f.tensors}

    def rope_factors(name: str) -> list[float] | None:
        return f.floats(infos[name]).reshape(-1).tolist() if name in infos else None

    config = hf_config_from_gguf(meta, names, rope_factors)
    if "token_embd.weight" in infos:  # the rows the model has (Gemma 3's files drop unused ones)
        config["vocab_size"] = int(infos["token_embd.weight"].shape[0])
    n_params = sum(math.prod(t.shape) for t in f.tensors)
    config["torch_dtype"] = "float32" if n_params <= F32_MAX_PARAMS else "bfloat16"
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config_from_gguf(meta))
    _write_json(out_dir / "generation_config.json", generation_config_from_gguf(meta))
    _write_json(out_dir / "config.json", config)
    return out_dir


def write_dense_weights(gguf_path: str | Path, out_dir: str | Path, config: dict[str, Any],
                        progress: bool = True) -> None:
    """Dequantize every tensor of `gguf_path` into `out_dir`'s safetensors (HF names, HF
    Q/K order, `config["torch_dtype"]`), sharded every SHARD_BYTES."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from .gguf_weights import dense_state_dict

    out_dir = Path(out_dir)
    dtype = getattr(torch, config.get("torch_dtype", "float32"))
    permute = config["model_type"] in QK_PERMUTED
    state = dense_state_dict(gguf_path, config["num_attention_heads"],
                             config["num_key_value_heads"], permute, config["model_type"])  # fmt: skip
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_files = 0, []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        fname = f"model-{len(shard_files) + 1:05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        shard_files.append(fname)
        weight_map.update(dict.fromkeys(shard, fname))
        shard, shard_bytes = {}, 0

    for name in tqdm(list(state), desc=f"Dequantizing {Path(gguf_path).name}", unit="tensor",
                     disable=not progress):  # fmt: skip
        tensor = state.pop(name).to(dtype).contiguous()
        shard[name] = tensor
        shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    if len(shard_files) == 1:
        os.replace(out_dir / shard_files[0], out_dir / "model.safetensors")
    else:
        total = sum((out_dir / f).stat().st_size for f in shard_files)
        _write_json(
            out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---------------------------------------------------------------------------- cache


def cache_root() -> Path:
    """`$RADIXLM_CACHE_DIR`, else `$XDG_CACHE_HOME/radixlm`, else `~/.cache/radixlm`."""
    env = os.environ.get("RADIXLM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "radixlm"


def converted_dir_for(gguf_path: str | Path) -> Path:
    """Where the conversion of `gguf_path` lives (keyed by path, size, mtime, converter)."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{p.stem}-{digest}"


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def ensure_converted(gguf_path: str | Path, progress: bool = True) -> Path:
    """The cached HF directory for `gguf_path`, converting it first if needed (atomically)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    final = converted_dir_for(gguf_path)
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if (final / "config.json").exists():  # another process finished while we waited
            return final
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            convert_gguf(gguf_path, tmp, progress=progress)
            _write_json(
                tmp / "radixlm_source.json",
                {"gguf": str(gguf_path.resolve()), "converter_version": CONVERTER_VERSION},
            )
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def has_dense_weights(model_dir: str | Path) -> bool:
    d = Path(model_dir)
    return (d / "model.safetensors").exists() or (d / "model.safetensors.index.json").exists()


def ensure_dense_weights(model_dir: str | Path, progress: bool = True) -> Path:
    """`model_dir` (a converted GGUF) with dequantized safetensors written beside its
    config, for tools that need an HF checkpoint on disk (transformers' `from_pretrained`);
    radixlm itself never needs them. Atomic and locked like the conversion."""
    model_dir = Path(model_dir)
    if has_dense_weights(model_dir):
        return model_dir
    from .gguf_weights import source_gguf

    src = source_gguf(model_dir)
    if src is None:
        raise FileNotFoundError(f"{model_dir} has no weights and names no GGUF to read them from")
    with _file_lock(model_dir.parent / f".{model_dir.name}.lock"):
        if has_dense_weights(model_dir):
            return model_dir
        tmp = model_dir / f".tmp-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            with open(model_dir / "config.json", encoding="utf-8") as f:
                config = json.load(f)
            write_dense_weights(src, tmp, config, progress=progress)
            files = sorted(p.name for p in tmp.iterdir())
            for name in files:  # the index (if any) last: its presence means "complete"
                if name != "model.safetensors.index.json":
                    os.replace(tmp / name, model_dir / name)
            if "model.safetensors.index.json" in files:
                os.replace(tmp / "model.safetensors.index.json",
                           model_dir / "model.safetensors.index.json")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir
