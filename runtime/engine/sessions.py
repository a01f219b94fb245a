"""Persistent prefix sessions: token-exact histories held open in the engine.

A session's history is cached in the radix tree and the node at its end is locked, so
its prefix cannot be evicted and the next turn hits all of it: a turn computes only its
new tokens. When a turn ends the lock moves to the node ending prompt + output (lock the
new node, then unlock the old one). `fork` puts n sessions on the same node: no copy,
no recompute. Pins are named shared prefixes (system/tool prompts) sessions start from.

Retention is bounded, or hard locks deadlock the engine. Retained tokens (pinned +
session-held, a shared path counted once) stay under a cap: an admission beyond it first
demotes the least recently used idle *soft* sessions and is otherwise refused
(a CAPACITY refusal). A *demoted* session's lock is released and its path gets a
higher eviction priority than plain cache (`DEMOTED_PRIORITY`; the engine's cache policy
must be "priority" for that order to hold), so unreferenced cache goes first, then
demoted sessions' tails, and never a pin or a held session's history. Idle TTL demotes
the same way, and so does `make_room` when running requests need slots. A demoted
session keeps working: its next turn reuses whatever of its history is still cached,
copies back what the host tier kept (`restore_from_host`) and recomputes the rest (the
turn's usage reports both). Hard sessions are released only by close or TTL; soft ones
also whenever an admission or a running request needs room. A session whose own turn
would take retention past the cap keeps its previous lock: the new tokens stay ordinary
cache (at demoted priority), so the cap is never exceeded and running requests always
have the rest of the pool.

The scheduler calls this module at the points listed in docs/architecture.md; every
method runs on the scheduler's thread. Refusals are `RequestError`s carrying a
`protocol.ErrorCode` (not_found, busy, capacity, invalid_params, duplicate_id).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from radixlm.cache import (
    EvictedSegment,
    KVPool,
    MatchResult,
    OutOfSlots,
    PrefixCache,
    TreeNode,
)
from radixlm.cache.pages import align_down
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.host_tier import HostTier
from radixlm.runtime.engine.retention import (
    Held,
    common_prefix_len,
    distinct_tokens,
    retained_by_class,
)
from radixlm.runtime.protocol import ErrorCode, SessionInfo
from radixlm.runtime.rules import RequestError, check_truncate

log = logging.getLogger(__name__)

HARD, SOFT = "hard", "soft"
DEMOTED_PRIORITY = 1  # eviction priority of demoted histories; plain cache is 0
_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


# ------------------------------------------------------------------------- state
class Residency(enum.Enum):
    """Whether a session's cached history is retained."""

    HELD = "held"  # the node ending its cached history is locked
    DEMOTED = "demoted"  # lock released: the history is ordinary (late-evicted) cache


def _frozen(ids: np.ndarray | Sequence[int]) -> np.ndarray:
    arr = np.array(ids, dtype=np.int64)  # always a private copy
    if arr.ndim != 1:
        raise RequestError(
            ErrorCode.INVALID_PARAMS, f"token ids must be a flat list, got shape {arr.shape}"
        )
    arr.flags.writeable = False
    return arr


@dataclass(eq=False)
class Session:
    """One open session. Callers read it; only the manager changes it.

    `kv_len` is how much of the history was cached when the session last changed (a turn
    ended, it was opened, forked or truncated): what its next turn should hit. While HELD,
    the first `held_len` of those tokens are locked; that is all of them unless the
    retention cap stopped the lock from moving forward (then the rest is ordinary cache).
    """

    id: str
    client: bytes
    namespace: str | None
    retention: str  # HARD | SOFT
    ttl_s: float | None  # idle time before demotion; None: never
    history: np.ndarray  # int64, read-only: every token of the conversation so far
    residency: Residency
    node: TreeNode | None  # the locked node while HELD (None: nothing locked)
    held_len: int  # tokens locked (0 unless HELD)
    kv_len: int  # tokens of `history` that were cached at the last change
    last_used: float
    busy: bool = False
    turn_kv_len: int = 0  # kv_len when the running turn began (usage reporting)
    priority_raised: bool = False  # part of its path got DEMOTED_PRIORITY
    # Which fork/branch of which session it is (empty: opened directly): seeded turns of
    # sibling forks draw distinct random streams from it (`SessionManager.seed_offset`).
    lineage: tuple[int, ...] = ()
    # What an opening turn with input will hold once prefilled: counted against the
    # retention cap from the open on, so that opens sent back to back cannot all pass.
    reserved: Held | None = None
    # Whether the history ends inside an assistant turn (its header rendered, the model's
    # reply not closed by the template's end-of-turn markup yet): an appended message then
    # takes the rendering that closes it first (`AppendVariants.pick`).
    assistant_open: bool = False

    @property
    def length(self) -> int:
        return len(self.history)

    @property
    def held(self) -> Held:
        return Held(self.namespace, self.history[: self.held_len])

    @property
    def wanted(self) -> np.ndarray:
        """The history it expects to find cached (what the host tier may keep for it)."""
        return self.history[: self.kv_len]


