"""Persistent prefix sessions: token-exact histories held open in the engine, their turns,
forks and pins.

A session's history is cached in the radix tree and the node at its end is locked, so
its prefix cannot be evicted and the next turn hits all of it: a turn computes only its
new tokens. When a turn ends the lock moves to the node ending prompt + output (lock the
new node, then unlock the old one). `fork` puts n sessions on the same node: no copy,
no recompute. Pins are named shared prefixes (system/tool prompts) sessions start from.

`SessionManager` is the sessions' API; the pieces it is made of are records.py (records,
ownership, locks), retention.py (the cap, demotion, priorities) and backup.py (the host
tier). A demoted session keeps working: its next turn reuses whatever of its history is
still cached, copies back what the host tier kept (`restore_from_host`) and recomputes
the rest (the turn's usage reports both).

The scheduler reaches it only through the hooks of controller.py, on the thread that
holds the engine's state (serve_loop.StateGate: the loop's, or the intake thread's while
a forward runs, which answers session commands then). Refusals are `RequestError`s
carrying a `protocol.ErrorCode` (not_found, busy, capacity, invalid_params,
duplicate_id).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future

import numpy as np
from radixlm.cache import KVPool, PrefixCache
from radixlm.cache.disk_kv import DiskKV
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.sessions.disk_backup import DiskLoad
from radixlm.runtime.engine.sessions.durable import DurableLog, PinRow, SessionRow
from radixlm.runtime.engine.sessions.records import (
    DETACHED,
    EMPTY_IDS,
    HARD,
    SOFT,
    Held,
    PinnedPrefix,
    Records,
    Residency,
    Session,
    frozen_ids,
)
from radixlm.runtime.engine.sessions.retention import Retention, common_prefix_len, tenant_of
from radixlm.runtime.engine.sessions.tiers import Tiers
from radixlm.runtime.engine.sessions.tool_waits import ToolWaits
from radixlm.runtime.protocol import ErrorCode, SessionInfo
from radixlm.runtime.rules import RequestError, check_truncate

log = logging.getLogger(__name__)


class SessionManager:
    """Sessions, pins and their retention over one `PrefixCache`.

    `kv_pool` (the device KV pool) is needed only for the host-memory tier
    (`config.host_kv_tokens > 0`); without it the tier is off. `durable` (the state
    directory's rows, durable.py): without it no session is durable.
    """

    def __init__(
        self,
        cache: PrefixCache,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        kv_pool: KVPool | None = None,
        durable: DurableLog | None = None,
        disk: DiskKV | None = None,
    ) -> None:
        self.cache = cache
        self.clock = clock
        self.durable = durable
        # A detached durable session idle this long is closed (its row deleted).
        self.durable_expiry_s = config.durable_session_expiry_s or None
        self.default_ttl_s = config.default_session_ttl_s or None
        self.records = Records(cache, clock)
        # Sessions waiting on tools: the order they are let go in, and when they come back.
        self.tools = ToolWaits()
        self.retention = Retention(self.records, cache, config.retained_cap or cache.capacity // 2,
                                   per_tenant=config.max_retained_per_tenant,
                                   multi_tenant=bool(config.auth_dir), tools=self.tools,
                                   clock=clock)
        # The host and disk tiers under the pool, and prefetches from them (tiers.py).
        self.tiers = Tiers(self.records, cache, self.retention, self.tools, config, kv_pool, disk)
        self.host, self.disk, self.prefetch = self.tiers.host, self.tiers.disk, self.tiers.prefetch
        log.info(
            "sessions: retained cap %d of %d tokens, default ttl %s, host tier %s, disk tier %s",
            self.retained_cap,
            cache.capacity,
            f"{self.default_ttl_s}s" if self.default_ttl_s else "off",
            f"{self.host.capacity} tokens" if self.host else "off",
            f"{disk.capacity / 2**20:.0f} MiB at {disk.dir}" if self.disk and disk else "off",
        )

    # ------------------------------------------------------------------ open
    def open(
        self,
        client: bytes,
        namespace: str | None = None,
        retention: str = HARD,
        ttl_s: float | None = None,
        pinned: str | None = None,
        input_ids: np.ndarray | Sequence[int] = (),
        durable: bool = False,
        tenant: str | None = None,
        program: str | None = None,
    ) -> Session:
        """A new idle session with an empty history or the pin's.

        `input_ids` is what the opening turn will append (the scheduler then runs it as
        a 0-token generation: `begin_turn` … `end_turn`); it is checked against the
        retention cap here, before anything is prefilled. `durable` is granted only with
        a state directory (then the caller saves it with `persist` before it answers).
        `program` (scoped by the caller) names the program its turns belong to; by default
        the session is a program of its own.
        """
        if retention not in (HARD, SOFT):
            raise RequestError(
                ErrorCode.INVALID_PARAMS, f"retention must be 'hard' or 'soft', not {retention!r}"
            )
        if ttl_s is not None and not ttl_s > 0:
            raise RequestError(
                ErrorCode.INVALID_PARAMS, f"ttl_s must be > 0 seconds, got {ttl_s!r}"
            )
        base, node, held_len = EMPTY_IDS, None, 0
        if pinned is not None:
            pin = self.records.pins.get(pinned)
            if pin is None or pin.namespace != namespace:
                where = f" in namespace {namespace!r}" if pin is not None else ""
                raise RequestError(ErrorCode.NOT_FOUND, f"no pinned prefix named {pinned!r}{where}")
            base, node, held_len = pin.ids, pin.node, pin.held_len
        extra = frozen_ids(input_ids)
        reserved = None
        if len(extra):
            reserved = Held(namespace, self.retention.cacheable(np.concatenate([base, extra])))
            self.retention.admit(reserved)
        if node is not None:
            self.records.lock_node(node)
        sid = self.records.new_id()
        s = Session(
            id=sid,
            client=client,
            namespace=namespace,
            retention=retention,
            ttl_s=ttl_s if ttl_s is not None else self.default_ttl_s,
            history=base,
            residency=Residency.HELD,
            node=node,
            held_len=held_len,
            kv_len=held_len,
            last_used=self.clock(),
            reserved=reserved,
            durable=durable and self.durable is not None,
            tenant=tenant,
            program=program or f"session:{sid}",
        )
        self.records.sessions[s.id] = s
        log.debug("session %s opened (%s, %d tokens)", s.id[:8], retention, s.length)
        return s

    def get(self, session_id: str, client: bytes) -> Session:
        """The session, if `client` owns it; otherwise NOT_FOUND."""
        return self.records.get(session_id, client)

    # ----------------------------------------------------------------- turns
    def begin_turn(
        self,
        session_id: str,
        client: bytes,
        appended_ids: np.ndarray | Sequence[int],
        namespace: str | None = None,
    ) -> np.ndarray:
        """The turn's full prompt (history + appended); marks the session busy.

        Match the prompt in the *session's* namespace (`get(...).namespace`); a request
        naming another namespace gets NOT_FOUND. A second turn while one runs gets
        BUSY.
        """
        s = self.get(session_id, client)
        if namespace is not None and namespace != s.namespace:
            raise RequestError(
                ErrorCode.NOT_FOUND, f"no session {session_id!r} in namespace {namespace!r}"
            )
        if s.busy:
            raise RequestError(
                ErrorCode.BUSY, f"session {session_id!r} already has a request in flight"
            )
        prompt = np.concatenate([s.history, frozen_ids(appended_ids)])
        s.busy = True
        s.turn_kv_len = s.kv_len
        s.last_used = self.clock()
        if s.tool_wait is not None:  # the result of its calls (or whatever comes next)
            self.prefetch.forget(s)
            self.tools.returned(s, s.last_used, self.prefetch.on_device(s))
        return prompt

    def restore_from_host(self, session_id: str, cached_len: int,
                          load: DiskLoad | None = None) -> np.ndarray | None:
        """Device slots now holding the K/V of the history the host tier kept after
        `cached_len` (the prompt's device match, already locked by the caller), and after
        that of what `load` read from the disk tier, or None (`Tiers.restore`)."""
        s = self.records.sessions.get(session_id)
        return None if s is None else self.tiers.restore(s, cached_len, load)

    def restore_prefix(self, cached_len: int, load: DiskLoad | None) -> np.ndarray | None:
        """A pin's prefix: the slots `load` fills after `cached_len`, or None."""
        return self.tiers.then_disk(None, cached_len, load)

    def plan_load(self, session_id: str) -> DiskLoad | None:
        """Start reading from the disk tier what a turn of `session_id` will not find in
        the device cache or the host tier (the turn waits for it: `DiskLoad.done`);
        None when all is there or the disk has none of it."""
        s = self.records.sessions.get(session_id)
        return None if s is None else self.tiers.plan_load(s)

    def plan_prefix_load(self, ids: np.ndarray, namespace: str | None) -> DiskLoad | None:
        """As `plan_load`, for a pin's prefix."""
        return self.tiers.plan_prefix_load(ids, namespace)

    def recomputed_tokens(self, session_id: str, reused_len: int) -> int:
        """History tokens the running turn recomputes because they were evicted since the
        session last changed: the history then cached minus what this turn reuses
        (`reused_len` = device match + restored). 0 while the history stays held."""
        s = self.records.sessions.get(session_id)
        return 0 if s is None else max(0, s.turn_kv_len - reused_len)

    def end_turn(
        self, session_id: str, history_ids: np.ndarray | Sequence[int],
        assistant_open: bool | None = None,
    ) -> Session | None:
        """The turn finished: the history becomes `history_ids` (prompt + output, already
        inserted by the caller) and the session is idle again. The lock moves to the node
        ending its longest cached prefix (new one locked, then the old one unlocked) if the
        retention cap allows, after demoting idle soft sessions; if not, the session keeps
        its previous lock and the new tokens are ordinary cache. Returns None if the
        session was closed meanwhile.

        The new lock is found by matching the history again, which is exact even when
        the caller's insert was cut short. `assistant_open` (None: as it was) sets
        `Session.assistant_open`.
        """
        s = self.records.sessions.get(session_id)
        if s is None:
            return None
        history = frozen_ids(history_ids)
        if common_prefix_len(history, s.history) != s.length:
            raise ValueError(
                f"end_turn: the new history of session {session_id[:8]} does not extend "
                f"its current one ({s.length} tokens)"
            )
        s.history = history
        if assistant_open is not None:
            s.assistant_open = assistant_open
        s.busy = False
        s.reserved = None
        s.last_used = self.clock()
        self._advance_lock(s)
        self.persist(s)
        return s

    def wait_on_tools(self, session_id: str, tools: Sequence[str]) -> None:
        """The turn that just ended called `tools` (none: it waits on nothing): the
        session waits for their results (tool_waits.py)."""
        s = self.records.sessions.get(session_id)
        if s is not None:
            self.tools.mark(s, tools, self.clock(),
                            tenant_of(s.namespace, self.retention.multi_tenant))

    def tool_done_soon(self, session_id: str, client: bytes) -> None:
        """The client says the result its session waits for is near: bring the history
        back now (at the loop's next pass: `Prefetcher.poll`). A session that waits on
        nothing, or is busy, is left as it is; another client's is NOT_FOUND."""
        s = self.get(session_id, client)
        if not s.busy:
            self.prefetch.hint(s)

    def abort_turn(self, session_id: str) -> None:
        """The turn died (abort, error): idle again, history unchanged."""
        s = self.records.sessions.get(session_id)
        if s is not None:
            s.busy = False
            s.reserved = None
            s.last_used = self.clock()

    def branch(
        self,
        session_id: str,
        history_ids: np.ndarray | Sequence[int],
        index: int = 0,
        assistant_open: bool | None = None,
    ) -> str:
        """A new session continuing `session_id` with `history_ids` (branch `index` of an
        n > 1 turn: prompt + that branch's output). Allowed while the parent is busy."""
        parent = self.records.sessions.get(session_id)
        if parent is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"no session {session_id!r}")
        s = self.records.clone(parent, frozen_ids(history_ids), index)
        if assistant_open is not None:
            s.assistant_open = assistant_open
        self._advance_lock(s)
        self.persist(s)
        return s.id

    def seed_offset(self, session_id: str) -> int:
        """What a seeded turn of the session adds to its seed (`protocol.branch_seed`): 0
        for a session opened directly (a seed means what it means without sessions), a
        number derived from its lineage for a fork or branch, so sibling forks given the
        same seed sample differently while a rerun of the same program samples the same."""
        s = self.records.sessions.get(session_id)
        if s is None or not s.lineage:
            return 0
        digest = hashlib.blake2b(repr(s.lineage).encode(), digest_size=4).digest()
        return 1 + int.from_bytes(digest, "little")

    def _advance_lock(self, s: Session) -> None:
        if self.retention.advance_lock(s):  # a demoted session is held again
            self._prune_host()

    # ------------------------------------------------------- fork / truncate
    def fork(self, session_id: str, client: bytes, n: int) -> list[str]:
        """n new sessions on the same node: no copy, no recompute (a demoted session's
        forks are demoted too). `n` is the frontend's rule (rules.check_fork). A wait on
        tools moves to the forks: the result goes on in them (an HTTP continuation forks
        the held history the call ended), and the parent waits on nothing."""
        s = self.records.idle(session_id, client)
        ids = []
        for i in range(n):
            f = self.records.clone(s, s.history, i)
            f.residency, f.node, f.held_len = s.residency, s.node, s.held_len
            f.kv_len, f.priority_raised = s.kv_len, s.priority_raised
            if s.tool_wait is not None:
                f.tool_wait = dataclasses.replace(s.tool_wait, load=None)
            if f.node is not None:
                self.records.lock_node(f.node)
            self.persist(f)
            ids.append(f.id)
        self._stop_waiting(s)
        s.last_used = self.clock()
        return ids

    def truncate(self, session_id: str, client: bytes, length: int) -> Session:
        """Rewind the history to its first `length` tokens. The cut-off tail stays in the
        tree as ordinary evictable cache. A cut closes whatever assistant turn was open
        (its point is the client's, who sees tokens, not turns)."""
        s = self.records.idle(session_id, client)
        check_truncate(length, s.length)
        self._stop_waiting(s)  # (a rewound history waits on nothing)
        old = s.wanted
        s.history = s.history[:length]
        s.assistant_open = False
        s.kv_len = min(s.kv_len, length)
        if s.held_len > length:  # shrinking always fits under the cap
            self.records.lock_at(s, self.cache.match(s.history, s.namespace))
        self.retention.lower_priority(s, old)
        s.last_used = self.clock()
        self._prune_host()
        self.persist(s)
        return s

    # ---------------------------------------------------------------- close
    def close(self, session_id: str, client: bytes) -> None:
        """Unlock the session's history (its KV stays as evictable cache) and forget it."""
        self._release(self.records.idle(session_id, client))

    def client_gone(self, client: bytes) -> int:
        """Close every session of `client`, busy or not (the caller aborts its requests;
        a later end_turn/abort_turn for them is a no-op), except durable ones, which are
        detached: kept, under their TTL and retention, for a client of their tenant to
        `resume`. Pins are global and stay. Returns the number closed."""
        gone = [s for s in self.records.sessions.values() if s.client == client]
        closed = 0
        for s in gone:
            if s.durable:
                s.client = DETACHED
                s.last_used = self.clock()
                log.debug("session %s detached (durable)", s.id[:8])
            else:
                self._release(s)
                closed += 1
        return closed

    def resume(self, session_id: str, client: bytes, tenant: str | None) -> Session:
        """Make durable session `session_id` the connection `client`'s own (its previous
        connection loses it). NOT_FOUND unless it is durable and of `tenant`, exactly as
        for an unknown id; BUSY while a turn runs."""
        s = self.records.sessions.get(session_id)
        if s is None or not s.durable or s.tenant != tenant:
            raise RequestError(ErrorCode.NOT_FOUND, f"no session {session_id!r}")
        if s.busy:
            raise RequestError(ErrorCode.BUSY, f"session {session_id!r} has a request in flight")
        s.client = client
        s.last_used = self.clock()
        log.debug("session %s resumed", s.id[:8])
        return s

    def _stop_waiting(self, s: Session) -> None:
        self.prefetch.forget(s)
        self.prefetch.drop(s.id)
        s.tool_wait = None

    def _release(self, s: Session) -> None:
        self._stop_waiting(s)
        self.records.unlock(s)
        del self.records.sessions[s.id]
        self.retention.lower_priority(s, s.wanted)
        self._prune_host()
        if s.durable and self.durable is not None:
            self.durable.delete_session(s.id)
        log.debug("session %s closed", s.id[:8])

    # --------------------------------------------------------------- durable
    def persist(self, s: Session) -> Future[None] | None:
        """Save a durable session's row (None: not durable); the future resolves once it
        is committed."""
        if not s.durable or self.durable is None:
            return None
        row = SessionRow(s.id, s.tenant, s.namespace, s.retention, s.ttl_s, s.history,
                         s.assistant_open, s.lineage)
        if self.disk is not None:
            self.disk.save(s)  # its KV, in the background
        return self.durable.save_session(row, time.time())

    def load_state(self, sessions: list[SessionRow]) -> int:
        """Durable sessions read back at start (durable.py): detached and demoted, their
        whole history what their next turn should find (on disk, or recomputed); idle
        since their last write. Returns how many were loaded."""
        now, wall = self.clock(), time.time()
        for row in sessions:
            self.records.sessions[row.id] = Session(
                id=row.id, client=DETACHED, namespace=row.namespace, retention=row.retention,
                ttl_s=row.ttl_s, history=row.history, residency=Residency.DEMOTED, node=None,
                held_len=0, kv_len=len(row.history),
                last_used=now - max(0.0, wall - row.updated), lineage=row.lineage,
                assistant_open=row.assistant_open, durable=True, tenant=row.tenant)
        return len(sessions)

    def _prune_host(self) -> None:
        self.tiers.prune()

    # ------------------------------------------------------------------ pins
    def check_pin(
        self, name: str, ids: np.ndarray | Sequence[int], namespace: str | None = None
    ) -> None:
        """Refuse a pin before it is prefilled: name taken, or beyond the retention cap
        (after demoting idle soft sessions). An empty name is the frontend's rule."""
        if name in self.records.pins:
            raise RequestError(ErrorCode.DUPLICATE_ID, f"a prefix is already pinned as {name!r}")
        self.retention.admit(Held(namespace, self.retention.cacheable(frozen_ids(ids))))

    def pin(
        self, name: str, ids: np.ndarray | Sequence[int], namespace: str | None = None
    ) -> PinnedPrefix:
        """Hold the prefilled (and inserted) `ids` as the pin `name` (its node is found by
        matching them, as in end_turn)."""
        ids = frozen_ids(ids)
        self.check_pin(name, ids, namespace)
        m = self.cache.match(ids, namespace)
        locked = m.node if m.length else None
        if locked is not None:
            self.records.lock_node(locked)
        pin = PinnedPrefix(name, namespace, ids, locked, m.length)
        self.records.pins[name] = pin
        log.info("pinned %r (%d tokens, %d cached)", name, len(ids), m.length)
        return pin

    def persist_pin(self, pin: PinnedPrefix) -> Future[None] | None:
        """Save a pin (every pin is kept across restarts when there is a state directory)."""
        if self.durable is None:
            return None
        if self.disk is not None:
            self.disk.save_prefix(pin.namespace, pin.ids)
        return self.durable.save_pin(PinRow(pin.name, pin.namespace, pin.ids))

    def unpin(self, name: str) -> None:
        """Release a pin (its KV stays as evictable cache; sessions opened from it keep
        their own locks)."""
        pin = self.records.pins.pop(name, None)
        if pin is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"no pinned prefix named {name!r}")
        if pin.node is not None:
            self.records.unlock_node(pin.node)
        if self.durable is not None:
            self.durable.delete_pin(name)
        log.info("unpinned %r", name)

    # ------------------------------------------------------------- retention
    def tick(self, now: float | None = None) -> list[str]:
        """Demote idle sessions past their TTL (returns their ids), and close detached
        durable sessions idle past the durable expiry."""
        now = self.clock() if now is None else now
        if self.durable_expiry_s is not None:
            for s in [s for s in self.records.sessions.values()
                      if s.client == DETACHED and now - s.last_used > self.durable_expiry_s]:
                log.info("session %s: detached for %.0fs, closed", s.id[:8], now - s.last_used)
                self._release(s)
        if self.disk is not None:
            self.disk.tick()
        demoted = self.retention.tick(now)
        self.prefetch.run(now)
        return demoted

    def make_room(self, n_tokens: int) -> int:
        """Demote idle soft sessions (LRU) until `n_tokens` more are evictable; returns
        the tokens made evictable."""
        return self.retention.make_room(n_tokens)

    def retained_tokens(self) -> dict[str, int]:
        """Distinct retained tokens by class: "pinned", "hard", "soft"."""
        return self.retention.retained_tokens()

    def retained_total(self) -> int:
        return self.retention.retained_total()

    @property
    def retained_cap(self) -> int:
        return self.retention.cap

    # ----------------------------------------------------------- observation
    @property
    def num_sessions(self) -> int:
        return len(self.records.sessions)

    @property
    def num_pins(self) -> int:
        return len(self.records.pins)

    @property
    def host_capacity(self) -> int:
        return self.host.capacity if self.host else 0

    @property
    def host_used(self) -> int:
        return self.host.used if self.host else 0

    def sessions(self) -> Iterator[Session]:
        return iter(self.records.sessions.values())

    def pins(self) -> Iterator[PinnedPrefix]:
        return iter(self.records.pins.values())

    def list(self, client: bytes, everyone: bool = False,
             tenant: str | None = None) -> list[SessionInfo]:
        """`client`'s sessions and its `tenant`'s detached durable ones (every client's
        with `everyone`, others' ids cut short)."""
        return self.records.list(client, everyone, tenant, self.prefetch.tier)

    def tool_stats(self, tenant: str | None = None) -> dict[str, dict]:
        """The StatsReply fields about tool waits (`tenant`: its own tools only)."""
        tiers: dict[str, int] = {}
        for s in self.records.sessions.values():
            if s.tool_wait is not None and (tenant is None or s.tool_wait.tenant == tenant):
                tier = self.prefetch.tier(s)
                tiers[tier] = tiers.get(tier, 0) + 1
        return {"tool_waits": tiers, "tool_round_trip_s": self.tools.round_trips(tenant),
                "prefetch": dict(self.tools.counts)}
