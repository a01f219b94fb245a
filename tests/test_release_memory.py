"""`release_free_memory` hands freed heap pages back to the OS (glibc), which the engine and
the frontend call once ready: start-up frees much of what it allocated (measured: 433 ->
403 MB over a default server's processes)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
from radixlm.runtime.transport.memory import release_free_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc on Linux")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_freed_heap_chunks_go_back_to_the_os() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    # 200 MB in 4 KiB chunks (below the mmap threshold: from the heap), each touched; then
    # all but every 64th freed, so the heap's top stays in use and free() cannot shrink it.
    chunks = []
    for _ in range(51_200):
        p = libc.malloc(4096)
        ctypes.memset(p, 1, 4096)
        chunks.append(p)
    for i, p in enumerate(chunks):
        if i % 64:
            libc.free(p)
    held = _rss_mb()
    release_free_memory()
    after = _rss_mb()
    for p in chunks[::64]:
        libc.free(p)
    assert held - after > 100, (held, after)  # most of the ~197 MB freed came back
