"""Gemma 2, Gemma 3 (text) and Phi-3 / Phi-4-mini against transformers on tiny random
checkpoints (float32, torch attention, page sizes 1 and 16).

The variants (tests/tiny_models.py `FAMILY_VARIANTS`) make every variation bite within a
few dozen tokens: sliding windows of 6-9 tokens, attention and logit soft-caps, Gemma 3's
local and global RoPE bases, Phi-3's longrope switching to its long factors at position
24, Phi-4-mini's partial rotary. The reference is transformers as a cached generation runs
it: the first `FIRST` tokens in one forward, then one forward per token (for longrope the
case where transformers' per-forward choice of factors and radixlm's per-position choice
agree; for the other families any split gives the same logits). Checked: logits of a
prompt, of a cached prefix + suffix, of token-by-token decode, of a ragged batch mixing
prefills (with and without a cached prefix) and decodes, and of batched decodes (padded
and sharing a cached prompt); greedy tokens alone and in a mixed batch; the same model
as a GGUF (F32: same logits; Q8_0 blocks through the quantized per-op path: the tokens of
transformers run on the dequantized blocks).
"""

from __future__ import annotations

import numpy as np
import pytest
import scheduler_harness as harness
import torch
from radixlm.cache import KVPool
from radixlm.runtime.model import BatchRequest, ForwardBatch, ModelConfig, ModelRunner
from tiny_models import (
    FAMILY_VARIANTS,
    PageSlots,
    assert_close,
    load_hf_model,
    make_tiny_checkpoint,
    random_ids,
)

CAPACITY = 1024
FIRST = 20  # reference: tokens of the first forward (below the longrope switch at 24)


one_thread = harness.one_thread  # tiny models run single-threaded (autouse)


class Reference:
    """transformers' logits and greedy tokens, computed as a cached generation does."""

    def __init__(self, model_dir):
        self.hf = load_hf_model(model_dir)
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def logits(self, ids) -> torch.Tensor:
        from transformers import DynamicCache

        key = tuple(int(i) for i in ids)
        if key not in self._memo:
            cache = DynamicCache(config=self.hf.config)
            out = self.hf(torch.tensor([key[:FIRST]]), cache=cache, use_cache=True)
            rows = [out.logits[0]]
            for t in key[FIRST:]:
                out = self.hf(torch.tensor([[t]]), cache=out.cache, use_cache=True)
                rows.append(out.logits[0])
            self._memo[key] = torch.cat(rows).float()
        return self._memo[key]

    def greedy(self, prompt, n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt) :]


class Env:
    def __init__(self, model_dir, page_size: int, dtype: str = "float32"):
        c = ModelConfig.from_dir(model_dir)
        self.pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, CAPACITY, page_size,
                           torch.float32, "cpu")  # fmt: skip
        self.runner = ModelRunner(model_dir, "cpu", dtype, self.pool, attention="torch")
        self.pages = PageSlots(CAPACITY, page_size)

    def run(self, requests) -> list[torch.Tensor]:
        batch = ForwardBatch.build(requests)
        logits = self.runner.forward(batch)
        ind = batch.logits_indptr
        return [logits[ind[i] : ind[i + 1]] for i in range(len(requests))]


@pytest.fixture(scope="module", params=sorted(FAMILY_VARIANTS))
def family(request, tmp_path_factory):
    name = request.param
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp(name), name=name,
                                     **FAMILY_VARIANTS[name])  # fmt: skip
    return model_dir, Reference(model_dir)


