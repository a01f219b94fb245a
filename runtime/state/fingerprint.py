"""The identity of a model as served: state made under another one is never used.

A fingerprint covers what the KV cache and the token histories depend on: the weights
and tokenizer files (`file_identity`: size plus a hash of samples of their bytes, so a
file moved or copied to another path keeps its identity, and a file replaced by another
does not) and the settings that change what the KV holds (weights dtype, KV dtype, page
size, and the KV layout). It names the state directory's per-model folder.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

SAMPLE = 64 * 1024  # bytes read per sample
EDGE = 1024 * 1024  # bytes read at each end of a file
SAMPLES = 14  # evenly spaced samples between the ends
# In a model directory: the files the weights and the tokenizer are read from.
MODEL_FILES = ("*.gguf", "*.safetensors", "*.bin", "*.json", "*.model", "*.txt", "*.jinja")


def file_identity(path: Path) -> str:
    """Size and a hash of the first and last MiB and 14 samples between: reads ~3 MiB of
    any file, in milliseconds."""
    h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= 2 * EDGE + SAMPLES * SAMPLE:
            h.update(f.read())
        else:
            spans = [(0, EDGE), (size - EDGE, EDGE)]
            step = (size - 2 * EDGE) // (SAMPLES + 1)
            spans += [(EDGE + step * (i + 1), SAMPLE) for i in range(SAMPLES)]
            for offset, n in spans:
                h.update(os.pread(f.fileno(), n, offset))
    return h.hexdigest()


def model_files(source: Path) -> list[Path]:
    """The files a model is read from: the file itself, or a directory's weights,
    config and tokenizer files."""
    if source.is_file():
        return [source]
    found: set[Path] = set()
    for pattern in MODEL_FILES:
        found.update(p for p in source.glob(pattern) if p.is_file())
    return sorted(found)


def fingerprint(files: Iterable[Path], settings: Mapping[str, object]) -> str:
    """A 24-hex-digit name for the model `files` served with `settings` (dtype, KV
    dtype, page size, KV layout, ...): equal exactly when both are."""
    h = hashlib.blake2b(digest_size=12)
    for path in files:
        h.update(f"{path.name}\0{file_identity(path)}\0".encode())
    for key in sorted(settings):
        h.update(f"{key}={settings[key]!r}\0".encode())
    return h.hexdigest()
