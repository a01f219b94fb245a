"""A GGUF's matrices packed into the kernel's tile layout, kept in a file of the user's
cache directory, so that a later start maps the tiles instead of packing them again.

The tiles are packed straight into the cache file (a shared writable mapping of it: the
mapping is the weights' memory, no second copy), which is renamed into place once every
matrix is in; a later start with the same GGUF maps that file read-only and builds no
tile at all. Packing a 1B-shape Q4_K_M model meant first-touching ~670 MB of fresh memory
(seconds on a virtual machine whose memory is backed lazily); its cached tiles come from
the page cache. The pages are file-backed: the OS may write them back and drop them under
memory pressure (and read them again), where anonymous memory would have to be swapped.

- Where: `cache_root()/tiles/<gguf stem>-<key>.tiles`; the key covers the GGUF's path,
  size, mtime and inode, the rows' order (llama.cpp's Q/K permutation undone or not) and
  a hash of the kernel's packing code (kernels/common.h, kernels/qmatmul.c) and the
  build's layout (AVX-512 VBMI builds store K-quant codes in 8-byte units, the others in
  2-byte ones: `Kernel.kq_unit`), so an edited file or another tile layout is never read.
- Bound: at most `MAX_FILES` models and `RADIXLM_TILE_CACHE_GB` GiB (default
  `DEFAULT_GB`; 0 turns the cache off), the least recently used evicted when a new file is
  added; a model bigger than the bound, or than the free disk space, is not cached.
- Format: a 4 KiB-aligned header (magic, a JSON index {name: [offset, bytes, qtype, rows,
  cols]}, the key), then each matrix's tiles at 4 KiB-aligned offsets.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import time
import uuid
from pathlib import Path

import torch

from .gguf_convert import cache_root
from .qkernel import KERNEL_DIR

log = logging.getLogger(__name__)

MAGIC = b"RLMTILE1"
ENV_BOUND = "RADIXLM_TILE_CACHE_GB"
DEFAULT_GB = 16.0
MAX_FILES = 4
_ALIGN = 4096
_PACKING_SOURCES = (KERNEL_DIR / "common.h", KERNEL_DIR / "qmatmul.c")
_STALE_TMP_S = 3600  # temp files of a crashed writer older than this are removed


def bound_bytes() -> int:
    """The cache's bound in bytes (0: the cache is off)."""
    try:
        return int(float(os.environ.get(ENV_BOUND, DEFAULT_GB)) * 2**30)
    except ValueError:
        return int(DEFAULT_GB * 2**30)