def test_the_variations_are_read(family):
    model_dir, _ = family
    c = ModelConfig.from_dir(model_dir)
    v = c.variations
    if c.model_type.startswith("gemma"):
        assert v.sandwich_norms and v.norm_offset == 1.0 and v.mlp_act == "gelu_tanh"
        assert c.sliding_window is not None and any(v.sliding_layers) and not all(v.sliding_layers)
    if c.model_type == "gemma2":
        assert v.attn_softcap == 4.0 and v.final_softcap == 6.0 and v.query_scale == 24**-0.5
    if c.model_type == "gemma3_text":
        assert c.local_rope.theta == 500.0 and c.rope.type == "linear" and c.qk_norm
    if c.model_type == "phi3":
        assert c.rope.type == "longrope" and c.rope.original_max_position_embeddings == 24


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_then_token_by_token(family, page_size):
    model_dir, ref = family
    env = Env(model_dir, page_size)
    ids = random_ids(40, 1)
    slots = env.pages.extend([], FIRST)
    (first,) = env.run([BatchRequest(ids[:FIRST], 0, slots, all_logits=True)])
    assert_close(first, ref.logits(ids)[:FIRST])
    for pos in range(FIRST, len(ids)):
        slots = env.pages.extend(slots, 1)
        (row,) = env.run([([ids[pos]], pos, slots)])
        assert_close(row, ref.logits(ids)[pos : pos + 1])


@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_prefix_plus_suffix_longer_than_the_window(family, page_size):
    model_dir, ref = family
    env = Env(model_dir, page_size)
    ids = random_ids(FIRST, 2)
    cut = 9  # not page aligned; the suffix (11 tokens) is longer than every window
    prefix_slots = env.pages.extend([], cut)
    (p,) = env.run([(ids[:cut], 0, prefix_slots, True)])
    assert_close(p, ref.logits(ids)[:cut])
    (s,) = env.run([(ids[cut:], cut, env.pages.extend(prefix_slots, FIRST - cut), True)])
    assert_close(s, ref.logits(ids)[cut:])


@pytest.mark.parametrize("page_size", [1, 16])
def test_ragged_batch_of_prefills_and_decodes(family, page_size):
    model_dir, ref = family
    env = Env(model_dir, page_size)
    shared = random_ids(16, 4)
    shared_slots = env.pages.extend([], len(shared))
    env.run([(shared, 0, shared_slots)])
    running = random_ids(31, 5)  # a request past the longrope switch, decoding its next token
    run_slots = env.pages.extend([], FIRST)
    env.run([(running[:FIRST], 0, run_slots)])
    for pos in range(FIRST, 30):
        run_slots = env.pages.extend(run_slots, 1)
        env.run([([running[pos]], pos, run_slots)])
    seqs = [shared + random_ids(4, 6), shared + random_ids(1, 7), random_ids(13, 9), running]
    starts = [16, 16, 0, 30]
    bases = [shared_slots, shared_slots, [], run_slots]
    reqs = [BatchRequest(seq[start:], start, env.pages.extend(base, len(seq) - start), i % 2 == 0)
            for i, (seq, start, base) in enumerate(zip(seqs, starts, bases, strict=True))]  # fmt: skip
    for i, (seq, start, out) in enumerate(zip(seqs, starts, env.run(reqs), strict=True)):
        assert_close(out, ref.logits(seq)[start:] if i % 2 == 0 else ref.logits(seq)[-1:])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shared_prompt", [False, True], ids=["padded", "shared"])
def test_batched_decode_across_the_window(family, page_size, shared_prompt):
    """Decode rows of different lengths, each past its window: the padded gather, or (a
    common cached prompt) the shared-prefix path."""
    model_dir, ref = family
    env = Env(model_dir, page_size)
    prompt = random_ids(16, 12) if shared_prompt else []
    prompt_slots = env.pages.extend([], len(prompt))
    if prompt:
        env.run([(prompt, 0, prompt_slots)])
    seqs = [prompt + random_ids(n, 20 + n) for n in (3, 2, 4, 1)] if prompt else [random_ids(n, 20 + n) for n in (5, 17, 19, 12)]  # fmt: skip
    slot_lists = []
    for seq in seqs:
        slots = env.pages.extend(prompt_slots, len(seq) - len(prompt))
        env.run([(seq[len(prompt) :], len(prompt), slots)])
        slot_lists.append(slots)
    for step in range(3):
        reqs = []
        for k, seq in enumerate(seqs):
            seq.append(random_ids(1, 50 + 4 * step + k)[0])
            slot_lists[k] = env.pages.extend(slot_lists[k], 1)
            reqs.append(([seq[-1]], len(seq) - 1, slot_lists[k]))
        for seq, out in zip(seqs, env.run(reqs), strict=True):
            assert_close(out, ref.logits(seq)[-1:])


