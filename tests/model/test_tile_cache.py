"""The tile cache (runtime/model/tile_cache.py): a GGUF's first load packs its matrices into
a file of the cache directory, later loads map that file and pack nothing, with the same
weights; an edited GGUF, a truncated cache file or another row order is never read; the
cache stays within its bound (files, bytes; off at 0)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from radixlm.runtime.model import load_model, qkernel, resolve_model, tile_cache
from radixlm.runtime.model.quant import QuantWeight
from tiny_models import make_tiny_checkpoint, make_tiny_gguf

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))


def _gguf(tmp_path, name: str = "tc", seed: int = 0) -> Path:
    src = make_tiny_checkpoint(tmp_path, "llama", name=name, seed=seed, **SHAPE)
    return make_tiny_gguf(src, quant=lambda n: "Q6_K" if "attn_v" in n else "Q4_K")


def _tiles_dir() -> Path:
    return Path(os.environ["RADIXLM_CACHE_DIR"]) / "tiles"


def _weights(model) -> list[torch.Tensor]:
    return [model.embed.dequantize()] + [layer.w_qkv_t.dequantize() for layer in model.layers]


class _CountPacks:
    """Counts the kernel's q_pack calls (a process-wide kernel object)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        k = qkernel.kernel()
        real = k.q_pack

        def counted(*args):
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(k, "q_pack", counted)


def test_a_second_load_maps_the_tiles_and_packs_nothing(tmp_path, monkeypatch):
    gguf = _gguf(tmp_path)
    model_dir = resolve_model(gguf, progress=False)
    packs = _CountPacks(monkeypatch)
    first = load_model(model_dir, "cpu", "gguf")
    assert packs.calls > 0
    files = list(_tiles_dir().glob("*.tiles"))
    assert len(files) == 1 and files[0].name.startswith(gguf.stem)
    assert not list(_tiles_dir().glob(".*.tmp"))
    packs.calls = 0
    second = load_model(model_dir, "cpu", "gguf")
    assert packs.calls == 0  # mapped, not packed
    assert all(torch.equal(a, b) for a, b in zip(_weights(first), _weights(second), strict=True))
    maps = Path("/proc/self/maps").read_text()
    assert str(files[0]) in maps and str(gguf.resolve()) not in maps
    qkv = second.layers[0].w_qkv_t
    assert isinstance(qkv, QuantWeight) and qkv.nparts == 3 and qkv.type_name == "Q4_K+Q6_K"


def test_an_edited_gguf_or_a_broken_file_is_never_read(tmp_path, monkeypatch):
    gguf = _gguf(tmp_path)
    model_dir = resolve_model(gguf, progress=False)
    before = _weights(load_model(model_dir, "cpu", "gguf"))
    (old,) = _tiles_dir().glob("*.tiles")
    # another GGUF's bytes at the same path (a new mtime): a new key, its own tiles
    other = _gguf(tmp_path, name="tc2", seed=1)
    os.replace(other, gguf)
    os.utime(gguf, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    model_dir = resolve_model(gguf, progress=False)
    after = _weights(load_model(model_dir, "cpu", "gguf"))
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert len(list(_tiles_dir().glob("*.tiles"))) == 2 and old.exists()
    # a cache file cut short is ignored and replaced
    (new,) = set(_tiles_dir().glob("*.tiles")) - {old}
    with open(new, "r+b") as f:
        f.truncate(os.path.getsize(new) // 2)
    packs = _CountPacks(monkeypatch)
    again = _weights(load_model(model_dir, "cpu", "gguf"))
    assert packs.calls > 0 and all(torch.equal(a, b) for a, b in zip(after, again, strict=True))
    # another row order (no Q/K permutation undone) is another key, and so is another
    # build's K-quant layout (AVX-512 VBMI builds: 8-byte code units; the others: 2)
    assert tile_cache.cache_key(gguf, "4,2,True", 2) != tile_cache.cache_key(gguf, "4,2,False", 2)
    assert tile_cache.cache_key(gguf, "4,2,True", 2) != tile_cache.cache_key(gguf, "4,2,True", 8)


def test_the_cache_stays_within_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(tile_cache, "MAX_FILES", 2)
    ggufs = [_gguf(tmp_path, name=f"b{i}", seed=i) for i in range(3)]
    for g in ggufs:
        load_model(resolve_model(g, progress=False), "cpu", "gguf")
        time.sleep(0.01)
    kept = sorted(p.name.split("-")[0] for p in _tiles_dir().glob("*.tiles"))
    assert kept == ["b1", "b2"]  # the least recently used went
    monkeypatch.setenv(tile_cache.ENV_BOUND, "0.0001")  # ~100 KB: no model fits
    small = _gguf(tmp_path, name="b3", seed=3)
    load_model(resolve_model(small, progress=False), "cpu", "gguf")
    assert not list(_tiles_dir().glob("b3-*.tiles"))


def test_a_zero_bound_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv(tile_cache.ENV_BOUND, "0")
    gguf = _gguf(tmp_path)
    model = load_model(resolve_model(gguf, progress=False), "cpu", "gguf")
    assert not _tiles_dir().exists() or not list(_tiles_dir().iterdir())
    assert model.layers[0].w_qkv_t.nparts == 2  # Q, K of one type as one weight; V
