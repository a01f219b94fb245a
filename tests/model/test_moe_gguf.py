"""Mixture-of-experts GGUFs (qwen3moe, qwen2moe, llama with experts = Mixtral) written as
llama.cpp's converter lays them out (experts stacked 3-D, routers F32), on tiny random
checkpoints.

- F32 GGUF: the converted config and logits equal the HF checkpoint's (transformers).
- Q8_0 / Q4_0 / Q4_1 experts stay packed, one `QuantWeight` per expert over the file's rows;
  their products (the CPU kernel) match the same model dequantized to float32 within the
  kernel's tolerance, and greedy tokens are identical to transformers run on those
  dequantized weights (`ensure_dense_weights`: HF's per-expert names).
- `radixlm serve -m x.gguf` end to end: batch 1, a mixed batch (prefills joining a running
  decode), a session turn that hits its history; the KV pool clean after.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_pool_clean, start_test_server
from radixlm.cache import KVPool
from radixlm.runtime import protocol as wire
from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner, resolve_model
from radixlm.runtime.model.gguf_convert import ensure_dense_weights
from radixlm.runtime.model.gguf_file import GGUFFile
from radixlm.runtime.model.gguf_weights import gguf_state_dict
from radixlm.runtime.model.quant import QuantWeight
from scheduler_harness import hf_greedy
from tiny_models import (
    MOE_VARIANTS,
    load_hf_model,
    make_tiny_checkpoint,
    make_tiny_gguf,
    runner_greedy,
)

ATOL = 1e-4
DECODE_ATOL = 5e-3  # the kernel's int16 activations (as test_model_quant_tiny.py)
IDS = [5, 17, 99, 3, 250, 41, 8, 8, 130, 77, 12, 300, 64, 2, 19, 200, 33, 150]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "moe-cache"))


@pytest.fixture(scope="module", params=sorted(MOE_VARIANTS))
def checkpoint(request, tmp_path_factory) -> Path:
    name = request.param
    return make_tiny_checkpoint(tmp_path_factory.mktemp(name), name=name, **MOE_VARIANTS[name])


def _runner(model_dir: Path, dtype: str) -> ModelRunner:
    c = ModelConfig.from_dir(model_dir)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 256, 1, torch.float32, "cpu")
    return ModelRunner(model_dir, "cpu", dtype, pool, attention="torch")


def _prefill_and_decode(runner: ModelRunner, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(every position's logits from one prefill, the same positions decoded one by one)."""
    pre = runner.forward(ForwardBatch.build([(ids, 0, list(range(len(ids))), True)]))
    dec = torch.cat([runner.forward(ForwardBatch.build([([t], i, list(range(100, 101 + i)))]))
                     for i, t in enumerate(ids)])  # fmt: skip
    return pre, dec


