"""The disk tier's glue to sessions: save their histories' KV, load it back for a turn.

Under the host tier (backup.py), blocks of KV go to `DiskKV` (cache/disk_kv.py) in the
state directory, keyed by the chain of prefix hashes of the session's namespace and
tokens, so forks and sessions sharing a prefix share blocks, and another tenant's
namespace never finds them:

- **Saved** (`save`): a durable session's or pin's history after each turn, and any
  session's blocks that the host tier drops for room (`on_host_evict`). The loop only
  gathers a block's K/V into a host buffer (a bounded number of blocks per call, the
  rest at the next `tick`); the I/O thread writes it.
- **Loaded** (`plan` + `restore`): a turn of a session whose history is no longer all
  cached (demoted, or read back after a restart) asks the disk for the blocks beyond
  what the device and the host tier have. The request waits, holding no KV, in the
  scheduler's held-back queue (`DiskLoad.done`) while other requests run; the I/O
  thread reads and checks the blocks; at admission `restore` copies them into the slots
  after the device match and the host tier's part. A block that fails its checks ends
  the run there: those tokens are recomputed, never wrong.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Hashable

import numpy as np
import torch
from radixlm.cache import KVPool, OutOfSlots, PrefixCache
from radixlm.cache.disk_kv import Block, DiskKV, KVLayout, chain_keys, namespace_root
from radixlm.runtime.engine.sessions.host_tier import HostSegment, HostTier
from radixlm.runtime.engine.sessions.records import Records, Session
from radixlm.runtime.engine.sessions.retention import common_prefix_len

log = logging.getLogger(__name__)

BLOCK_TOKENS = 64  # rounded up to a whole number of pages
SAVE_BLOCKS_PER_CALL = 32  # blocks gathered on the loop per `save`/`tick` (~48 MiB: SmolLM2)
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def layout_of(pool: KVPool) -> KVLayout:
    block = math.lcm(BLOCK_TOKENS, pool.page_size)
    return KVLayout(pool.num_layers, pool.num_kv_heads, pool.head_dim, _DTYPES[pool.dtype], block)


class DiskLoad:
    """Blocks of one turn's history being read (from `start`, in tokens); `done` once the
    I/O thread has them (or found fewer)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.blocks: list[Block] = []
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, blocks: list[Block]) -> None:  # (the I/O thread)
        self.blocks = blocks
        self._done.set()

    @property
    def tokens(self) -> int:
        return sum(len(b.tokens) for b in self.blocks)


def tenant_of(namespace: Hashable) -> str:
    """The disk tier's tenant of an engine-side namespace: its head (``TENANT/NS``), the
    folder and share its blocks count in. (What isolates tenants is the chain: its root
    is the whole namespace.)"""
    return namespace.partition("/")[0] if isinstance(namespace, str) else ""


