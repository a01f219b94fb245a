"""Tiny random HF checkpoints for tests: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text)
and Phi-3 families.

    from tiny_models import make_tiny_checkpoint
    model_dir = make_tiny_checkpoint(tmp_path, arch="qwen3", tie_word_embeddings=True)

`make_tiny_checkpoint` writes, with transformers itself, a complete HF-style directory:
`config.json`, `generation_config.json`, `model.safetensors` (or shards + index when
`max_shard_size` is given), and a small byte-level BPE tokenizer (`tokenizer.json`,
`tokenizer_config.json` carrying a ChatML `chat_template`), so the whole engine can run on
it. Weights are random but deterministic per `seed`, scaled up from HF's tiny init (and
with non-trivial norm weights) so that attention patterns and norms actually matter in
comparisons. Special tokens: `<|endoftext|>`=0, `<|im_start|>`=1 (bos), `<|im_end|>`=2 (eos).

`TINY_VARIANTS` names configurations the model tests sweep (GQA, biases, q/k norms, tied and
untied embeddings, llama3 and linear RoPE scaling); `MOE_VARIANTS` the mixture-of-experts
ones (8 experts, top-2: Qwen3-MoE with a dense layer, Mixtral, Qwen2-MoE's shared expert).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# `chat="gemma"`: Gemma's special tokens (the same ids' roles: pad 0, bos 1, end of turn 2)
# and Gemma 3's chat template (system folded into the first user turn, roles alternating,
# "model" for the assistant, contents trimmed, BOS written by the template).
GEMMA_SPECIAL_TOKENS = ("<pad>", "<bos>", "<end_of_turn>", "<start_of_turn>", "<eos>")
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{- message['content'] | trim -}}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
_CHATS = {"chatml": (SPECIAL_TOKENS, CHAT_TEMPLATE), "gemma": (GEMMA_SPECIAL_TOKENS, GEMMA3_CHAT_TEMPLATE)}

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A radix tree keeps every prompt prefix.
Hello world! How are you today? I am fine, thank you. What is the weather like?
Once upon a time there was a small language model that lived in a test directory.
def main():\n    print("hello")\n    return 0\n
1234567890 + 42 = 1234567932. Sessions fork and join; tools are called with JSON.
"""

# Keyword overrides per family; ints keep the models tiny (2 layers, hidden 64).
_BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama"),
    "llama-tied-llama3rope": dict(
        arch="llama",
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "llama-linear-rope-bias": dict(
        arch="llama",
        attention_bias=True,
        mlp_bias=True,
        rope_scaling=dict(rope_type="linear", factor=2.0),
    ),
    "mistral": dict(arch="mistral", num_key_value_heads=1),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", head_dim=32),  # explicit head_dim != hidden / heads
    "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True, num_key_value_heads=4),
}

# Mixture of experts: 8 experts of width 32 (Mixtral: 96), 2 per token; 3 layers.
MOE_VARIANTS: dict[str, dict[str, Any]] = {
    # layer 1 dense (mlp_only_layers), top-k probabilities renormalised
    "qwen3_moe": dict(arch="qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1],
                      norm_topk_prob=True),
    "qwen3_moe-sparse-step": dict(arch="qwen3_moe", num_hidden_layers=3, decoder_sparse_step=2,
                                  norm_topk_prob=False, tie_word_embeddings=True),
    "mixtral": dict(arch="mixtral", num_hidden_layers=3),
    "qwen2_moe": dict(arch="qwen2_moe", num_hidden_layers=3, shared_expert_intermediate_size=64),
}
_MOE_BASE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


# Gemma 2/3 and Phi-3 with the variations that matter made to bite on short prompts: windows
# of a few tokens, soft-caps small enough for tanh to bend, a query_pre_attn_scalar other
# than head_dim, Gemma 3's two RoPE bases (and linear scaling on its global layers), Phi-3's
# longrope from position 24 on and Phi-4-mini's partial rotary.
FAMILY_VARIANTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(arch="gemma2", num_hidden_layers=3, sliding_window=6,
                   attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                   query_pre_attn_scalar=24),
    "gemma3": dict(arch="gemma3", num_hidden_layers=4, sliding_window=7,
                   sliding_window_pattern=2, rope_local_base_freq=500.0,
                   rope_scaling=dict(rope_type="linear", factor=2.0)),
    "phi3-longrope": dict(arch="phi3", original_max_position_embeddings=24,
                          rope_scaling=dict(type="longrope",
                                            long_factor=[1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 9.0, 11.0],
                                            short_factor=[1.0, 1.1, 1.2, 1.4, 1.6, 1.9, 2.2, 2.5])),
    "phi4-partial-rotary": dict(arch="phi3", partial_rotary_factor=0.75, sliding_window=9,
                                original_max_position_embeddings=24,
                                rope_scaling=dict(type="longrope",
                                                  long_factor=[1.0, 2.0, 3.0, 4.0, 6.0, 8.0],
                                                  short_factor=[1.0, 1.0, 1.5, 1.5, 2.0, 2.0])),
}  # fmt: skip


