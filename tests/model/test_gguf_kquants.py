"""GGUF files of the types people download: tiny models stored as llama.cpp's mixes store
them (Q4_K_M: Q4_K with Q6_K for V, the head and some down projections; Q6_K with a Q8_0
embedding; the Q5 types mixed within one fused matrix), loaded as stored (`--dtype gguf`)
against transformers' own reading of the same file (gguf-py's dequantization to float32).

K-quant blocks are written by tests/kquant_blocks.py from the format's definition (gguf-py
does not quantize K-quants), the others by gguf-py. The packed model's greedy tokens --
its prefill and its fused one-call decode steps, one request and two at once -- equal the
float32 model's (where that model's best two tokens are a near-tie, either within
rounding); a long prefill (int8 activations) stays within the stated bound of its logits;
the file's blocks are held byte for byte. Matrices of types the kernel lacks are
dequantized only when they fit in memory (one log line), else refused in one line.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from kquant_blocks import quantize_k
from radixlm.cache import KVPool
from radixlm.runtime.model import (
    BatchRequest,
    ForwardBatch,
    ModelConfig,
    ModelRunner,
    gguf_weights,
    resolve_model,
)
from radixlm.runtime.model.gguf_file import GGUFFile
from radixlm.runtime.model.gguf_weights import UnpackedTypesError, check_unpacked_types
from radixlm.runtime.model.quant import QuantWeight
from tiny_models import load_gguf_reference, make_tiny_checkpoint, make_tiny_gguf, with_kernel_flags

# Rows of 256 weights (K-quants' super-block) throughout: hidden 256, ffn 512, 4 heads of 64.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
PROMPT = 20  # < GEMM8_MIN_ROWS: int16 activations, as decode
LONG = 100  # >= GEMM8_MIN_ROWS: int8 activations
NEW = 24
PREFILL8_TOL = 0.25  # max |logit error| / logits std of int8 rows (model/test_quant_tiny.py)
# A near-tie: with int16 activations the packed model's logits stay within ~1.2e-3 x their
# std of the float32 model's (the largest over these prompts' positions), so where the
# float32 model's best two tokens are closer than twice that, rounding alone picks either
# (the Q5 mix's first token: 4.4427 vs 4.4424, std 1.70).
TIE = 3e-3
MAX_TIES = 2  # of NEW tokens: a systematic error is not a tie


def _q4_k_m(name: str) -> str:
    more_bits = name.endswith("attn_v.weight") or name in ("output.weight", "blk.0.ffn_down.weight")
    return "Q6_K" if more_bits else "Q4_K"


def _q6_k(name: str) -> str:
    return "Q8_0" if name == "token_embd.weight" else "Q6_K"


_Q5 = {"attn_q": "Q5_K", "attn_k": "Q5_0", "attn_v": "Q5_1", "attn_output": "Q5_0", "ffn_gate": "Q5_K",
       "ffn_up": "Q5_1", "ffn_down": "Q5_0", "token_embd": "Q5_0", "output": "Q5_K"}  # fmt: skip


def _q5(name: str) -> str:
    return _Q5[name.split(".")[-2]]


MIXES = {"Q4_K_M": (_q4_k_m, "Q4_K+Q6_K"), "Q6_K": (_q6_k, "Q6_K"),  # (the embedding: Q8_0)
         "Q5": (_q5, "Q5_0+Q5_1+Q5_K")}  # fmt: skip


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))


def _runner(model_dir, fmt: str, capacity: int = 256) -> ModelRunner:
    c = ModelConfig.from_dir(model_dir)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, capacity, 1, torch.float32, "cpu")
    return ModelRunner(model_dir, "cpu", fmt, pool, attention="torch")


def _greedy(runner: ModelRunner, prompt: list[int], rows: int) -> list[list[int]]:
    """NEW greedy tokens after `prompt` for `rows` copies decoded together (each in its own
    slots): the prefill, then fused decode steps of all rows at once."""
    span = PROMPT + NEW
    outs = []
    for r in range(rows):
        logits = runner.forward(ForwardBatch.build([BatchRequest(prompt, 0, list(range(r * span, r * span + PROMPT)))]))
        outs.append([int(logits[-1].argmax())])
    for step in range(NEW - 1):
        pos = PROMPT + step
        reqs = [BatchRequest([outs[r][-1]], pos, list(range(r * span, r * span + pos + 1))) for r in range(rows)]
        logits = runner.forward(ForwardBatch.build(reqs))
        for r in range(rows):
            outs[r].append(int(logits[r].argmax()))
    return outs


def _assert_greedy(ref: torch.Tensor, tokens: list[int], what: str) -> None:
    """Each of `tokens` is the float32 model's greedy pick after the same prefix (`ref`: its
    logits over the prompt and `tokens`, teacher-forced), or ties with it within TIE x the
    logits' std -- at most MAX_TIES times."""
    rows = ref[PROMPT - 1 :][: len(tokens)]
    best = rows.argmax(-1).tolist()
    ties = 0
    for i, (t, b) in enumerate(zip(tokens, best, strict=True)):
        if t != b:
            gap = float((rows[i, b] - rows[i, t]) / rows[i].std())
            assert gap <= TIE, (what, i, t, b, gap)
            ties += 1
    assert ties <= MAX_TIES, (what, ties)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_mixes_decode_the_float32_models_tokens(tmp_path, mix):
    pick, types = MIXES[mix]
    src = make_tiny_checkpoint(tmp_path, "llama", name=f"k-{mix}", seed=3, **SHAPE)
    gguf_path = make_tiny_gguf(src, quant=pick)
    model_dir = resolve_model(gguf_path, progress=False)
    runner = _runner(model_dir, "gguf")
    assert runner.model.weight_format == types and runner.fused is not None
    qkv = runner.model.layers[0].w_qkv_t
    assert isinstance(qkv, QuantWeight) and qkv.packed
    ref_model = load_gguf_reference(gguf_path, src)
    prompt = torch.randint(3, 400, (PROMPT,), generator=torch.Generator().manual_seed(7)).tolist()

    for tokens in _greedy(runner, prompt, rows=2):  # two rows: decode_rows, one: decode_layers
        with torch.no_grad():  # transformers' greedy pick after each prefix of ours
            ref = ref_model(torch.tensor([prompt + tokens])).logits[0]
        _assert_greedy(ref, tokens, mix)
    solo = _greedy(runner, prompt, rows=1)[0]
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt + solo])).logits[0]
    _assert_greedy(ref, solo, mix)

    long_ids = torch.randint(3, 400, (LONG,), generator=torch.Generator().manual_seed(8)).tolist()
    got = runner.forward(ForwardBatch.build([BatchRequest(long_ids, 0, list(range(LONG)), True)]))
    with torch.no_grad():
        want = ref_model(torch.tensor([long_ids])).logits[0]
    assert ((got - want).abs().amax(-1) / want.std(-1)).max().item() <= PREFILL8_TOL