def test_f32_gguf_matches_the_hf_checkpoint(checkpoint, tmp_path):
    out = resolve_model(make_tiny_gguf(checkpoint, tmp_path / "f32.gguf"), progress=False)
    got, want = ModelConfig.from_dir(out), ModelConfig.from_dir(checkpoint)
    assert (got.model_type, got.moe) == (want.model_type, want.moe)
    with torch.no_grad():
        ref = load_hf_model(checkpoint)(torch.tensor([IDS])).logits[0]
    pre, dec = _prefill_and_decode(_runner(out, "float32"), IDS)
    assert (pre - ref).abs().max().item() < ATOL  # names, stacking, Q/K order exact
    assert (dec - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_experts_match_the_dequantized_model(checkpoint, tmp_path, quant):
    out = resolve_model(make_tiny_gguf(checkpoint, tmp_path / f"{quant}.gguf", quant=quant),
                        progress=False)  # fmt: skip
    packed = _runner(out, "gguf")
    # decode in the fused C step (kernels/moe_step.c), Qwen2-MoE's shared expert too
    assert packed.model.weight_format == quant and packed.fused is not None
    dense = _runner(out, "float32")  # the same blocks dequantized to float32 (no kernel)
    q_pre, q_dec = _prefill_and_decode(packed, IDS)
    f_pre, f_dec = _prefill_and_decode(dense, IDS)
    assert (q_pre - f_pre).abs().max().item() < DECODE_ATOL
    assert (q_dec - f_dec).abs().max().item() < DECODE_ATOL
    # transformers on the dequantized weights, written under HF's per-expert names
    hf = load_hf_model(ensure_dense_weights(out, progress=False))
    prompt = IDS[:8]
    assert runner_greedy(packed, prompt, 10) == hf_greedy(hf, prompt, 10)


def test_experts_are_one_weight_each_over_the_files_rows(tmp_path):
    src = make_tiny_checkpoint(tmp_path, name="qwen3_moe", **MOE_VARIANTS["qwen3_moe"])
    path = make_tiny_gguf(src, tmp_path / "q.gguf", quant="Q4_0")
    info = next(t for t in GGUFFile(path).tensors if t.name == "blk.2.ffn_down_exps.weight")
    experts, rows, cols = info.shape
    assert (experts, rows, cols) == (8, 64, 32)
    state = gguf_state_dict(path, 4, 2, False, "qwen3_moe")
    raw = path.read_bytes()
    slab = info.nbytes // experts
    for e in range(experts):
        w = state[f"model.layers.2.mlp.experts.{e}.down_proj.weight"]
        assert isinstance(w, QuantWeight) and not w.packed and w.shape == (rows, cols)
        (view,) = w.owners  # a view of the mapped file, not a copy
        assert isinstance(view, np.ndarray) and not view.flags.owndata
        assert view.tobytes() == raw[info.offset + e * slab : info.offset + (e + 1) * slab]
        base = view.__array_interface__["data"][0]
        assert w.rowptr.tolist() == [base + r * w.row_bytes for r in range(rows)]
    router = state["model.layers.2.mlp.gate.weight"]
    assert isinstance(router, torch.Tensor) and router.dtype == torch.float32  # F32 as stored
    assert "model.layers.1.mlp.gate_proj.weight" in state  # the dense layer (no router)


def test_moe_metadata_becomes_the_hf_config(tmp_path):
    src = make_tiny_checkpoint(tmp_path, name="mixtral", **MOE_VARIANTS["mixtral"])
    cfg = json.loads((resolve_model(make_tiny_gguf(src), progress=False) / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("mixtral", ["MixtralForCausalLM"])
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (8, 2)
    src = make_tiny_checkpoint(tmp_path, name="q3", **MOE_VARIANTS["qwen3_moe"])
    cfg = json.loads((resolve_model(make_tiny_gguf(src), progress=False) / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["mlp_only_layers"] == [1]
    assert (cfg["num_experts"], cfg["moe_intermediate_size"], cfg["norm_topk_prob"]) == (8, 32, True)


# -------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`radixlm serve -m` on a Q8_0 qwen3moe GGUF (its blocks as stored, the default on
    CPU), and transformers on the same weights dequantized."""
    root = tmp_path_factory.mktemp("moe-serve")
    src = make_tiny_checkpoint(root, name="qwen3_moe", seed=3, **MOE_VARIANTS["qwen3_moe"])
    path = make_tiny_gguf(src, root / "served.gguf", quant="Q8_0")
    hf = load_hf_model(ensure_dense_weights(resolve_model(path, progress=False), progress=False))
    with start_test_server(root / "srv", path, "--dtype", "auto") as handle:
        yield handle, hf


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_serve_gguf_batch_1_mixed_batch_and_a_session(served):
    handle, hf = served
    assert "Q8_0" in handle.log()
    with handle.client(timeout_s=120) as c:
        prompt = _ids(20, 1)
        done = c.generate(wire.Input(input_ids=prompt), max_tokens=8, temperature=0.0,
                          ignore_eos=True)  # fmt: skip
        assert done.token_ids == hf_greedy(hf, prompt, 8)
        # a mixed batch: two prefills join a request that is decoding
        first = _ids(12, 2)
        rid = c.new_rid()
        c.send(wire.Generate(rid=rid, input=wire.Input(input_ids=first), stream=True,
                             sampling=wire.SamplingParams(max_tokens=16, temperature=0.0,
                                                          ignore_eos=True)))  # fmt: skip
        assert isinstance(c.recv_for(rid), wire.Chunk)  # it is decoding now
        others = {c.new_rid(): _ids(n, 3 + n) for n in (30, 7)}
        for r, ids in others.items():
            c.send(wire.Generate(rid=r, input=wire.Input(input_ids=ids),
                                 sampling=wire.SamplingParams(max_tokens=6, temperature=0.0,
                                                              ignore_eos=True)))  # fmt: skip
        for r, ids in others.items():
            (d,) = c.collect(r)
            assert d.token_ids == hf_greedy(hf, ids, 6)
        (d,) = c.collect(rid)
        assert d.token_ids == hf_greedy(hf, first, 16)
        # a session: the turn computes only its new tokens
        history = _ids(25, 9)
        opened = c.call(wire.OpenSession(rid=c.new_rid(), input=wire.Input(input_ids=history)))
        assert isinstance(opened, wire.SessionOpened)
        turn = _ids(4, 10)
        d = c.generate(wire.Input(input_ids=turn), session=opened.session, max_tokens=6,
                       temperature=0.0, ignore_eos=True)  # fmt: skip
        assert d.token_ids == hf_greedy(hf, history + turn, 6)
        assert d.usage.cached_tokens == len(history)
        c.call(wire.CloseSession(rid=c.new_rid(), session=opened.session))
        assert_pool_clean(c)