@lru_cache(maxsize=2)
def _tokenizer_json(specials: tuple[str, ...] = SPECIAL_TOKENS) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok.to_str()


def make_tiny_tokenizer(model_dir: str | Path, chat: str = "chatml") -> int:
    """Write tokenizer.json + tokenizer_config.json into `model_dir`: ChatML special tokens
    and template, or (`chat="gemma"`) Gemma's and Gemma 3's template.

    Returns the tokenizer's vocabulary size (the model's vocab must be at least that).
    """
    from tokenizers import Tokenizer

    specials, template = _CHATS[chat]
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    text = _tokenizer_json(specials)
    (model_dir / "tokenizer.json").write_text(text, encoding="utf-8")
    tok = Tokenizer.from_str(text)
    assert [tok.token_to_id(t) for t in specials] == list(range(len(specials)))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials[1],
        "eos_token": specials[2],
        "pad_token": specials[0],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": _BASE["max_position_embeddings"],
        "chat_template": template,
    }
    with open(model_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return tok.get_vocab_size()


def tiny_hf_config(arch: str = "llama", **overrides: Any):
    """A transformers config object for a tiny model of `arch` ("llama", "mistral", "qwen2",
    "qwen3"); `overrides` are config kwargs (e.g. `tie_word_embeddings=True`,
    `rope_scaling={...}`, `head_dim=32`, `num_hidden_layers=3`)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
    }
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(classes)}")
    kwargs: dict[str, Any] = dict(_BASE)
    kwargs.update(vocab_size=448, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0)
    kwargs.setdefault("tie_word_embeddings", False)
    if arch in ("qwen3", "qwen3_moe", "gemma2", "gemma3"):
        kwargs["head_dim"] = 16
    if arch in ("gemma2", "gemma3"):
        kwargs["query_pre_attn_scalar"] = 16
    if arch in ("qwen3_moe", "qwen2_moe"):
        kwargs.update(_MOE_BASE)
    if arch == "mixtral":
        kwargs.update(num_local_experts=8, num_experts_per_tok=2)
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def make_tiny_checkpoint(
    tmp_path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    name: str | None = None,
    with_tokenizer: bool = True,
    max_shard_size: str | int | None = None,
    init_scale: float = 5.0,
    chat: str = "chatml",
    **overrides: Any,
) -> Path:
    """Write a tiny random `arch` checkpoint into `tmp_path / name` and return that path.

    - `overrides`: HF config kwargs (see `tiny_hf_config`); `TINY_VARIANTS[v]` fits here as
      `make_tiny_checkpoint(tmp_path, **TINY_VARIANTS[v])`.
    - `max_shard_size`: e.g. "40KB" to get a sharded checkpoint with an index json.
    - `init_scale`: multiplies HF's random init (std 0.02) so the model is not near-uniform;
      norm weights become `1 + 0.2 * N(0, 1)`.
    - `with_tokenizer`: also write the byte-level BPE tokenizer (vocab <= 448), with the
      special tokens and chat template of `chat` ("chatml" or "gemma").
    Deterministic for a given `(arch, seed, overrides)`.
    """
    import torch
    import transformers

    config = tiny_hf_config(arch, **overrides)
    out = Path(tmp_path) / (name or f"tiny-{arch}-{seed}")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.mul_(init_scale)
    model.eval()
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    model.generation_config.save_pretrained(out)
    if with_tokenizer:
        vocab = make_tiny_tokenizer(out, chat)
        assert vocab <= config.vocab_size, (vocab, config.vocab_size)
    return out


class PageSlots:
    """Slot lists for tests, page-consistent like the real page allocator's: whole pages
    from a shuffled free list (so reads really go through slot indices); `extend` fills
    the last partial page first, as decode does.

        pages = PageSlots(capacity=1024, page_size=16)
        prompt_slots = pages.extend([], 21)          # 2 pages
        slots = pages.extend(prompt_slots, 1)        # the 22nd token goes on page 2
    """

    def __init__(self, capacity: int, page_size: int, seed: int = 0):
        import numpy as np

        self.P = page_size
        rng = np.random.default_rng(seed)
        self.free = [int(p) for p in rng.permutation(capacity // page_size)]

    def extend(self, slots, n: int) -> list[int]:
        slots = list(slots)
        while n:
            if len(slots) % self.P:
                last = slots[-1]
                take = min(n, self.P - len(slots) % self.P)
                slots += list(range(last + 1, last + 1 + take))
            else:
                page = self.free.pop()
                take = min(n, self.P)
                slots += list(range(page * self.P, page * self.P + take))
            n -= take
        return slots


class ModelEnv:
    """A `ModelRunner` on the torch backend over its own CPU pool of `capacity` slots,
    with `PageSlots` for slot lists; `run(requests)` gives each request's logits rows.
    `dtype` ("float32", "bfloat16") or `quantize` ("int8", ...) choose the weights."""

    def __init__(self, model_dir, page_size: int, *, capacity: int = 1024,
                 dtype: str = "float32", quantize: str | None = None):  # fmt: skip
        import torch
        from radixlm.cache import KVPool
        from radixlm.runtime.model import ModelConfig, ModelRunner

        self.cfg = c = ModelConfig.from_dir(model_dir)
        kv = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, capacity, page_size, kv, "cpu")
        self.runner = ModelRunner(model_dir, "cpu", dtype, self.pool, attention="torch",
                                  quantize=quantize)  # fmt: skip
        self.pages = PageSlots(capacity, page_size)

    def run(self, requests) -> list:
        from radixlm.runtime.model import ForwardBatch

        batch = ForwardBatch.build(requests)
        logits = self.runner.forward(batch)
        ind = batch.logits_indptr
        return [logits[ind[i] : ind[i + 1]] for i in range(len(requests))]


def runner_greedy(runner, prompt, n: int) -> list[int]:
    """`n` greedy tokens after `prompt` through a `ModelRunner` (a prefill on slots
    0.., then one decode step a token)."""
    from radixlm.runtime.model import ForwardBatch

    ids, out = [int(t) for t in prompt], []
    batch = ForwardBatch.build([(ids, 0, range(len(ids)))])
    for _ in range(n):
        tok = int(runner.forward(batch)[-1].argmax())
        out.append(tok)
        ids.append(tok)
        batch = ForwardBatch.build([([tok], len(ids) - 1, range(len(ids)))])
    return out



def with_kernel_flags(monkeypatch, flags: tuple[str, ...], run: Callable[[], Any],
                      cache_dir: Path | None = None) -> Any:  # noqa: ANN001 - pytest's fixture
    """`run()` with the C kernel built with `flags` added (e.g. -DCLAIM_BYTES=1), into
    `cache_dir` when given; the process's own build is loaded again afterwards."""
    from radixlm.runtime.model import qkernel

    if cache_dir is not None:
        monkeypatch.setenv("RADIXLM_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(qkernel, "CFLAGS", (*qkernel.CFLAGS, *flags))
    qkernel.kernel.cache_clear()
    try:
        return run()
    finally:
        qkernel.kernel.cache_clear()


def random_ids(n: int, seed: int) -> list[int]:
    """`n` token ids in [3, 400), the same for the same `seed`."""
    import torch

    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(got, want, atol: float = 1e-4) -> None:  # noqa: ANN001 - torch tensors
    """Same shape, and no element further than `atol` from the reference's."""
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < atol, f"max abs diff {err}"


def load_hf_model(model_dir: str | Path):
    """The transformers reference model for a checkpoint (float32, eager attention, eval)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def load_gguf_reference(gguf_path: str | Path, model_dir: str | Path):
    """transformers' own reading of a GGUF (gguf-py's dequantization of every tensor, its
    name map and Q/K un-permutation) into a float32 model of `model_dir`'s config: the
    independent reference for our GGUF loading."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    class Names:  # parameter names for transformers' GGUF→HF map (top level only)
        def __init__(self, model):
            self.config, self._sd = model.config, model.state_dict()

        def state_dict(self):
            return self._sd

        def named_children(self):
            return []

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(str(model_dir))
        )
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=Names(meta))
    ref_model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**parsed["config"]), dtype=torch.float32,
        attn_implementation="eager",
    )
    ref_model.load_state_dict(parsed["tensors"], strict=True)
    return ref_model.eval()


