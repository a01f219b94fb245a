"""The memory check before loading (runtime/model/memory_check.py): the weights' estimate
is what the loaded model holds, a model whose weights, KV pool and working buffers exceed
the available memory is refused in one line naming the estimate and the flags that would
make it fit, and `radixlm serve` says so before loading anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from radixlm.runtime.model import ModelConfig, load_model, resolve_model
from radixlm.runtime.model.memory_check import (
    GIB,
    RUNTIME_BYTES,
    WontFitError,
    available_memory,
    check_model_fits,
    footprint,
    model_weight_bytes,
)
from tiny_models import make_tiny_checkpoint, make_tiny_gguf


def test_available_memory_is_what_meminfo_allows():
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))  # fmt: skip
    assert 0 < available_memory() <= total


def test_the_weights_estimate_is_what_the_model_holds(tmp_path, monkeypatch):
    """A GGUF of packed and float tensors: the estimate before loading equals the bytes the
    built model holds (packed tiles at the file's size, the rest float32); dense float32
    within 2% (the decoder pads some transposed matrices' rows by a cache line)."""
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    src = make_tiny_checkpoint(tmp_path, "llama", name="est", hidden_size=256, intermediate_size=512,
                               num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    gguf = make_tiny_gguf(src, quant=lambda n: "Q6_K" if "attn_v" in n else "Q4_K")
    model_dir = resolve_model(gguf, progress=False)
    config = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, "cpu", "gguf")
    assert model_weight_bytes(model_dir, config, "gguf", 4) == model.resident_bytes()
    dense = load_model(model_dir, "cpu", "float32").resident_bytes()
    assert abs(model_weight_bytes(model_dir, config, None, 4) - dense) <= 0.02 * dense


def _config(tmp_path) -> ModelConfig:
    return ModelConfig.from_dir(make_tiny_checkpoint(tmp_path, "llama", name="cfg"))


def test_a_pool_too_big_is_refused_with_the_flags_that_fit(tmp_path):
    c = _config(tmp_path)
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    avail = 2 * GIB
    fp = footprint(GIB // 2, c, 10_000_000, 4, "float32", 2048, 8192, 2, available=avail)
    assert not fp.fits and fp.kv == 10_000_000 * per_token
    line = fp.refusal()
    assert "\n" not in line and "does not fit in memory" in line and "2.0 GiB is available" in line
    room = avail - fp.weights - fp.work - RUNTIME_BYTES
    tokens = room // per_token // 256 * 256
    assert f"--kv-tokens {tokens} " in line and "--kv-dtype float16" in line
    fixed = footprint(GIB // 2, c, tokens, 4, "float32", 2048, 8192, 2, available=avail)
    assert fixed.fits
    # float16 halves the pool: the flags offered for it fit too
    half = int(line.split("--kv-dtype float16 --kv-tokens ")[1].split(")")[0])
    assert footprint(GIB // 2, c, half, 2, "float16", 2048, 8192, 2, available=avail).fits
    # weights alone beyond memory: no pool size helps
    huge = footprint(4 * GIB, c, 4096, 2, "float16", 2048, 8192, 2, available=avail).refusal()
    assert "smaller quantization" in huge and "--kv-tokens" not in huge


def test_check_model_fits_raises_one_line(tmp_path):
    model_dir = make_tiny_checkpoint(tmp_path, "llama", name="fits")
    c = ModelConfig.from_dir(model_dir)
    ok = check_model_fits(model_dir, c, None, torch.float32, torch.float16, 4096, 2048, 256, 2)
    assert ok.fits
    with pytest.raises(WontFitError) as refused:
        check_model_fits(model_dir, c, None, torch.float32, torch.float32, 2**40, 2048, 256, 2)
    assert "\n" not in str(refused.value) and "--kv-tokens" in str(refused.value)


def test_serve_refuses_a_pool_beyond_memory_in_one_line(tiny_model_dir: Path, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "radixlm.runtime.cli", "serve", "-m", str(tiny_model_dir), "--device", "cpu",
         "--no-http", "--endpoint", f"ipc://{tmp_path}/s", "--kv-tokens", str(2**40), "--kv-dtype", "float32"],
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "does not fit in memory" in lines[0] and "--kv-tokens" in lines[0], lines[0]
