"""Handing freed heap memory back to the OS (glibc's ``malloc_trim``), torch-free.

Start-up (parsing a GGUF's metadata, building a tokenizer and its vocabulary tables,
importing big packages) frees much of what it allocated, but glibc keeps freed chunks
below the top of its heaps resident. One trim once a process is ready returns them; it
takes about a millisecond. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import gc
from functools import cache

__all__ = ["release_free_memory", "trim_heap"]


@cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Return the heap's free pages to the OS where glibc allows (~1 ms)."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


def release_free_memory() -> None:
    """Collect garbage, then `trim_heap`."""
    gc.collect()
    trim_heap()