def _llama_cpp_permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf `permute` of Llama Q/K rows (what GGUF stores)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # mixture of experts: routers and Qwen2-MoE's shared expert (experts: `_stack_experts`)
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama",
              "gemma3_text": "gemma3"}  # fmt: skip
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                 "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # fmt: skip
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def _stack_experts(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with HF's per-expert matrices stacked as llama.cpp's converter stacks them:
    `blk.N.ffn_{gate,up,down}_exps.weight`, `[experts, rows, cols]`."""
    import numpy as np

    stacks: dict[str, dict[int, Any]] = {}
    out = {}
    for name, t in state.items():
        m = _EXPERT_NAME.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault(f"blk.{m[1]}.{_GGUF_EXPERTS[m[3]]}.weight", {})[int(m[2])] = t
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def _add_moe_metadata(w, cfg: dict[str, Any]) -> None:
    """The expert keys llama.cpp's converter writes (Qwen: plus whether top-k is renormalised)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob")))
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def make_tiny_gguf(
    model_dir: str | Path,
    out_path: str | Path | None = None,
    *,
    quant: str | Callable[[str], str | None] | None = None,
) -> Path:
    """Write the HF checkpoint `model_dir` (from `make_tiny_checkpoint`, arch llama, qwen2,
    qwen3, a mixture-of-experts one, gemma2, gemma3 or phi3, with its tokenizer) as a GGUF
    file the way llama.cpp's converter lays it out: llama Q/K rows permuted, Gemma's norms
    with the 1 of (1 + w) added and its metadata (sliding window and pattern, soft-caps,
    local RoPE base), Phi-3's fused projections, rotary dims and longrope factor tensors;
    tokenizer as gpt2-style metadata (tokens, types, merges, special ids, chat template).
    `quant="Q8_0"` (or "Q4_0", ...) quantizes the matrices, experts stacked 3-D as
    llama.cpp stores them (routers stay F32, as llama.cpp keeps them); a function of the
    GGUF tensor name picks each matrix's type instead (None: F32), as llama.cpp's mixes do.
    K-quants are written by kquant_blocks, other types by gguf-py. Returns the GGUF path
    (default: `<model_dir>.gguf`)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    out = Path(out_path) if out_path else model_dir.with_suffix(".gguf")
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = _GGUF_ARCH.get(cfg["model_type"], cfg["model_type"])
    if arch not in ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3"):
        raise ValueError(f"no GGUF layout for {arch!r} here")
    rope = cfg.get("rope_parameters") or {}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(model_dir.name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    _add_family_metadata(w, arch, cfg, rope)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    _add_moe_metadata(w, cfg)

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    types = [int(gguf.TokenType.UNUSED)] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i], types[i] = t, int(gguf.TokenType.NORMAL)
    for added in tok.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(
            gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(tcfg["chat_template"])

    state: dict[str, Any] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    from kquant_blocks import BLOCK_BYTES as KQUANTS
    from kquant_blocks import quantize_k

    def type_of(gname: str) -> str | None:
        return quant(gname) if callable(quant) else quant

    for name, t in _stack_experts(state).items():
        t = np.ascontiguousarray(t.astype(np.float32))
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + np.float32(1.0)  # llama.cpp stores Gemma's (1 + w)
        if name.startswith("blk."):  # stacked experts
            gname = name
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.get("tie_word_embeddings"):
                continue
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_GGUF_FAMILY_LAYER.get(arch, {}).get(rest) or _GGUF_LAYER[rest]}"
        if arch == "llama" and gname.endswith("attn_q.weight"):
            t = _llama_cpp_permute(t, heads)
        elif arch == "llama" and gname.endswith("attn_k.weight"):
            t = _llama_cpp_permute(t, kv_heads)
        tname = type_of(gname) if t.ndim >= 2 and "ffn_gate_inp" not in gname else None  # routers F32
        if tname in KQUANTS:
            blocks = quantize_k(t.reshape(-1, t.shape[-1]), tname).reshape(*t.shape[:-1], -1)
            w.add_tensor(gname, blocks, raw_dtype=getattr(gguf.GGMLQuantizationType, tname))
        elif tname is not None:
            qtype = getattr(gguf.GGMLQuantizationType, tname)
            w.add_tensor(gname, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, t)
    if rope.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


_GGUF_GEMMA_LAYER = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GGUF_FAMILY_LAYER = {
    "gemma2": _GGUF_GEMMA_LAYER,
    "gemma3": _GGUF_GEMMA_LAYER,
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
}


def _add_family_metadata(w, arch: str, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    """RoPE, window and soft-cap metadata under llama.cpp's keys."""
    import math

    import gguf

    full = rope.get("full_attention", rope)
    w.add_rope_freq_base(float(full.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3":
        w.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(full["factor"]))
    if arch == "phi3":
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        orig = cfg["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        if rope.get("rope_type") == "longrope":
            scale = cfg["max_position_embeddings"] / orig
            w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
