"""A model's fingerprint: the same files and settings give the same one wherever the file
lies; another file (even of the same size), another dtype or page size give another."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from radixlm.runtime.state.fingerprint import fingerprint, model_files


def _file(path: Path, size: int, seed: int) -> Path:
    import random

    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def test_the_same_bytes_elsewhere_are_the_same_model(tmp_path: Path) -> None:
    a = _file(tmp_path / "m.gguf", 5 * 2**20, 1)
    (tmp_path / "moved").mkdir()
    b = shutil.copy(a, tmp_path / "moved" / "m.gguf")
    settings = {"dtype": "gguf", "kv_dtype": "float16", "page_size": 1}
    assert fingerprint([a], settings) == fingerprint([Path(b)], settings)
    assert len(fingerprint([a], settings)) == 24


def test_a_changed_byte_in_a_sampled_place_or_another_setting_is_another_model(tmp_path: Path) -> None:
    a = _file(tmp_path / "m.gguf", 5 * 2**20, 1)
    settings = {"dtype": "gguf", "kv_dtype": "float16", "page_size": 1}
    base = fingerprint([a], settings)
    assert fingerprint([a], {**settings, "kv_dtype": "bfloat16"}) != base
    assert fingerprint([a], {**settings, "page_size": 16}) != base
    with open(a, "r+b") as f:  # the header (first MiB) changes: another model
        f.seek(100)
        f.write(b"\x00\x01")
    assert fingerprint([a], settings) != base
    b = _file(tmp_path / "n.gguf", 5 * 2**20, 2)  # same size, other bytes
    os.rename(b, a)
    assert fingerprint([a], settings) != base


def test_a_model_directory_covers_its_weights_config_and_tokenizer(tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json", "model.safetensors", "README.md"):
        (tmp_path / name).write_text(name)
    assert [p.name for p in model_files(tmp_path)] == ["config.json", "model.safetensors",
                                                       "tokenizer.json"]
    before = fingerprint(model_files(tmp_path), {})
    (tmp_path / "tokenizer.json").write_text("another tokenizer")
    assert fingerprint(model_files(tmp_path), {}) != before