def cache_key(gguf_path: str | Path, rows_order: str, kq_unit: int) -> str:
    """The identity of a GGUF's tiles: the file (path, size, mtime, inode), the rows' order,
    the packing code and the loaded build's K-quant layout (`kq_unit`)."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    h = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{rows_order}|{kq_unit}".encode())
    for src in _PACKING_SOURCES:
        h.update(src.read_bytes())
    return h.hexdigest()[:20]


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class TileFile:
    """One model's tiles in a cache file: `views[name]` uint8 tensors over its mapping."""

    def __init__(self, path: Path, buf: mmap.mmap, index: dict[str, list[int]]):
        self.path, self._buf, self.index = path, buf, index
        self.views = {name: torch.frombuffer(buf, dtype=torch.uint8, count=e[1], offset=e[0])
                      for name, e in index.items()}  # fmt: skip

    @staticmethod
    def target(gguf_path: str | Path, key: str) -> Path:
        return cache_root() / "tiles" / f"{Path(gguf_path).stem}-{key}.tiles"

    @classmethod
    def open(cls, gguf_path: str | Path, key: str) -> TileFile | None:
        """The cached tiles of this GGUF and key, mapped (copy-on-write, never written), or
        None when there are none (or the cache is off, or the file is not whole)."""
        path = cls.target(gguf_path, key)
        if bound_bytes() <= 0 or not path.is_file():
            return None
        try:
            with open(path, "rb") as f:
                head = f.read(16)
                if head[:8] != MAGIC:
                    return None
                (n,) = struct.unpack("<Q", head[8:])
                meta = json.loads(f.read(n))
                if meta.get("key") != key:
                    return None
                size = os.fstat(f.fileno()).st_size
                index = {k: list(v) for k, v in meta["index"].items()}
                if any(off + nb > size for off, nb, *_ in index.values()):
                    return None
                buf = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
        except (OSError, ValueError, KeyError, struct.error):
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        return cls(path, buf, index)

    @classmethod
    def create(cls, gguf_path: str | Path, key: str, entries: dict[str, tuple[int, int, int, int]]
               ) -> TileWriter | None:  # fmt: skip
        """A new cache file for `entries` {name: (tile bytes, qtype, rows, cols)}, mapped
        writable to pack into, or None when the cache is off or the model does not fit
        its bound or the disk."""
        meta = {"key": key, "index": {}}
        header = 16 + len(json.dumps(meta)) + 64 * len(entries) + 1024  # room for the index
        off = _align(header)
        for name, (nbytes, qtype, rows, cols) in entries.items():
            meta["index"][name] = [off, nbytes, qtype, rows, cols]
            off = _align(off + nbytes)
        total = off
        bound = bound_bytes()
        path = cls.target(gguf_path, key)
        if total > bound:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(path.parent).free < total + (1 << 30):
                return None
            text = json.dumps(meta).encode()
            if 16 + len(text) > _align(header):
                return None
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
            with open(tmp, "w+b") as f:
                f.write(MAGIC + struct.pack("<Q", len(text)) + text)
                f.truncate(total)
                buf = mmap.mmap(f.fileno(), total, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
        except OSError as e:
            log.info("no tile cache for %s: %s", Path(gguf_path).name, e)
            return None
        return TileWriter(path, tmp, buf, meta["index"])


class TileWriter(TileFile):
    """A cache file being filled: pack into `views`, then `commit` renames it into place."""

    def __init__(self, path: Path, tmp: Path, buf: mmap.mmap, index: dict[str, list[int]]):
        super().__init__(path, buf, index)
        self.tmp = tmp

    def commit(self) -> None:
        """The file into place (after every view was packed) and the cache within its
        bound; on failure the weights stay usable (the mapping), only nothing is cached."""
        try:
            os.replace(self.tmp, self.path)
        except OSError as e:
            log.info("could not keep the tiles in %s: %s", self.path, e)
            with contextlib.suppress(OSError):
                self.tmp.unlink()
            return
        evict(self.path.parent, keep=self.path)


def evict(directory: Path, keep: Path | None = None) -> None:
    """Least recently used tile files out until at most MAX_FILES and the bound remain;
    temp files of writers that died removed."""
    now = time.time()
    files = []
    for p in directory.glob("*.tiles"):
        with contextlib.suppress(OSError):
            st = p.stat()
            files.append((st.st_mtime, st.st_size, p))
    for p in directory.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime > _STALE_TMP_S:
                p.unlink()
    files.sort(reverse=True)  # newest first
    total, kept = 0, 0
    for _mtime, size, p in files:
        if p == keep or (kept < MAX_FILES and total + size <= bound_bytes()):
            total += size
            kept += 1
            continue
        with contextlib.suppress(OSError):
            p.unlink()
            log.info("tile cache: evicted %s", p.name)


def pack_cached(gguf_path: str | Path, weights: dict, rows_order: str) -> dict:
    """`weights` ({name: QuantWeight} over a GGUF's mapping) packed: from this GGUF's cache
    file when there is one (no packing), else packed into a new one (kept for the next
    start); unpacked as they are when the cache is off or cannot hold them. Returns the
    dict with the cached weights in place of the given ones."""
    from .qkernel import kernel
    from .quant import QuantWeight

    if not weights or bound_bytes() <= 0:
        return weights
    k = kernel()
    key = cache_key(gguf_path, rows_order, k.kq_unit)
    shapes = {n: (w.qtype, w.rows, w.cols) for n, w in weights.items()}
    hit = TileFile.open(gguf_path, key)
    if hit is not None and all(n in hit.index and tuple(hit.index[n][2:]) == s for n, s in shapes.items()):
        return {n: QuantWeight.from_tiles(hit.views[n], *shapes[n]) for n in weights}
    writer = TileFile.create(gguf_path, key, {n: (k.q_tiled_bytes(*s), *s) for n, s in shapes.items()})
    if writer is None:
        return weights
    for n, w in weights.items():
        w.pack(into=writer.views[n])
    writer.commit()
    log.info("packed %s's tiles into %s (kept for the next start)", Path(gguf_path).name, writer.path)
    return weights