def test_sliced_prefill_gives_the_same_logits(family):
    """The engine's preemptible prefill (a chunk in pieces of a few rows, layer by layer:
    sliced.py) attends within the windows and rotates with each layer's RoPE too."""
    model_dir, ref = family
    env = Env(model_dir, 16)
    ids = random_ids(FIRST, 13)
    tokens = np.asarray(ids, dtype=np.int64)
    for kv_len in (0, 7):
        slots = np.asarray(env.pages.extend([], FIRST), dtype=np.int64)
        if kv_len:
            env.run([(ids[:kv_len], 0, slots[:kv_len].tolist())])
        task = env.runner.start_sliced(tokens, slots, kv_len, FIRST - kv_len, 0, 5)
        got = None
        while got is None:
            got = task.advance(0.0)
        assert_close(got, ref.logits(ids)[kv_len:])


def _greedy(env: Env, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of `prompts`, all in one ragged batch per step (the prompts
    prefilled together, then decoded together)."""
    slots = [env.pages.extend([], len(p)) for p in prompts]
    seqs = [list(p) for p in prompts]
    outs = env.run([(p, 0, s) for p, s in zip(prompts, slots, strict=True)])
    for _ in range(n):
        for k, out in enumerate(outs):
            seqs[k].append(int(out[-1].argmax()))
            slots[k] = env.pages.extend(slots[k], 1)
        outs = env.run([([s[-1]], len(s) - 1, sl) for s, sl in zip(seqs, slots, strict=True)])
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def test_greedy_tokens_alone_and_in_a_mixed_batch(family):
    model_dir, ref = family
    prompts = [random_ids(n, 30 + n) for n in (FIRST, 7, 12)]
    want = [ref.greedy(p, 14) for p in prompts]
    assert _greedy(Env(model_dir, 1), prompts[:1], 14) == want[:1]
    assert _greedy(Env(model_dir, 16), prompts, 14) == want


def test_fused_step_is_refused_where_it_cannot_run(family):
    """Quantized weights: the one-call C step takes only the models it implements; the
    others decode per op (quantized products) and stay within the kernel's tolerance."""
    model_dir, ref = family
    env = Env(model_dir, 1, dtype="int8")
    blockers = env.runner.model.fused_step_blockers()
    c = env.runner.config
    if c.model_type.startswith("gemma"):
        assert {"sandwich norms", "a GeGLU MLP", "scaled embeddings"} <= set(blockers)
        assert env.runner.fused is None
    if c.rope.partial_rotary_factor < 1:
        assert "partial rotary" in blockers and env.runner.fused is None
    ids = random_ids(FIRST, 3)
    slots = env.pages.extend([], FIRST)
    (out,) = env.run([(ids, 0, slots)])
    want = ref.logits(ids)[-1:]
    spread = want.std().item()
    assert (out - want).abs().max().item() < 0.25 * spread  # int8's documented bound
    if env.runner.fused is not None:  # Phi-3 with full rotary: the fused step, windows checked
        batch = ForwardBatch.build([([ids[-1]], FIRST, env.pages.extend(slots, 1))])
        window = c.sliding_window
        assert env.runner.fused.applies(batch) == (window is None or window >= FIRST + 1)


def test_unsupported_architectures_keep_a_one_line_refusal():
    from radixlm.runtime.model import UnsupportedModelError

    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf({"model_type": "gemma3n", "hidden_size": 64})
    msg = str(e.value)
    assert "\n" not in msg and "gemma3n" in msg
    assert all(name in msg for name in ("llama", "gemma2", "gemma3_text", "phi3"))
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_hf({"model_type": "gemma2", "hidden_activation": "relu"})
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        ModelConfig.from_hf({"model_type": "gemma3_text", "use_bidirectional_attention": True})


def test_gemma3_configs_of_either_transformers_spelling_agree():
    """A transformers-4 Gemma 3 config (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern) and a 5.x one (rope_parameters per layer type, layer_types),
    and a multimodal one (text_config), give the same decoder settings."""
    v4 = dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912,
              num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
              vocab_size=262144, rope_theta=1e6, rope_local_base_freq=1e4,
              rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512,
              sliding_window_pattern=6, query_pre_attn_scalar=256, max_position_embeddings=32768)  # fmt: skip
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_local_base_freq",
                                                   "rope_scaling", "sliding_window_pattern")}  # fmt: skip
    v5["layer_types"] = types
    v5["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    mm = {"model_type": "gemma3", "eos_token_id": [1, 106],
          "text_config": {k: v for k, v in v4.items() if k != "model_type"}}  # fmt: skip
    a, b, m = (ModelConfig.from_hf(x) for x in (v4, v5, mm))
    for c in (b, m):
        assert (c.rope, c.local_rope, c.variations) == (a.rope, a.local_rope, a.variations)
    assert a.variations.sliding_layers == tuple(t == "sliding_attention" for t in types)
    assert a.tie_word_embeddings and m.eos_token_ids == (1, 106)
    assert [a.layer_window(i) for i in (0, 4, 5)] == [512, 512, None]
    assert (a.layer_rope(0).theta, a.layer_rope(5).theta, a.layer_rope(5).factor) == (1e4, 1e6, 8.0)