def _listed_class(s: Session) -> str:
    """The class a listing shows: "demoted" for a session that holds none of its history
    (demoted, or grown past the retention cap before anything of it could be held)."""
    if s.residency is Residency.DEMOTED or (s.held_len == 0 and s.kv_len > 0):
        return "demoted"
    return s.retention


@dataclass(eq=False)
class PinnedPrefix:
    name: str
    namespace: str | None
    ids: np.ndarray
    node: TreeNode | None
    held_len: int

    @property
    def held(self) -> Held:
        return Held(self.namespace, self.ids[: self.held_len])


# ----------------------------------------------------------------------- manager
class SessionManager:
    """Sessions, pins and their retention over one `PrefixCache`.

    `kv_pool` (the device KV pool) is needed only for the host-memory tier
    (`config.host_kv_tokens > 0`); without it the tier is off.
    """

    def __init__(
        self,
        cache: PrefixCache,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        kv_pool: KVPool | None = None,
    ) -> None:
        self.cache = cache
        self.clock = clock
        self.retained_cap = config.retained_cap or cache.capacity // 2
        self.default_ttl_s = config.default_session_ttl_s or None
        self._sessions: dict[str, Session] = {}
        self._pins: dict[str, PinnedPrefix] = {}
        # Bumped on every lock/unlock: the retained counts (O(held tokens)) are memoized
        # against it, since the scheduler reads them on every request it admits.
        self._locks_version = 0
        self._total_memo: tuple[int, int] = (-1, 0)
        self._by_class_memo: tuple[int, dict[str, int]] = (-1, {})
        self.host: HostTier | None = None
        if config.host_kv_tokens > 0:
            if kv_pool is None:
                log.warning("host_kv_tokens set but no KV pool given: host tier off")
            else:
                self.host = HostTier(kv_pool, config.host_kv_tokens)
                cache.subscribe_evict(self._on_evict)
        log.info(
            "sessions: retained cap %d of %d tokens, default ttl %s, host tier %s",
            self.retained_cap,
            cache.capacity,
            f"{self.default_ttl_s}s" if self.default_ttl_s else "off",
            f"{self.host.capacity} tokens" if self.host else "off",
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
    ) -> Session:
        """A new idle session with an empty history or the pin's.

        `input_ids` is what the opening turn will append (the scheduler then runs it as
        a 0-token generation: `begin_turn` … `end_turn`); it is checked against the
        retention cap here, before anything is prefilled.
        """
        if retention not in (HARD, SOFT):
            raise RequestError(
                ErrorCode.INVALID_PARAMS, f"retention must be 'hard' or 'soft', not {retention!r}"
            )
        if ttl_s is not None and not ttl_s > 0:
            raise RequestError(
                ErrorCode.INVALID_PARAMS, f"ttl_s must be > 0 seconds, got {ttl_s!r}"
            )
        base, node, held_len = _EMPTY, None, 0
        if pinned is not None:
            pin = self._pins.get(pinned)
            if pin is None or pin.namespace != namespace:
                where = f" in namespace {namespace!r}" if pin is not None else ""
                raise RequestError(ErrorCode.NOT_FOUND, f"no pinned prefix named {pinned!r}{where}")
            base, node, held_len = pin.ids, pin.node, pin.held_len
        extra = _frozen(input_ids)
        reserved = None
        if len(extra):
            reserved = Held(namespace, self._cacheable(np.concatenate([base, extra])))
            self._admit(reserved)
        if node is not None:
            self._lock_node(node)
        s = Session(
            id=self._new_id(),
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
        )
        self._sessions[s.id] = s
        log.debug("session %s opened (%s, %d tokens)", s.id[:8], retention, s.length)
        return s

    def get(self, session_id: str, client: bytes) -> Session:
        """The session, if `client` owns it; otherwise NOT_FOUND (ids of other
        clients are indistinguishable from unknown ones)."""
        s = self._sessions.get(session_id)
        if s is None or s.client != client:
            raise RequestError(ErrorCode.NOT_FOUND, f"no session {session_id!r}")
        return s

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
        prompt = np.concatenate([s.history, _frozen(appended_ids)])
        s.busy = True
        s.turn_kv_len = s.kv_len
        s.last_used = self.clock()
        return prompt

    def restore_from_host(self, session_id: str, cached_len: int) -> np.ndarray | None:
        """Copy back the history the host tier kept after `cached_len` (the prompt's
        device match, already locked by the caller): returns the device slots now holding
        the K/V of `history[cached_len : cached_len + len(slots)]`, or None.

        The slots are the caller's, like freshly allocated ones: it treats those tokens as
        cached (no compute), inserts them with the prompt, and frees them if the request
        dies before that. None when the tier is off, has nothing, or the pool cannot
        hold the restore (the tokens are then recomputed).
        """
        s = self._sessions.get(session_id)
        if self.host is None or s is None or cached_len >= s.kv_len:
            return None
        runs = self.host.find(s.namespace, s.wanted, cached_len)
        total = sum(r.n_tokens for r in runs)
        if total == 0:
            return None
        self.host.reserve(runs, True)
        try:
            slots = self.cache.alloc(total)
        except OutOfSlots:
            self.host.reserve(runs, False)
            log.info("session %s: no room to restore %d tokens, recomputing", s.id[:8], total)
            return None
        self.host.load(runs, slots)
        log.debug("session %s: restored %d tokens from host memory", s.id[:8], total)
        return slots

    def recomputed_tokens(self, session_id: str, reused_len: int) -> int:
        """History tokens the running turn recomputes because they were evicted since the
        session last changed: the history then cached minus what this turn reuses
        (`reused_len` = device match + restored). 0 while the history stays held."""
        s = self._sessions.get(session_id)
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
        s = self._sessions.get(session_id)
        if s is None:
            return None
        history = _frozen(history_ids)
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
        return s

    def abort_turn(self, session_id: str) -> None:
        """The turn died (abort, error): idle again, history unchanged."""
        s = self._sessions.get(session_id)
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
        parent = self._sessions.get(session_id)
        if parent is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"no session {session_id!r}")
        s = self._clone(parent, _frozen(history_ids), index)
        if assistant_open is not None:
            s.assistant_open = assistant_open
        self._advance_lock(s)
        return s.id

    # ------------------------------------------------------- fork / truncate
    def fork(self, session_id: str, client: bytes, n: int) -> list[str]:
        """n new sessions on the same node: no copy, no recompute (a demoted session's
        forks are demoted too)."""
        s = self._idle(session_id, client)
        ids = []
        for i in range(n):
            f = self._clone(s, s.history, i)
            f.residency, f.node, f.held_len = s.residency, s.node, s.held_len
            f.kv_len, f.priority_raised = s.kv_len, s.priority_raised
            if f.node is not None:
                self._lock_node(f.node)
            ids.append(f.id)
        s.last_used = self.clock()
        return ids

    def truncate(self, session_id: str, client: bytes, length: int) -> Session:
        """Rewind the history to its first `length` tokens. The cut-off tail stays in the
        tree as ordinary evictable cache. A cut closes whatever assistant turn was open
        (its point is the client's, who sees tokens, not turns)."""
        s = self._idle(session_id, client)
        check_truncate(length, s.length)
        old = s.wanted
        s.history = s.history[:length]
        s.assistant_open = False
        s.kv_len = min(s.kv_len, length)
        if s.held_len > length:  # shrinking always fits under the cap
            self._lock_at(s, self.cache.match(s.history, s.namespace))
        self._lower_priority(s, old)
        s.last_used = self.clock()
        self._prune_host()
        return s

    # ---------------------------------------------------------------- close
    def close(self, session_id: str, client: bytes) -> None:
        """Unlock the session's history (its KV stays as evictable cache) and forget it."""
        self._release(self._idle(session_id, client))

    def client_gone(self, client: bytes) -> int:
        """Close every session of `client`, busy or not (the caller aborts its requests;
        a later end_turn/abort_turn for them is a no-op). Pins are global and stay.
        Returns the number closed."""
        gone = [s for s in self._sessions.values() if s.client == client]
        for s in gone:
            self._release(s)
        return len(gone)

    def _release(self, s: Session) -> None:
        self._unlock(s)
        del self._sessions[s.id]
        self._lower_priority(s, s.wanted)
        self._prune_host()
        log.debug("session %s closed", s.id[:8])

    # ------------------------------------------------------------------ pins
    def check_pin(
        self, name: str, ids: np.ndarray | Sequence[int], namespace: str | None = None
    ) -> None:
        """Refuse a pin before it is prefilled: name taken, or beyond the retention cap
        (after demoting idle soft sessions)."""
        if name in self._pins:
            raise RequestError(ErrorCode.DUPLICATE_ID, f"a prefix is already pinned as {name!r}")
        self._admit(Held(namespace, self._cacheable(_frozen(ids))))

    def pin(
        self, name: str, ids: np.ndarray | Sequence[int], namespace: str | None = None
    ) -> PinnedPrefix:
        """Hold the prefilled (and inserted) `ids` as the pin `name` (its node is found by
        matching them, as in end_turn)."""
        ids = _frozen(ids)
        self.check_pin(name, ids, namespace)
        m = self.cache.match(ids, namespace)
        locked = m.node if m.length else None
        if locked is not None:
            self._lock_node(locked)
        pin = PinnedPrefix(name, namespace, ids, locked, m.length)
        self._pins[name] = pin
        log.info("pinned %r (%d tokens, %d cached)", name, len(ids), m.length)
        return pin

    def unpin(self, name: str) -> None:
        """Release a pin (its KV stays as evictable cache; sessions opened from it keep
        their own locks)."""
        pin = self._pins.pop(name, None)
        if pin is None:
            raise RequestError(ErrorCode.NOT_FOUND, f"no pinned prefix named {name!r}")
        if pin.node is not None:
            self._unlock_node(pin.node)
        log.info("unpinned %r", name)

    # ------------------------------------------------------------- retention
    def tick(self, now: float | None = None) -> list[str]:
        """Demote idle sessions past their TTL; returns their ids."""
        now = self.clock() if now is None else now
        expired = [
            s
            for s in self._sessions.values()
            if s.ttl_s is not None
            and not s.busy
            and s.residency is Residency.HELD
            and now - s.last_used >= s.ttl_s
        ]
        for s in expired:
            self._demote(s, reason="idle ttl")
        return [s.id for s in expired]

    def make_room(self, n_tokens: int) -> int:
        """Demote least recently used idle soft sessions until their release made at
        least `n_tokens` tokens evictable (the caller then evicts/allocates). Returns the
        tokens made evictable (0: nothing left to demote; hard sessions stay)."""
        made = 0
        cache = self.cache
        for s in self._soft_victims():
            if made >= n_tokens:
                break
            before = cache.evictable_size
            self._demote(s, reason="pool pressure")
            made += cache.evictable_size - before
        return made

    def retained_tokens(self) -> dict[str, int]:
        """Distinct retained tokens by class: "pinned", "hard", "soft"."""
        if self._by_class_memo[0] != self._locks_version:
            by_class = retained_by_class(list(self._holders()), self.cache.page_size)
            self._by_class_memo = (self._locks_version, by_class)
        return dict(self._by_class_memo[1])

    def retained_total(self) -> int:
        if self._total_memo[0] != self._locks_version:
            total = distinct_tokens((h for _, h in self._holders()), self.cache.page_size)
            self._total_memo = (self._locks_version, total)
        return self._total_memo[1]

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    @property
    def host_capacity(self) -> int:
        return self.host.capacity if self.host else 0

    @property
    def host_used(self) -> int:
        return self.host.used if self.host else 0

    def sessions(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def pins(self) -> Iterator[PinnedPrefix]:
        return iter(self._pins.values())

    # ------------------------------------------------------------- internals
    def _new_id(self) -> str:
        while True:
            sid = secrets.token_hex(16)  # 128 random bits: unguessable
            if sid not in self._sessions:
                return sid

    def _idle(self, session_id: str, client: bytes) -> Session:
        s = self.get(session_id, client)
        if s.busy:
            raise RequestError(ErrorCode.BUSY, f"session {session_id!r} has a request in flight")
        return s

    def _clone(self, parent: Session, history: np.ndarray, index: int) -> Session:
        """A new session (its parent's `index`-th child) with `parent`'s owner and
        options, holding nothing yet."""
        s = Session(
            id=self._new_id(),
            client=parent.client,
            namespace=parent.namespace,
            retention=parent.retention,
            ttl_s=parent.ttl_s,
            history=history,
            residency=Residency.DEMOTED,
            node=None,
            held_len=0,
            kv_len=0,
            last_used=self.clock(),
            lineage=(*parent.lineage, index),
            assistant_open=parent.assistant_open,
        )
        self._sessions[s.id] = s
        return s

    def seed_offset(self, session_id: str) -> int:
        """What a seeded turn of the session adds to its seed: 0 for a session opened
        directly (a seed means what it means without sessions), a number derived from
        its lineage for a fork or branch, so sibling forks given the same seed sample
        differently while a rerun of the same program samples the same."""
        s = self._sessions.get(session_id)
        if s is None or not s.lineage:
            return 0
        digest = hashlib.blake2b(repr(s.lineage).encode(), digest_size=4).digest()
        return 1 + int.from_bytes(digest, "little")

    def _cacheable(self, ids: np.ndarray) -> np.ndarray:
        page = self.cache.page_size
        return ids[: align_down(len(ids), page)]

    def _advance_lock(self, s: Session) -> None:
        """After the history grew: lock its cached part if the cap allows (demoting idle
        soft sessions for it), else keep the previous lock; the unlocked rest is then
        kept after plain cache."""
        m = self.cache.match(s.history, s.namespace)
        s.kv_len = m.length
        if m.length <= s.held_len:
            return
        if self._fits(Held(s.namespace, s.history[: m.length]), replacing=s):
            was_demoted = s.residency is Residency.DEMOTED
            self._lock_at(s, m)
            if was_demoted:
                self._prune_host()
            return
        self.cache.set_priority(m.node, DEMOTED_PRIORITY)
        s.priority_raised = True
        log.info(
            "session %s: retention cap (%d tokens) reached; %d of its %d cached tokens "
            "stay locked, the rest is ordinary cache",
            s.id[:8],
            self.retained_cap,
            s.held_len,
            m.length,
        )

    def _lock_node(self, node: TreeNode) -> None:
        self.cache.lock(node)
        self._locks_version += 1

    def _unlock_node(self, node: TreeNode) -> None:
        self.cache.unlock(node)
        self._locks_version += 1

    def _lock_at(self, s: Session, m: MatchResult) -> None:
        """Lock `m.node` for `s`, then release its previous lock (in that order, so a
        shared path is never unprotected in between)."""
        new = m.node if m.length else None
        if new is not None:
            self._lock_node(new)
        if s.node is not None:
            self._unlock_node(s.node)
        s.node, s.held_len, s.residency = new, m.length, Residency.HELD

    def _unlock(self, s: Session) -> None:
        if s.node is not None:
            self._unlock_node(s.node)
        s.node, s.held_len, s.residency = None, 0, Residency.DEMOTED

    def _demote(self, s: Session, reason: str) -> None:
        """Release the session's lock; its cached history is kept after plain cache."""
        if s.residency is Residency.DEMOTED:
            return
        held = s.held_len
        if s.kv_len:
            node = s.node if s.kv_len == held else self.cache.match(s.wanted, s.namespace).node
            if node is not None and node.length:
                self.cache.set_priority(node, DEMOTED_PRIORITY)
                s.priority_raised = True
        self._unlock(s)
        log.info("session %s demoted (%s): %d tokens now evictable cache", s.id[:8], reason, held)

    def _lower_priority(self, s: Session, old: np.ndarray) -> None:
        """Give plain-cache priority back to the part of `old` (a path `s` no longer needs)
        that no other session's cached history runs through."""
        if not s.priority_raised or not len(old):
            return
        want = common_prefix_len(old, s.wanted) if s.id in self._sessions else 0
        for d in self._sessions.values():
            if d is not s and d.namespace == s.namespace:
                want = max(want, common_prefix_len(old, d.wanted))
        m = self.cache.match(old, s.namespace)
        if m.length <= want:
            return
        self.cache.set_priority(m.node, 0)
        if want:
            kept = self.cache.match(old[:want], s.namespace).node
            self.cache.set_priority(kept, DEMOTED_PRIORITY)

    def _holders(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, Held]]:
        """(class, held path) of every pin and held session but those in `skip`."""
        for pin in self._pins.values():
            yield "pinned", pin.held
        for s in self._sessions.values():
            if s.held_len and s.id not in skip:
                yield s.retention, s.held

    def _soft_victims(self, exclude: Session | None = None) -> list[Session]:
        """Idle held soft sessions, least recently used first."""
        victims = [
            s
            for s in self._sessions.values()
            if s.retention == SOFT
            and s.residency is Residency.HELD
            and not s.busy
            and s is not exclude
        ]
        victims.sort(key=lambda s: s.last_used)
        return victims

    def _retained_with(self, candidate: Held, skip: frozenset[str] = frozenset()) -> int:
        """Distinct retained tokens if `candidate` were held too (and `skip` were not);
        opening turns count with what they reserved (demoting does not undo that)."""
        held = [h for _, h in self._holders(skip)]
        held += [s.reserved for s in self._sessions.values() if s.reserved is not None]
        return distinct_tokens([*held, candidate], self.cache.page_size)

    def _fits(self, candidate: Held, replacing: Session | None = None) -> bool:
        """Whether `candidate` (replacing what `replacing` holds) fits under the cap,
        demoting idle soft sessions (LRU) for it if needed. When even demoting all of
        them would not do, nothing is demoted and the answer is False."""
        skip = frozenset() if replacing is None else frozenset({replacing.id})
        cap = self.retained_cap
        if self._retained_with(candidate, skip) <= cap:
            return True
        victims = self._soft_victims(exclude=replacing)
        if self._retained_with(candidate, skip | {v.id for v in victims}) > cap:
            return False
        for v in victims:
            self._demote(v, reason="retention cap")
            if self._retained_with(candidate, skip) <= cap:
                break
        return True

    def _admit(self, candidate: Held) -> None:
        """`_fits`, or a CAPACITY refusal."""
        if self._fits(candidate):
            return
        now = self.retained_total()
        more = self._retained_with(candidate) - now
        raise RequestError(
            ErrorCode.CAPACITY,
            f"retention cap reached: pins and sessions retain {now} of {self.retained_cap} "
            f"tokens and this needs {more} more, beyond what demoting idle soft sessions "
            f"frees; close sessions, unpin prefixes or raise retained_cap"
        )

    # ------------------------------------------------------------- host tier
    def _on_evict(self, seg: EvictedSegment) -> None:
        """Eviction hook: back up the part of an evicted node that lies on a session's
        cached history (a demoted one, or the unlocked tail of a capped one)."""
        assert self.host is not None
        p, page = seg.prefix_len, self.cache.page_size
        want = 0
        for s in self._sessions.values():
            # Only unlocked history can be evicted: skip fully held sessions at once.
            if s.kv_len == s.held_len or s.namespace != seg.namespace or s.kv_len - p < page:
                continue
            h = s.wanted
            if np.array_equal(h[:p], seg.prefix_tokens):
                want = max(want, common_prefix_len(seg.tokens, h[p:]))
        want = align_down(want, page)
        if want:
            self.host.save(seg.namespace, seg.prefix_tokens, seg.tokens[:want], seg.slots[:want])

    def _prune_host(self) -> None:
        if self.host is None or not self.host.num_segments:
            return
        self.host.prune([(s.namespace, s.wanted) for s in self._sessions.values()])

    # ----------------------------------------------------------------- list
    def list(self, client: bytes, everyone: bool = False) -> list[SessionInfo]:
        """`client`'s sessions (all namespaces), oldest activity first; with `everyone`,
        every client's, other clients' ids cut to a prefix (ids are the access control:
        a prefix opens nothing)."""
        now = self.clock()
        rows = sorted(
            (s for s in self._sessions.values() if everyone or s.client == client),
            key=lambda s: s.last_used,
        )
        return [
            SessionInfo(
                session=s.id if s.client == client else s.id[:8],
                length=s.length,
                idle_s=0.0 if s.busy else max(0.0, now - s.last_used),
                retention=_listed_class(s),
                busy=s.busy,
                namespace=s.namespace,
            )
            for s in rows
        ]
