"""Persistent prefix sessions: token-exact histories held open in the engine, their turns,
forks and pins.

A session's history is cached in the radix tree and the node at its end is locked, so
its prefix cannot be evicted and the next turn hits all of it: a turn computes only its
new tokens. When a turn ends the lock moves to the node ending prompt + output (lock the
new node, then unlock the old one). `fork` puts n sessions on the same node: no copy,
no recompute. Pins are named shared prefixes (system/tool prompts) sessions start from.

`SessionManager` is the sessions' API; the pieces it is made of are records.py (records,
ownership, locks), retention.py (the cap, demotion, priorities), tiers.py (the host and
disk tiers: `tiers`), pins.py (the pins: `pinned`), durability.py (durable sessions' and
pins' rows, detach and resume: `durability`) and session_waits.py (tool waits: `waits`).
A demoted session keeps working: its next turn reuses whatever of its history is still
cached, copies back what the host and disk tiers kept (`Tiers.restore`) and recomputes
the rest (the turn's usage reports both).

The scheduler reaches it only through the hooks of controller.py, on the thread that
holds the engine's state (serve_loop.StateGate: the loop's, or the intake thread's while
a forward runs, which answers session commands then). Refusals are `RequestError`s
carrying a `protocol.ErrorCode` (not_found, busy, capacity, invalid_params,
duplicate_id).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from radixlm.cache import KVPool, PrefixCache
from radixlm.cache.disk_kv import DiskKV
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.sessions.durability import Durability
from radixlm.runtime.engine.sessions.durable import DurableLog
from radixlm.runtime.engine.sessions.pins import Pins
from radixlm.runtime.engine.sessions.records import (
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
from radixlm.runtime.engine.sessions.retention import Retention, common_prefix_len
from radixlm.runtime.engine.sessions.session_waits import SessionWaits
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
        self.waits = SessionWaits(self.records, self.tools, self.prefetch,
                                  self.retention.multi_tenant, clock)
        # A detached durable session idle `durable_session_expiry_s` is closed.
        self.durability = Durability(self.records, clock, durable, self.disk,
                                     config.durable_session_expiry_s or None)
        self.pinned = Pins(self.records, cache, self.retention, self.durability)
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
        a state directory (then the caller saves it with `Durability.persist` before it
        answers).
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
            pin = self.pinned.get(pinned, namespace)
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
            durable=durable and self.durability.enabled,
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
        self.waits.returned(s, s.last_used)
        return prompt

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
        self.durability.persist(s)
        return s

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
        self.durability.persist(s)
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
            self.waits.inherit(f, s)
            if f.node is not None:
                self.records.lock_node(f.node)
            self.durability.persist(f)
            ids.append(f.id)
        self.waits.stop(s)
        s.last_used = self.clock()
        return ids

    def truncate(self, session_id: str, client: bytes, length: int) -> Session:
        """Rewind the history to its first `length` tokens. The cut-off tail stays in the
        tree as ordinary evictable cache. A cut closes whatever assistant turn was open
        (its point is the client's, who sees tokens, not turns)."""
        s = self.records.idle(session_id, client)
        check_truncate(length, s.length)
        self.waits.stop(s)  # (a rewound history waits on nothing)
        old = s.wanted
        s.history = s.history[:length]
        s.assistant_open = False
        s.kv_len = min(s.kv_len, length)
        if s.held_len > length:  # shrinking always fits under the cap
            self.records.lock_at(s, self.cache.match(s.history, s.namespace))
        self.retention.lower_priority(s, old)
        s.last_used = self.clock()
        self._prune_host()
        self.durability.persist(s)
        return s

    # ---------------------------------------------------------------- close
    def close(self, session_id: str, client: bytes) -> None:
        """Unlock the session's history (its KV stays as evictable cache) and forget it."""
        self._release(self.records.idle(session_id, client))

    def client_gone(self, client: bytes) -> int:
        """Close every session of `client`, busy or not (the caller aborts its requests;
        a later end_turn/abort_turn for them is a no-op), except durable ones, which are
        detached: kept, under their TTL and retention, for a client of their tenant to
        `Durability.resume`. Pins are global and stay. Returns the number closed."""
        gone = [s for s in self.records.sessions.values() if s.client == client]
        closed = 0
        for s in gone:
            if s.durable:
                self.durability.detach(s)
            else:
                self._release(s)
                closed += 1
        return closed

    def _release(self, s: Session) -> None:
        self.waits.stop(s)
        self.records.unlock(s)
        del self.records.sessions[s.id]
        self.retention.lower_priority(s, s.wanted)
        self._prune_host()
        self.durability.forget(s)
        log.debug("session %s closed", s.id[:8])

    def _prune_host(self) -> None:
        self.tiers.prune()

    # ------------------------------------------------------------- retention
    def tick(self, now: float | None = None) -> list[str]:
        """Demote idle sessions past their TTL (returns their ids), and close detached
        durable sessions idle past the durable expiry."""
        now = self.clock() if now is None else now
        for s in self.durability.expired(now):
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