def test_k_quant_blocks_are_held_as_stored(tmp_path):
    """The packed model's matrices are the file's K-quant bytes (a stacked QKV's V part,
    an o projection), and dequantize to gguf-py's values."""
    import gguf

    src = make_tiny_checkpoint(tmp_path, "llama", name="held", seed=4, **SHAPE)
    gguf_path = make_tiny_gguf(src, quant=_q4_k_m)
    model = _runner(resolve_model(gguf_path, progress=False), "gguf").model
    f = GGUFFile(gguf_path)
    stored = {t.name: (t, np.array(f.data(t))) for t in f.tensors}
    layer = model.layers[1]
    o_info, o_bytes = stored["blk.1.attn_output.weight"]
    assert layer.w_o_t.type_name == "Q4_K"
    assert np.array_equal(layer.w_o_t.blocks.numpy().reshape(-1), o_bytes)
    v_info, v_bytes = stored["blk.1.attn_v.weight"]
    v = layer.w_qkv_t.parts[-1]
    assert v.type_name == "Q6_K" and np.array_equal(v.blocks.numpy().reshape(-1), v_bytes)
    deq = gguf.quants.dequantize(v_bytes.reshape(v_info.shape[0], -1), gguf.GGMLQuantizationType.Q6_K)
    assert torch.equal(v.dequantize(), torch.from_numpy(np.asarray(deq, dtype=np.float32)))


def test_kquant_writer_reads_back_close(tmp_path):
    """tests/kquant_blocks.py's blocks, read by gguf-py, are the weights to within each
    type's rounding (rms error, relative: Q4_K 9%, Q5_K 5%, Q6_K 3%)."""
    import gguf

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 512)) * rng.uniform(0.1, 2, (16, 1))).astype(np.float32)
    for name, bound in (("Q4_K", 0.09), ("Q5_K", 0.05), ("Q6_K", 0.03)):
        blocks = quantize_k(w, name)
        back = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, name)).reshape(w.shape)
        assert np.sqrt(((back - w) ** 2).mean() / (w**2).mean()) < bound, name


