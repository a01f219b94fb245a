"""`release_free_memory` hands freed heap pages back to the OS (glibc), which the engine and
the frontend call once ready: start-up frees much of what it allocated (measured: 433 ->
403 MB over a default server's processes)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest
from radixlm.runtime.memory import release_free_memory

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


def test_a_prefill_leaves_no_mask_behind(tmp_path: Path) -> None:
    """A prefill over a cached prefix plans an `[n, L]` mask; once its forward is done the
    torch backend drops it (it stayed referenced until the next plan: after an 8,000-token
    prompt, 30 MB held through every fused decode step that followed)."""
    import torch
    from radixlm.cache import KVPool
    from radixlm.runtime.model import ForwardBatch, ModelConfig, ModelRunner
    from tiny_models import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path, "llama", seed=3, max_position_embeddings=512)
    c = ModelConfig.from_dir(model)
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, 300, 1, torch.float32, "cpu")
    runner = ModelRunner(model, "cpu", "float32", pool, attention="torch")
    planned: list[int] = []
    plan = runner.attn.plan

    def spy(batch) -> None:  # the plan really held a mask while its forward ran
        plan(batch)
        planned.extend(p.mask.numel() for p in runner.attn.prefills if p.mask is not None)

    runner.attn.plan = spy  # type: ignore[method-assign]
    runner.forward(ForwardBatch.build([(list(range(3, 103)), 0, range(100))]))
    runner.forward(ForwardBatch.build([(list(range(5, 105)), 100, range(200))]))  # over a prefix
    assert planned == [100 * 200]
    assert runner.attn.prefills == [] and runner.attn.decode is None