def test_multimodal_gemma3_checkpoint_runs_its_text_decoder(tmp_path):
    """Gemma 3's 4B+ checkpoints (Gemma3ForConditionalGeneration) nest the text model:
    its weights under `language_model.model.` and a vision tower beside it."""
    import json

    from safetensors.torch import load_file, save_file

    src = make_tiny_checkpoint(tmp_path, name="g3", **FAMILY_VARIANTS["gemma3"])
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    mm = tmp_path / "mm"
    mm.mkdir()
    renamed = {"language_model." + k: v for k, v in state.items()}  # (4.x's layout)
    renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3)
    renamed["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(4, 64)
    save_file(renamed, str(mm / "model.safetensors"))
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    (mm / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text, "eos_token_id": cfg["eos_token_id"]}))  # fmt: skip
    ids = random_ids(FIRST, 8)
    outs = []
    for d in (src, mm):
        env = Env(d, 1)
        (o,) = env.run([(ids, 0, env.pages.extend([], FIRST), True)])
        outs.append(o)
    assert torch.equal(outs[0], outs[1])


def test_rope_factors_switch_by_position(family):
    """Phi-3's longrope: positions below `original_max_position_embeddings` rotate with the
    short factors, from it on with the long ones, wherever they sit in a batch."""
    model_dir, _ = family
    c = ModelConfig.from_dir(model_dir)
    if c.rope.type != "longrope":
        pytest.skip("not a longrope model")
    from radixlm.runtime.model.rope import Rotary, long_inv_freq

    rot = Rotary(c.rope, c.head_dim, torch.device("cpu"), torch.float32)
    pos = torch.tensor([23, 24, 3, 40])
    cos, _ = rot.cos_sin(pos)
    half = rot.dim // 2
    long = long_inv_freq(c.rope, c.head_dim)
    for row, p in enumerate(pos.tolist()):
        inv = long if p >= 24 else rot.inv_freq
        want = torch.cos(p * inv) * rot.scale
        assert torch.allclose(cos[row, 0, :half], want, atol=1e-6)
    assert not torch.allclose(long, rot.inv_freq)
    expected = float(np.sqrt(1 + np.log(256 / 24) / np.log(24)))  # Phi-3's attention factor
    assert rot.scale == pytest.approx(expected)