def _ternary(name: str) -> str | None:
    return "TQ2_0" if name.endswith(("attn_q.weight", "ffn_up.weight")) else "Q4_K"


def test_types_the_kernel_lacks_are_dequantized_when_they_fit(tmp_path, caplog):
    """A file with TQ2_0 tensors loads, those dequantized to float32 with one log line
    naming the type and the size, and computes what transformers computes on the file."""
    src = make_tiny_checkpoint(tmp_path, "llama", name="tq", seed=5, **SHAPE)
    gguf_path = make_tiny_gguf(src, quant=_ternary)
    with caplog.at_level(logging.WARNING, logger="radixlm.runtime.model.gguf_weights"):
        runner = _runner(resolve_model(gguf_path, progress=False), "gguf")
    said = [r.getMessage() for r in caplog.records if "dequantizing" in r.getMessage()]
    assert len(said) == 1 and "TQ2_0 (4)" in said[0] and "MiB" in said[0] and "\n" not in said[0]
    assert not isinstance(runner.model.layers[0].w_gu_t, QuantWeight)  # TQ2_0 up rows: float32
    ids = list(range(5, 25))
    got = runner.forward(ForwardBatch.build([BatchRequest(ids, 0, list(range(len(ids))), True)]))
    with torch.no_grad():
        want = load_gguf_reference(gguf_path, src)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=5e-3, rtol=0)


def test_types_the_kernel_lacks_are_refused_when_too_big(tmp_path, monkeypatch):
    """When the float32 copy of such tensors would not fit, loading is refused in one line
    naming the types, the size and what is available -- before anything is dequantized."""
    src = make_tiny_checkpoint(tmp_path, "llama", name="tq-big", seed=5, **SHAPE)
    gguf_path = make_tiny_gguf(src, quant=_ternary)
    with pytest.raises(UnpackedTypesError) as refused:
        check_unpacked_types(gguf_path, available=64 << 10)
    line = str(refused.value)
    assert "\n" not in line and "TQ2_0" in line and "is available" in line and "Q4_K_M" in line
    monkeypatch.setattr(gguf_weights, "available_memory", lambda: 64 << 10)
    with pytest.raises(UnpackedTypesError, match="TQ2_0"):
        _runner(resolve_model(gguf_path, progress=False), "gguf")
    check_unpacked_types(make_tiny_gguf(src, tmp_path / "all-k.gguf", quant=_q4_k_m), available=0)


def _steps(model_dir, threads: int) -> list[torch.Tensor]:
    """Logits of 12 fused steps (alternately one row and two) of a fresh runner."""
    runner = _runner(model_dir, "gguf", capacity=512)
    assert runner.fused is not None
    prompts = [list(range(3, 3 + n)) for n in (30, 140)]
    for b, p in enumerate(prompts):
        runner.forward(ForwardBatch.build([BatchRequest(p, 0, list(range(200 * b, 200 * b + len(p))))]))
    before = torch.get_num_threads()
    out = []
    try:
        torch.set_num_threads(threads)
        for s in range(12):
            rows = [s % 2] if s % 2 else [0, 1]
            out.append(runner.forward(ForwardBatch.build([
                BatchRequest([5 + s], len(prompts[r]), list(range(200 * r, 200 * r + len(prompts[r]) + 1)))
                for r in rows
            ])))  # fmt: skip
    finally:
        torch.set_num_threads(before)
    return out


def test_stacked_types_in_fused_steps_are_computed_once_by_any_thread_count(tmp_path, monkeypatch):
    """The fused steps claim a stacked matrix's rows part after part (kernels/decode.c,
    `map_claims`): bit-identical logits for 1, 2 and 3 threads, and with a kernel built
    to claim one chunk of rows at a time (-DCLAIM_BYTES=1: stealing on every product, a
    claim of each part), as with the default one on one thread."""
    src = make_tiny_checkpoint(tmp_path, "llama", name="claims", seed=6, **SHAPE)
    model_dir = resolve_model(make_tiny_gguf(src, quant=_q4_k_m), progress=False)
    one = _steps(model_dir, 1)
    for threads in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(one, _steps(model_dir, threads), strict=True))
    stolen = with_kernel_flags(monkeypatch, ("-DCLAIM_BYTES=1",), lambda: _steps(model_dir, 3))
    assert all(torch.equal(a, b) for a, b in zip(one, stolen, strict=True))
