"""A GGUF file's tensor table and metadata, read without gguf-py, and its data mapped (mmap),
not copied.

gguf-py's `GGUFReader` turns every metadata value into numpy objects (the 49,152 tokens
and merges of SmolLM2's vocabulary among them) and imports half of numpy's machinery:
~1.5 s on an idle core, 25 s on a busy one. Loading weights needs only the tensor table
(name, shape, type, offset) and the data alignment, so this reader skips metadata values
by their lengths (decoding them only when `metadata()` is asked) and maps the file
read-only: tensors are numpy views of the mapping, and pages are read from the page
cache when a kernel first touches them (file-backed memory, shared with the page cache,
never a private copy). The format is GGUF v2/v3 (little-endian), as llama.cpp writes it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format of a scalar (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# GGML type -> (elements per block, bytes per block), for the types a tensor may have.
GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
               8: (32, 34), 9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144),
               13: (256, 176), 14: (256, 210), 15: (256, 292), 30: (1, 2)}  # fmt: skip
F32, F16, BF16 = 0, 1, 30


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: `shape` outermost first (GGUF lists dims innermost first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    """The tensor table of `path` and a read-only mapping of the file (`data(name)`)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offsets: dict[str, tuple[int, int]] = {}
        try:
            self.tensors, self.alignment = _parse(memoryview(self._map), self._offsets)
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GGUFFormatError(f"{self.path} is truncated or malformed: {e}") from e
        self._buf = np.frombuffer(self._map, dtype=np.uint8)

    def metadata(self) -> dict[str, Any]:
        """Every metadata value, as Python (str, int, float, bool, or lists of them)."""
        view = memoryview(self._map)
        try:
            return {k: _read(view, pos, vtype, build=True)[0]
                    for k, (vtype, pos) in self._offsets.items()}  # fmt: skip
        finally:
            view.release()

    def get(self, key: str, default: Any = None) -> Any:
        """One metadata value (decoded alone), or `default` when the file lacks the key."""
        if key not in self._offsets:
            return default
        vtype, pos = self._offsets[key]
        view = memoryview(self._map)
        try:
            return _read(view, pos, vtype, build=True)[0]
        finally:
            view.release()

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, a read-only uint8 view of the mapping (no copy)."""
        return self._buf[info.offset : info.offset + info.nbytes]

    def floats(self, info: TensorInfo) -> np.ndarray:
        """An F32/F16/BF16 tensor as a float32 array of `info.shape` (a copy)."""
        raw = self.data(info)
        if info.ggml_type == F32:
            out = raw.view(np.float32).copy()
        elif info.ggml_type == F16:
            out = raw.view(np.float16).astype(np.float32)
        elif info.ggml_type == BF16:
            out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise GGUFFormatError(f"{info.name}: type {info.ggml_type} is not a float type")
        return out.reshape(info.shape)

    def advise_willneed(self) -> None:
        """Ask the kernel to start reading the whole file into the page cache (async)."""
        if hasattr(mmap, "MADV_WILLNEED"):
            self._map.madvise(mmap.MADV_WILLNEED)


def _parse(buf: memoryview, offsets: dict[str, tuple[int, int]] | None = None
           ) -> tuple[list[TensorInfo], int]:
    """The tensor table and alignment; `offsets` (if given) gets each metadata key's
    (value type, position), for `metadata` to decode later."""
    if bytes(buf[:4]) != MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3)")
    pos = 24
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if offsets is not None:
            offsets[key] = (vtype, pos)
        if key == "general.alignment" and vtype in _SCALARS:
            alignment = int(struct.unpack_from("<" + _SCALARS[vtype], buf, pos)[0])
        pos = _read(buf, pos, vtype, build=False)[1]
    infos = []
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    start = (pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, ggml_type, offset in infos:
        if ggml_type not in GGML_BLOCKS:
            raise GGUFFormatError(f"tensor {name!r} has GGML type {ggml_type}, unknown here")
        per, size = GGML_BLOCKS[ggml_type]
        n = int(np.prod(shape)) if shape else 1
        if n % per:
            raise GGUFFormatError(f"tensor {name!r}: {n} elements in blocks of {per}")
        nbytes = n // per * size
        if start + offset + nbytes > len(buf):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        tensors.append(TensorInfo(name, shape, ggml_type, start + offset, nbytes))
    return tensors, alignment


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip


def _read(buf: memoryview, pos: int, vtype: int, build: bool) -> tuple[Any, int]:
    """(the metadata value of `vtype` at `pos` as Python, or None unless `build`; the
    position after it)."""
    if vtype in _SCALARS:
        end = pos + struct.calcsize(_SCALARS[vtype])
        return (struct.unpack_from("<" + _SCALARS[vtype], buf, pos)[0] if build else None), end
    if vtype == _STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return (bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8") if build else None), pos + 8 + n
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SCALARS:
            end = pos + count * struct.calcsize(_SCALARS[etype])
            if not build:
                return None, end
            return np.frombuffer(buf[pos:end], dtype=_NUMPY[etype]).tolist(), end
        if etype == _STRING:  # lengths must be walked: one read per element
            length = _U64.unpack_from
            if not build:
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
                return None, pos
            out = []
            for _ in range(count):
                n = length(buf, pos)[0]
                out.append(bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"))
                pos += 8 + n
            return out, pos
        values = []
        for _ in range(count):
            v, pos = _read(buf, pos, etype, build)
            values.append(v)
        return (values if build else None), pos
    raise GGUFFormatError(f"unknown GGUF metadata type {vtype}")