# -- the same models as GGUF files ------------------------------------------------------------

GGUF_OVERRIDES = {"query_pre_attn_scalar": 16, "tie_word_embeddings": True}  # what a GGUF says


@pytest.fixture
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.usefixtures("_cache")
@pytest.mark.parametrize("name", sorted(FAMILY_VARIANTS))
def test_gguf_gives_the_same_logits_and_tokens(tmp_path, name):
    """F32 GGUF: the original's logits. Q8_0 GGUF, blocks as stored (`dtype="gguf"`, the
    quantized per-op path): transformers on the converted directory's dequantized
    weights (so our config.json, written from the GGUF's metadata, must describe the model
    to transformers too) gives the same greedy tokens and logits within the kernel's
    tolerance."""
    from radixlm.runtime.model import ensure_dense_weights, resolve_model
    from tiny_models import make_tiny_gguf

    kw = dict(FAMILY_VARIANTS[name])
    if kw["arch"].startswith("gemma"):
        kw.update(GGUF_OVERRIDES)
    src = make_tiny_checkpoint(tmp_path, name=name, **kw)
    ref = Reference(src)
    converted = resolve_model(make_tiny_gguf(src), progress=False)
    ours, theirs = ModelConfig.from_dir(converted), ModelConfig.from_dir(src)
    assert (ours.variations, ours.local_rope) == (theirs.variations, theirs.local_rope)
    assert ours.rope == _f32_factors(theirs.rope)  # GGUF keeps longrope factors as float32
    ids = random_ids(30, 40)
    env = Env(converted, 16)
    slots = env.pages.extend([], FIRST)
    (got,) = env.run([(ids[:FIRST], 0, slots, True)])
    assert_close(got, ref.logits(ids)[:FIRST])
    for pos in range(FIRST, len(ids)):
        slots = env.pages.extend(slots, 1)
        (row,) = env.run([([ids[pos]], pos, slots)])
        assert_close(row, ref.logits(ids)[pos : pos + 1])

    q8 = resolve_model(make_tiny_gguf(src, tmp_path / f"{name}-q8.gguf", quant="Q8_0"), progress=False)
    dequantized = Reference(ensure_dense_weights(q8, progress=False))
    env = Env(q8, 16, dtype="gguf")
    assert "Q8_0" in env.runner.model.weight_format
    prompts = [random_ids(FIRST, 41), random_ids(9, 42)]
    assert _greedy(env, prompts, 10) == [dequantized.greedy(p, 10) for p in prompts]


def _f32_factors(rope):
    from dataclasses import replace

    def f32(f):
        return None if f is None else tuple(float(np.float32(x)) for x in f)

    return replace(rope, long_factor=f32(rope.long_factor), short_factor=f32(rope.short_factor))


def test_gguf_metadata_llama_cpp_leaves_out_is_inferred_as_llama_cpp_does():
    from radixlm.runtime.model.gguf_families import family_config

    def config(arch, layers, meta):
        cfg = dict(num_hidden_layers=layers, hidden_size=4608, num_attention_heads=32, head_dim=128)
        return family_config(arch, lambda k, d: meta.get(k, d), cfg, lambda name: None)

    big, small = config("gemma2", 46, {}), config("gemma2", 42, {})
    assert (big["query_pre_attn_scalar"], small["query_pre_attn_scalar"]) == (144, 128)  # 27B rule
    assert (big["sliding_window"], big["attn_logit_softcapping"], big["final_logit_softcapping"]) == (4096, 50.0, 30.0)
    assert big["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    g3 = config("gemma3", 26, {"attention.sliding_window": 512})
    assert g3["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (g3["rope_local_base_freq"], g3["final_logit_softcapping"]) == (10000.0, None)
    assert config("gemma3", 62, {})["query_pre_attn_scalar"] == 4608 // 32
    assert config("gemma3", 26, {})["sliding_window"] is None  # no window key: all global
