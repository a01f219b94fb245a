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


_REUSE = """
import ctypes, os, sys, time
import torch
from radixlm.runtime.memory import keep_freed_blocks
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    assert keep_freed_blocks()
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])  # minflt
def layers(n):  # a long prefill's MLP temporary, layer after layer: 64 MB allocated, written, freed
    for _ in range(n):
        x = torch.empty(16 << 20)
        x.fill_(1.0)
        del x
layers(10)  # (the heap's first rounds: its free chunks of that size form as it grows)
before = faults()
layers(10)
print(faults() - before)
"""


@pytest.mark.parametrize("env", [{}, {"MALLOC_MMAP_THRESHOLD_": "131072"}])
def test_kept_blocks_are_reused_without_page_faults(env: dict[str, str]) -> None:
    """`keep_freed_blocks` (the engine, once ready): a 64 MB temporary (above glibc's own
    adaptive mmap threshold, 32 MiB at most) freed and allocated again reuses the same
    heap pages instead of a new mapping's zero-filled ones, each faulted in (measured: a
    tenth of a 2,000-token prefill's time on the 1B shape); glibc's own environment
    settings win (then nothing changes)."""
    import os
    import subprocess

    def run(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _REUSE, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, **env})  # fmt: skip
        return int(out.stdout.split()[-1])

    plain, kept = run("plain"), run("keep")
    assert plain > 10 * 15000  # 16,384 pages a time, every time
    if env:
        assert kept > 10 * 15000
    else:
        assert kept < 2000  # the same pages again
