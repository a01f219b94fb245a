"""Bringing a tool-paused session's history back into the KV pool before its result comes.

A session waiting on tools (tool_waits.py) that was demoted under pressure has its history
partly in the device pool, partly in the host tier and on disk. When its result is near
(`ToolWaits.due_for_prefetch`: the round-trip estimate says so, or its client sent
`tool_done_soon`), `Prefetcher.start`:

1. locks the part still in the pool (so the allocation below cannot evict it),
2. copies the part the host tier kept into freshly allocated device slots and inserts it
   after that part (the slots join the tree: the history is cached again),
3. starts reading what the disk tier has beyond that (`DiskBackup.plan`, on the store's
   I/O thread); `poll` places it the same way once it is read,
4. holds the session again (`Retention.hold`: under the cap, demoting other idle soft
   sessions for it in the tool-aware order), so it is not let go again before its turn.

The pool is not given to a prefetch that would leave less than `RESERVE_SHARE` of it
available to running requests; what does not come back now still comes back when the
result is appended (admission restores from the host tier, the turn waits for its disk
read), and a disk read still in flight then is that turn's (`take_load`). Work here runs on
the thread that holds the engine's state; a hint only marks its wait (`hint`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import numpy as np
from radixlm.cache import MatchResult, OutOfSlots, PrefixCache
from radixlm.runtime.engine.sessions.disk_backup import DiskBackup, DiskLoad
from radixlm.runtime.engine.sessions.host_tier import HostTier
from radixlm.runtime.engine.sessions.records import Records, Session
from radixlm.runtime.engine.sessions.retention import Retention
from radixlm.runtime.engine.sessions.tool_waits import ToolWaits

log = logging.getLogger(__name__)

RESERVE_SHARE = 0.25  # of the pool that a prefetch leaves available to running requests


class Prefetcher:
    """See the module doc."""

    def __init__(self, records: Records, cache: PrefixCache, retention: Retention,
                 tools: ToolWaits, host: HostTier | None, disk: DiskBackup | None) -> None:
        self.records = records
        self.cache = cache
        self.retention = retention
        self.tools = tools
        self.host = host
        self.disk = disk
        self._handoff: dict[str, DiskLoad] = {}  # session -> its prefetch's read, for its turn
        self.pending = False  # a hinted wait not fetched yet, or a read in flight: `poll`

    # ------------------------------------------------------------------ state
    @staticmethod
    def away(s: Session) -> bool:
        """Whether part of `s`'s cached history is not held (it may be evicted, or be)."""
        return s.kv_len > s.held_len

    def tier(self, s: Session) -> str:
        """Where `s`'s history is: "device" (all of it cached in the pool), "host" (the
        rest in the host tier), "disk" (the rest, but a last partial block, on disk) or
        "recompute". Nothing is touched (an observer's question)."""
        wanted = s.wanted
        if not self.away(s):
            return "device"
        end = self.cache.page_size * (len(wanted) // self.cache.page_size)
        pos = self.cache.cached_len(wanted, s.namespace)
        if pos >= end:
            return "device"
        if self.host is not None:
            pos += sum(r.n_tokens for r in self.host.find(s.namespace, wanted, pos))
            if pos >= end:
                return "host"
        if self.disk is not None and self.disk.covered(s.namespace, wanted, pos) + \
                self.disk.block > len(wanted):
            return "disk"
        return "recompute"

    def on_device(self, s: Session) -> bool:
        return not self.away(s) or self.cache.cached_len(s.wanted, s.namespace) >= s.kv_len

    # ---------------------------------------------------------------- control
    def hint(self, s: Session) -> None:
        """Its client says the result is near: fetch at the next `run`."""
        wait = s.tool_wait
        if wait is not None and not wait.hinted:
            wait.hinted = True
            self.tools.counts["hinted"] += 1
            self.pending = True

    def poll(self, now: float) -> None:
        """(Every pass of the serving loop.) `run` while a hint or a read waits for it."""
        if self.pending:
            self.run(now)

    def run(self, now: float) -> None:
        """Start the prefetches that are due; place the disk reads that are done."""
        if not self.tools.enabled:
            self.pending = False
            return
        pending = False
        for s in list(self.records.sessions.values()):
            wait = s.tool_wait
            if wait is None or s.busy:
                continue
            if wait.load is None and self.away(s) and self.tools.due_for_prefetch(s, now):
                self.start(s)
            if wait.load is not None:
                if wait.load.done():
                    self._place(s)
                else:
                    pending = True
        self.pending = pending

    def take_load(self, s: Session) -> DiskLoad | None:
        """The disk read a prefetch of `s` started that its turn may use (once)."""
        return self._handoff.pop(s.id, None)

    def forget(self, s: Session) -> None:
        """`s` is closed, or its turn began: its prefetch's read is nobody's."""
        if s.tool_wait is not None and s.tool_wait.load is not None:
            self._handoff[s.id] = s.tool_wait.load
            s.tool_wait.load = None

    def drop(self, session_id: str) -> None:
        self._handoff.pop(session_id, None)

    # ------------------------------------------------------------------ work
    def start(self, s: Session) -> None:
        """Bring back what the host tier kept now and start reading what the disk has."""
        wait = s.tool_wait
        assert wait is not None
        wait.prefetched = True
        self.tools.counts["started"] += 1
        wanted = s.wanted
        m = self.cache.match(wanted, s.namespace)
        pos = m.length
        host = self.host
        runs = host.find(s.namespace, wanted, pos) if host is not None else []
        total = sum(r.n_tokens for r in runs)
        if host is not None and total and self._room(total):
            host.reserve(runs, True)
            with self._locked(m):
                try:
                    slots = self.cache.alloc(total)
                except OutOfSlots:
                    slots = None
            if slots is None:
                host.reserve(runs, False)
            else:
                host.load(runs, slots)
                pos = self._insert(s, m, slots)
        if self.disk is not None and pos < len(wanted):
            wait.load = self.disk.plan(s.namespace, wanted, pos)
        self.retention.hold(s)
        log.debug("session %s: prefetched %d tokens from host memory%s", s.id[:8], total,
                  ", reading from disk" if wait.load is not None else "")

    def _place(self, s: Session) -> None:
        """A prefetch's disk read is done: put it after what is cached, if it joins it."""
        wait = s.tool_wait
        assert wait is not None and wait.load is not None and self.disk is not None
        load, wait.load = wait.load, None
        m = self.cache.match(s.wanted, s.namespace)
        end = load.start + load.tokens
        if not load.blocks or not load.start <= m.length < end:
            return  # nothing read, or a gap before it (the turn recomputes that)
        if not self._room(end - m.length):
            return
        with self._locked(m):
            slots = self.disk.restore(load, m.length)
        if slots is not None:
            self._insert(s, m, slots)
            self.retention.hold(s)

    def _room(self, n: int) -> bool:
        """Whether `n` slots leave the pool `RESERVE_SHARE` available to running requests."""
        return self.cache.available() - n >= RESERVE_SHARE * self.cache.capacity

    @contextlib.contextmanager
    def _locked(self, m: MatchResult) -> Iterator[None]:
        """`m`'s path locked (the allocation in it may evict, never that)."""
        self.cache.lock(m.node)
        try:
            yield
        finally:
            self.cache.unlock(m.node)

    def _insert(self, s: Session, m: MatchResult, slots: np.ndarray) -> int:
        """Cache `s`'s history up to the end of `slots` (placed after `m`); returns how
        much of it is cached now."""
        end = m.length + len(slots)
        res = self.cache.insert(s.wanted[:end], np.concatenate([m.slots, slots]), s.namespace)
        if res.cached_len > m.length:  # (cached meanwhile: the tree keeps its own)
            self.cache.free(slots[: res.cached_len - m.length].copy())
        return end
