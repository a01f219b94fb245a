"""The tiers under the KV pool, as sessions use them: the host-memory tier (host_tier.py +
backup.py), the disk tier (disk_backup.py) and prefetches from both (prefetch.py).
A demoted history goes to the host tier as it is evicted, and from there to disk as the
host tier drops it; without a host tier, a session waiting on tools is saved to disk as
it is demoted (what it will want back soon is not dropped).

A turn of a session whose history is no longer all cached asks the disk for what the
device and the host tier do not have as it arrives (`plan_load`: the turn waits, holding
nothing, while it is read), and its admission copies back the host tier's part and then
the disk's (`restore`). A prefetch may have started that read already: the turn takes it.
A pin's prefix, or an opening turn's prompt, is read the same way (`plan_prefix_load`,
`restore_prefix`). The controller calls these with the turn's session id (a session
closed meanwhile has nothing to restore).
"""

from __future__ import annotations

import logging

import numpy as np
from radixlm.cache import KVPool, PrefixCache
from radixlm.cache.disk_kv import DiskKV
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.sessions.backup import HostBackup
from radixlm.runtime.engine.sessions.disk_backup import DiskBackup, DiskLoad
from radixlm.runtime.engine.sessions.host_tier import HostTier
from radixlm.runtime.engine.sessions.prefetch import Prefetcher
from radixlm.runtime.engine.sessions.records import Records
from radixlm.runtime.engine.sessions.retention import Retention
from radixlm.runtime.engine.sessions.tool_waits import ToolWaits

log = logging.getLogger(__name__)


class Tiers:
    """The host tier (`config.host_kv_tokens > 0` and a `kv_pool`), the disk tier (`disk`
    and a `kv_pool`), and the prefetcher over them."""

    def __init__(self, records: Records, cache: PrefixCache, retention: Retention,
                 tools: ToolWaits, config: EngineConfig, kv_pool: KVPool | None,
                 disk: DiskKV | None) -> None:
        self.records = records
        self.cache = cache
        self.host: HostTier | None = None
        self.backup: HostBackup | None = None
        if config.host_kv_tokens > 0:
            if kv_pool is None:
                log.warning("host_kv_tokens set but no KV pool given: host tier off")
            else:
                self.host = HostTier(kv_pool, config.host_kv_tokens)
                self.backup = HostBackup(records, cache, self.host)
        # The disk tier (the state directory's KV): under the host tier, when both are on.
        self.disk: DiskBackup | None = None
        if disk is not None and kv_pool is not None:
            self.disk = DiskBackup(records, cache, kv_pool, disk, self.host)
            if self.host is not None:
                self.host.on_evict = self.disk.on_host_evict
        self.prefetch = Prefetcher(records, cache, retention, tools, self.host, self.disk)
        if self.disk is not None and self.host is None:  # demoted to disk, not dropped
            retention.on_demote_waiting = self.disk.save_all

    # ---------------------------------------------------------------- restore
    def restore(self, session_id: str, cached_len: int,
                load: DiskLoad | None = None) -> np.ndarray | None:
        """Device slots now holding the K/V of the history of `session_id` the host tier
        kept after `cached_len` (the prompt's device match, already locked by the
        caller), and after that of what `load` read from the disk tier, or None.

        The slots are the caller's, like freshly allocated ones: it treats those tokens as
        cached (no compute), inserts them with the prompt, and frees them if the request
        dies before that. None when the tiers are off, have nothing, the pool cannot hold
        the restore (the tokens are then recomputed) or the session was closed.
        """
        s = self.records.sessions.get(session_id)
        if s is None:
            return None
        host = self.backup.restore(s, cached_len) if self.backup is not None else None
        return self.then_disk(host, cached_len, load)

    def restore_prefix(self, cached_len: int, load: DiskLoad | None) -> np.ndarray | None:
        """A pin's prefix: the slots `load` fills after `cached_len`, or None."""
        return self.then_disk(None, cached_len, load)

    def then_disk(self, host: np.ndarray | None, cached_len: int,
                  load: DiskLoad | None) -> np.ndarray | None:
        """`host` followed by what `load` read from the disk after it."""
        if self.disk is None or load is None:
            return host
        pos = cached_len + (len(host) if host is not None else 0)
        disk = self.disk.restore(load, pos)
        if disk is None:
            return host
        return disk if host is None else np.concatenate([host, disk])

    def plan_load(self, session_id: str) -> DiskLoad | None:
        """Start reading from the disk what a turn of `session_id` will not find in the
        device cache or the host tier (or take the read a prefetch started; the turn
        waits for it: `DiskLoad.done`); None when all is there, the disk has none of it
        or the session was closed."""
        s = self.records.sessions.get(session_id)
        if s is None:
            return None
        started = self.prefetch.take_load(s)
        if self.disk is None or s.kv_len <= s.held_len:
            return None
        wanted = s.wanted
        pos = self.cache.match(wanted, s.namespace).length
        if self.host is not None:
            pos += sum(r.n_tokens for r in self.host.find(s.namespace, wanted, pos))
        if started is not None and started.start <= pos:
            return started
        return self.disk.plan(s.namespace, wanted, pos)

    def plan_prefix_load(self, ids: np.ndarray, namespace: str | None) -> DiskLoad | None:
        """As `plan_load`, for a pin's prefix (or an opening turn's prompt)."""
        if self.disk is None:
            return None
        return self.disk.plan(namespace, ids, self.cache.match(ids, namespace).length)

    def prune(self) -> None:
        """Drop host segments no session's history runs through any more."""
        if self.backup is not None:
            self.backup.prune()