class DiskBackup:
    """The sessions' use of one `DiskKV`."""

    def __init__(self, records: Records, cache: PrefixCache, pool: KVPool, store: DiskKV,
                 host: HostTier | None) -> None:
        self.records = records
        self.cache = cache
        self.pool = pool
        self.store = store
        self.block = store.layout.block_tokens
        self.host = host
        self._dirty: dict[str, int] = {}  # session or pin -> first block maybe unsaved
        self.loads = {"asked": 0, "blocks": 0, "tokens": 0}

    # ------------------------------------------------------------------- saving
    def save(self, s: Session) -> None:
        """Queue the blocks of `s`'s cached history that the disk does not have."""
        self._dirty.setdefault(s.id, 0)
        self._save_some(SAVE_BLOCKS_PER_CALL)

    def save_all(self, s: Session) -> None:
        """Queue every block of `s`'s cached history that the disk does not have, now
        (it is about to be evicted: a session waiting on tools, demoted without a host
        tier to keep it)."""
        wanted = s.wanted
        self._save_history(s.namespace, wanted, 0, len(wanted) // self.block + 1)

    def save_prefix(self, namespace: Hashable, ids: np.ndarray) -> None:
        """Queue the blocks of a pin's prefix (as many as one call's budget)."""
        self._save_history(namespace, ids, 0, SAVE_BLOCKS_PER_CALL)

    def tick(self) -> None:
        if self._dirty:
            self._save_some(SAVE_BLOCKS_PER_CALL)

    def _save_some(self, budget: int) -> None:
        for sid in list(self._dirty):
            s = self.records.sessions.get(sid)
            if s is None:
                del self._dirty[sid]
                continue
            done, budget = self._save_history(s.namespace, s.history, self._dirty[sid],
                                              budget)
            if done is None:
                del self._dirty[sid]
            else:
                self._dirty[sid] = done
            if budget <= 0:
                return

    def _save_history(self, namespace: Hashable, history: np.ndarray, first: int,
                      budget: int) -> tuple[int | None, int]:
        """Save blocks `first`.. of `history` that are cached on the device; returns
        (the block to go on from, or None when all are queued or present; budget left)."""
        b = self.block
        keys = chain_keys(_ns(namespace), history, b)
        if first >= len(keys):
            return None, budget
        m = self.cache.match(history[: len(keys) * b], namespace)
        parents = [namespace_root(_ns(namespace)), *keys[:-1]]
        for i in range(first, min(len(keys), m.length // b)):
            if self.store.present_prefix(keys[i:i + 1]):
                continue
            if budget <= 0:
                return i, 0
            k, v = self._gather(self.pool, m.slots[i * b:(i + 1) * b])
            self.store.put(tenant_of(namespace), keys[i], parents[i],
                           history[i * b:(i + 1) * b], k, v)
            budget -= 1
        return None, budget

    @staticmethod
    def _gather(pool: KVPool, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = torch.as_tensor(np.array(slots, dtype=np.int64), device=pool.k_buffer.device)
        k = pool.k_buffer.index_select(1, idx).contiguous().cpu()
        v = pool.v_buffer.index_select(1, idx).contiguous().cpu()
        return k.view(torch.uint8).numpy().reshape(-1), v.view(torch.uint8).numpy().reshape(-1)

    def on_host_evict(self, seg: HostSegment) -> None:
        """The host tier drops `seg` for room: write the blocks of a session's history
        that lie wholly inside it (from host memory) before they go."""
        if self.host is None:
            return
        ns, p, b = seg.key[0], seg.prefix_len, self.block
        for s in self.records.sessions.values():
            h = s.wanted
            if s.namespace != ns or len(h) <= p or not self.host.runs_through(seg, ns, h):
                continue
            n = common_prefix_len(seg.tokens, h[p:])
            keys = chain_keys(_ns(ns), h[: p + n], b)
            for i in range(-(-p // b), (p + n) // b):
                if self.store.present_prefix(keys[i:i + 1]):
                    continue
                host_slots = seg.host_slots[i * b - p:(i + 1) * b - p]
                k, v = self._gather(self.host.pool, host_slots)
                parent = keys[i - 1] if i else namespace_root(_ns(ns))
                self.store.put(tenant_of(ns), keys[i], parent, h[i * b:(i + 1) * b], k, v)
            return

    # ------------------------------------------------------------------ loading
    def covered(self, namespace: Hashable, tokens: np.ndarray, pos: int) -> int:
        """Where the disk's run of `tokens`' blocks from the one holding `pos` ends (`pos`
        when it has none): an observer's question, nothing is read."""
        b = self.block
        first = pos // b
        keys = chain_keys(_ns(namespace), tokens, b)
        n = self.store.present_prefix(keys[first:])
        return (first + n) * b if n else pos

    def plan(self, namespace: Hashable, tokens: np.ndarray, pos: int) -> DiskLoad | None:
        """Start reading the blocks of `tokens` (a history, or a pin's prefix, in
        `namespace`) after `pos` (what the device cache and the host tier give), if the
        disk has them; None when it has nothing there."""
        b = self.block
        if pos >= len(tokens) - len(tokens) % b:
            return None
        keys = chain_keys(_ns(namespace), tokens, b)
        first = pos // b
        n = self.store.present_prefix(keys[first:])
        if n == 0:
            return None
        parents = [namespace_root(_ns(namespace)), *keys[:-1]]
        load = DiskLoad(first * b)
        self.loads["asked"] += 1
        self.store.read(tenant_of(namespace), keys[first:first + n], parents[first:first + n],
                        [tokens[i * b:(i + 1) * b] for i in range(first, first + n)],
                        load.finish)
        return load

    def restore(self, load: DiskLoad, pos: int) -> np.ndarray | None:
        """Device slots holding the loaded K/V of history tokens `pos`.. (the run of
        blocks that covers `pos`), or None (nothing there, or no room: recomputed)."""
        end = load.start + load.tokens
        if not load.blocks or not load.start <= pos < end:
            return None
        n = end - pos
        try:
            slots = self.cache.alloc(n)
        except OutOfSlots:
            log.info("no room to load %d tokens from disk, recomputing", n)
            return None
        lay, b, done = self.store.layout, self.block, 0
        shape = (lay.num_layers, b, lay.num_kv_heads, lay.head_dim)
        dev = self.pool.k_buffer.device
        for i, block in enumerate(load.blocks):
            lo = max(pos - (load.start + i * b), 0)
            if lo >= b:
                continue
            dst = torch.as_tensor(slots[done:done + b - lo], device=dev)
            for src, buf in ((block.k, self.pool.k_buffer), (block.v, self.pool.v_buffer)):
                t = torch.from_numpy(np.array(src)).view(self.pool.dtype).view(shape)
                buf.index_copy_(1, dst, t[:, lo:].to(dev))
            done += b - lo
        self.loads["blocks"] += len(load.blocks)
        self.loads["tokens"] += n
        load.blocks = []  # the device has them now
        return slots


def _ns(namespace: Hashable) -> str | None:
    return namespace if isinstance(namespace, str) or namespace is None else str(namespace)
