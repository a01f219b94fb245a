"""GGUF → HF directory conversion on tiny GGUFs written the way llama.cpp lays them out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from radixlm.cache import KVPool
from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner, resolve_model
from radixlm.runtime.model.gguf_convert import (
    cache_root,
    converted_dir_for,
    ensure_converted,
    ensure_dense_weights,
    has_dense_weights,
)
from radixlm.runtime.model.quant import QuantWeight
from tiny_models import (
    TINY_VARIANTS,
    load_gguf_reference,
    load_hf_model,
    make_tiny_checkpoint,
    make_tiny_gguf,
)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))


def _logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    c = ModelConfig.from_dir(model_dir)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 64, 1, torch.float32, "cpu")
    runner = ModelRunner(model_dir, "cpu", "float32", pool, attention="torch")
    return runner.forward(ForwardBatch.build([(ids, 0, list(range(len(ids))), True)]))


IDS = [5, 17, 99, 3, 250, 41, 8, 8, 130, 77, 12, 300]


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2", "qwen3", "qwen3-tied"])
def test_f32_gguf_roundtrip_matches_original(tmp_path, variant):
    kw = dict(TINY_VARIANTS[variant])
    if kw["arch"] == "mistral":  # llama.cpp writes Mistral dense as arch "llama"
        kw["arch"] = "llama"
    src = make_tiny_checkpoint(tmp_path, name=variant, **kw)
    gguf_path = make_tiny_gguf(src)
    out = resolve_model(gguf_path, progress=False)
    assert out.parent.parent == cache_root()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == kw.get("tie_word_embeddings", False)
    with torch.no_grad():
        ref = load_hf_model(src)(torch.tensor([IDS])).logits[0]
    got = _logits(out, IDS)
    assert (got - ref).abs().max().item() < 1e-4  # the Q/K un-permutation is exact


def test_quantized_gguf_matches_transformers_loader(tmp_path):
    """Q8_0 weights: our dequantized model equals transformers' own GGUF loading."""
    src = make_tiny_checkpoint(tmp_path, "llama", name="q")
    gguf_path = make_tiny_gguf(src, quant="Q8_0")
    out = ensure_converted(gguf_path, progress=False)
    with torch.no_grad():
        ref = load_gguf_reference(gguf_path, src)(torch.tensor([IDS])).logits[0]
    assert (_logits(out, IDS) - ref).abs().max().item() < 1e-4


def test_tokenizer_and_side_files(tmp_path):
    from tokenizers import Tokenizer
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    src = make_tiny_checkpoint(tmp_path, "qwen2", name="tok")
    gguf_path = make_tiny_gguf(src)
    out = ensure_converted(gguf_path, progress=False)
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    arch, tok_dict, tok_cfg = get_gguf_tokenizer(str(gguf_path))
    ref, _ = convert_gguf_tokenizer(arch, tok_dict)
    original = Tokenizer.from_file(str(src / "tokenizer.json"))
    for text in ["<|im_start|>user\nHello world!<|im_end|>\n", "The quick brown fox 123",
                 "ünïcode 🤖  two  spaces\n\nnl", "def main():\n    return 0"]:  # fmt: skip
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, add_special_tokens=False).ids
        assert ids == original.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == text
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == tok_cfg["chat_template"]
    assert (tcfg["bos_token"], tcfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def test_cache_location_and_reuse(tmp_path, monkeypatch):
    monkeypatch.delenv("RADIXLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "radixlm"
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    src = make_tiny_checkpoint(tmp_path, "qwen3", name="reuse", with_tokenizer=True)
    gguf_path = make_tiny_gguf(src)
    first = ensure_converted(gguf_path, progress=False)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert ensure_converted(gguf_path, progress=False) == first == converted_dir_for(gguf_path)
    assert (first / "config.json").stat().st_mtime_ns == stamp  # not converted again
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".tmp-")]


def test_concurrent_conversions_agree(tmp_path):
    src = make_tiny_checkpoint(tmp_path, "llama", name="race")
    gguf_path = make_tiny_gguf(src)
    code = (
        "import sys; from radixlm.runtime.model.gguf_convert import ensure_converted; "
        "print(ensure_converted(sys.argv[1], progress=False))"
    )
    env = dict(os.environ)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(gguf_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    dirs = {o.strip().splitlines()[-1] for o, _ in outs}
    assert len(dirs) == 1
    out = Path(dirs.pop())
    assert (out / "config.json").exists() and not has_dense_weights(out)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]
    ids = IDS[:6]
    with torch.no_grad():
        ref = load_hf_model(src)(torch.tensor([ids])).logits[0]
    assert (_logits(out, ids) - ref).abs().max().item() < 1e-4


