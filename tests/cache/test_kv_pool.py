"""The CPU KV pool is reserved, not allocated: memory is committed as slots are written.

Measured on a real process (RSS from /proc), not on the pool's own bookkeeping: a 2 GiB
pool costs (almost) nothing until used, writing a tenth of its slots costs about a
tenth of it, and never-written slots read as zeros. The pool's layout, limits and views
are those of an eagerly zeroed pool, for every KV dtype.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from radixlm.cache import HostKVPool, KVPool

MiB = 2**20

_CHILD = r"""
import json, sys, torch
from radixlm.cache import KVPool

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
layers, heads, dim, cap = 16, 8, 64, 65536   # 16 x 65536 x 8 x 64 x 2 B x 2 = 2 GiB
before = rss()
pool = KVPool(layers, heads, dim, cap, page_size=16, dtype=torch.float16)
made = rss()
zeros = all(bool((pool.k[l][::4096] == 0).all()) for l in range(layers))  # reads commit nothing
read = rss()
n = cap // 10
rows = torch.arange(n)
for l in range(layers):
    pool.k[l].index_copy_(0, rows, torch.ones(n, heads, dim, dtype=torch.float16))
    pool.v[l].index_copy_(0, rows, torch.ones(n, heads, dim, dtype=torch.float16))
wrote = rss()
print(json.dumps(dict(nbytes=pool.nbytes, made=made - before, read=read - made,
                      wrote=wrote - read, zeros=zeros, first=float(pool.k[3][n - 1, 7, 63]),
                      untouched=float(pool.v[3][n, 0, 0]))))
"""


def test_a_big_pool_commits_memory_only_where_written():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["nbytes"] == 2 * 2**30
    assert r["made"] < 16 * MiB  # reserved, not zeroed: nothing of the 2 GiB resident
    assert r["read"] < 16 * MiB  # reading untouched slots maps the shared zero page
    tenth = r["nbytes"] / 10
    assert 0.9 * tenth < r["wrote"] < 1.2 * tenth + 32 * MiB
    assert r["zeros"] and r["first"] == 1.0 and r["untouched"] == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_layout_limits_and_views_for_every_dtype(dtype):
    pool = KVPool(3, 2, 8, capacity_tokens=64, page_size=4, dtype=dtype)
    assert pool.k_buffer.dtype == dtype and pool.k[2].shape == (64, 2, 8)
    assert pool.k[1].data_ptr() == pool.k_buffer[1].data_ptr()  # views, not copies
    assert pool.k[0].is_contiguous() and pool.v[2].is_contiguous()
    item = torch.empty((), dtype=dtype).element_size()
    assert pool.nbytes == 2 * 3 * 64 * 2 * 8 * item
    assert pool.bytes_per_token == 2 * 3 * 2 * 8 * item
    assert pool.k_pages(1).shape == (16, 4, 2, 8)
    assert pool.k_pages(1).data_ptr() == pool.k[1].data_ptr()
    assert bool((pool.k_buffer == 0).all()) and bool((pool.v_buffer == 0).all())
    vals = torch.randn(5, 2, 8).to(dtype)
    pool.v[2][torch.tensor([1, 9, 17, 33, 63])] = vals
    assert torch.equal(pool.v[2][[1, 9, 17, 33, 63]], vals)
    assert int((pool.v_buffer != 0).sum()) == int((vals != 0).sum())  # nothing else moved
    host = HostKVPool.like(pool, capacity_tokens=8)
    host.copy_from_device(pool, np.array([9, 17]), [0, 5])
    assert torch.equal(host.v[2][[0, 5]], vals[1:3])
    with pytest.raises(ValueError, match="multiple"):
        KVPool(1, 1, 8, capacity_tokens=10, page_size=4, dtype=dtype)


def test_pools_are_independent_and_freed():
    """Two pools never share memory, and a pool's mapping goes with the pool."""
    import gc
    import weakref

    a = KVPool(1, 1, 8, 1024, dtype=torch.float16)
    b = KVPool(1, 1, 8, 1024, dtype=torch.float16)
    a.k[0][:] = 1
    assert bool((b.k[0] == 0).all())
    ref = weakref.ref(a.k_buffer)
    del a
    gc.collect()
    assert ref() is None