def test_conversion_keeps_no_weights_and_packed_weights_hold_the_files_blocks(tmp_path):
    """The converted directory holds config and tokenizer only (no float32 copy of a file
    whose blocks run packed); a gguf-format model holds its matrices as the file's blocks,
    byte for byte (repacked once into the kernel's tiles), keeps no mapping of the file
    once built, and float32 only for the norms; dense weights are dequantized from the
    GGUF at load."""
    import gc

    from radixlm.runtime.model.gguf_file import GGUFFile

    src = make_tiny_checkpoint(tmp_path, "llama", name="mapped")
    gguf_path = make_tiny_gguf(src, quant="Q8_0")
    out = ensure_converted(gguf_path, progress=False)
    assert not has_dense_weights(out)
    assert not list(out.glob("*.safetensors"))
    c = ModelConfig.from_dir(out)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 64, 1, torch.float32, "cpu")
    runner = ModelRunner(out, "cpu", "gguf", pool, attention="torch")
    model = runner.model
    gc.collect()
    maps = Path("/proc/self/maps")
    if maps.exists():  # the file's pages are no longer this process's
        assert str(gguf_path.resolve()) not in maps.read_text()
    mats = [model.lm_head_t] + [getattr(layer, n) for layer in model.layers
                                for n in ("w_qkv_t", "w_o_t", "w_gu_t", "w_down_t")]  # fmt: skip
    assert all(isinstance(w, QuantWeight) and w.packed for w in mats)
    f = GGUFFile(gguf_path)
    stored = {t.name: torch.from_numpy(f.data(t).copy()) for t in f.tensors}
    del f
    for i, layer in enumerate(model.layers):  # o_proj, down_proj and v_proj: as stored
        assert torch.equal(layer.w_o_t.blocks.flatten(), stored[f"blk.{i}.attn_output.weight"])
        assert torch.equal(layer.w_down_t.blocks.flatten(), stored[f"blk.{i}.ffn_down.weight"])
        v = stored[f"blk.{i}.attn_v.weight"]
        assert torch.equal(layer.w_qkv_t.parts[-1].blocks.flatten(), v)  # packed per tensor
    dense = [t for layer in model.layers for t in (layer.in_norm, layer.post_norm)]
    assert sum(t.numel() for t in dense) == 2 * c.num_layers * c.hidden_size  # norms only
    # dense loading dequantizes the GGUF itself, and equals transformers on the same blocks
    ref = _logits(ensure_dense_weights(out), IDS)
    assert has_dense_weights(out)
    plain = tmp_path / "again"
    plain.mkdir()
    for f in out.iterdir():
        if not f.name.endswith(".safetensors"):
            (plain / f.name).write_bytes(f.read_bytes())
    assert (_logits(plain, IDS) - ref).abs().max().item() < 1e-5


def test_dense_weights_on_demand_load_in_transformers(tmp_path):
    import transformers

    src = make_tiny_checkpoint(tmp_path, "qwen2", name="hf")
    out = ensure_converted(make_tiny_gguf(src), progress=False)
    assert ensure_dense_weights(out, progress=False) == out
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    ensure_dense_weights(out, progress=False)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        got = hf(torch.tensor([IDS])).logits[0]
        ref = load_hf_model(src)(torch.tensor([IDS])).logits[0]
    assert (got - ref).abs().max().item() < 1e-4
    with pytest.raises(FileNotFoundError, match="names no GGUF"):
        ensure_dense_weights(tmp_path)


@pytest.mark.parametrize("quant", [None, "Q8_0"])
def test_gguf_reader_agrees_with_gguf_py(tmp_path, quant):
    """`GGUFFile` (our reader: tensor table, mapped data, metadata decoded on demand)
    against gguf-py's own reader on the same file."""
    import gguf
    from radixlm.runtime.model.gguf_file import GGUFFile, GGUFFormatError

    path = make_tiny_gguf(make_tiny_checkpoint(tmp_path, "qwen2", name="rd"), quant=quant)
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.ggml_type == int(b.tensor_type) and a.offset == b.data_offset
        assert a.shape == tuple(int(x) for x in reversed(b.shape))
        assert np.array_equal(ours.data(a), np.asarray(b.data).reshape(-1).view(np.uint8))
    meta = ours.metadata()
    for name, field in ref.fields.items():
        if name.startswith("GGUF."):  # gguf-py's own header fields
            continue
        want = field.contents()
        assert meta[name] == pytest.approx(want) if isinstance(want, float) else meta[name] == want, name
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:200])
    with pytest.raises(GGUFFormatError):
        GGUFFile(bad)
    bad.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(GGUFFormatError, match="magic"):
        GGUFFile(bad)
