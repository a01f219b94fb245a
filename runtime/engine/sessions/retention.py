"""Retention: the cap on what pins and sessions hold, demotion, and eviction priorities.

Retention is bounded, or hard locks deadlock the engine. Retained tokens (pinned +
session-held, a shared path counted once: `distinct_tokens`) stay under a cap: an admission
beyond it first demotes the least recently used idle *soft* sessions and is otherwise
refused (CAPACITY). A *demoted* session's lock is released and its path gets a higher
eviction priority than plain cache (`DEMOTED_PRIORITY`; the engine's cache policy must be
"priority" for that order to hold), so unreferenced cache goes first, then demoted
sessions' tails, and never a pin or a held session's history. Idle TTL demotes the same
way (`tick`), and so does `make_room` when running requests need slots. Hard sessions
are released only by close or TTL; soft ones also whenever an admission or a running
request needs room. A session whose own turn would take retention past the cap keeps
its previous lock (`advance_lock`): the new tokens stay ordinary cache (at demoted
priority), so the cap is never exceeded and running requests always have the rest of
the pool.

Tenants. On a server with several tenants each also has a quota of the cap (`quota_for`,
``--max-retained-per-tenant``; by default an equal share of the cap among the tenants
retaining tokens, a quarter of it at least), so one tenant cannot fill the cap for all:
an admission beyond its own quota demotes only its own idle soft sessions and is
otherwise refused, and refusals name only the tenant's own figures.

Tools. Which idle soft sessions go first (`_soft_victims`: for the cap, a quota or the
pool) is the tool-aware order of tool_waits.py when its `ToolWaits` is on: overdue tool
waits first, then sessions nothing is expected of (least recently used first), then
tool waits whose result is expected, the latest expected first; off, least recently used
first. A demoted session whose tool result is expected keeps its path one priority above
other demoted histories (`EXPECTED_PRIORITY`), so the pool evicts it last.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np
from radixlm.cache import PrefixCache
from radixlm.cache.pages import align_down
from radixlm.runtime.engine.sessions.records import SOFT, Held, Records, Residency, Session
from radixlm.runtime.engine.sessions.tool_waits import ToolWaits
from radixlm.runtime.protocol import ErrorCode
from radixlm.runtime.rules import RequestError

log = logging.getLogger(__name__)

DEMOTED_PRIORITY = 1  # eviction priority of demoted histories; plain cache is 0
EXPECTED_PRIORITY = 2  # of a demoted history whose tool result is expected back


# ----------------------------------------------------------------- accounting
# How many distinct cached tokens pins and sessions hold. Every holder (a pin, an open
# session) keeps a lock on one path of the radix tree; a path shared by several holders
# is retained once. The count is computed from the held token sequences, not from the
# tree, so an admission (a pin, an open with input) can be checked *before* anything is
# prefilled. The distinct prefixes of a set of sequences are the nodes of their trie: sum
# of lengths minus the longest common prefix of each sequence with its neighbour in
# sorted order. With pages of P tokens the tree shares whole pages only, so common
# prefixes are rounded down to a multiple of P.

# Classes in the order a shared token is attributed (the strongest holder counts it).
RETENTION_CLASSES: tuple[str, ...] = ("pinned", "hard", "soft")


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int64 arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = a[:n] != b[:n]
    i = int(neq.argmax())
    return i if neq[i] else n


def distinct_tokens(held: Iterable[Held], page_size: int = 1) -> int:
    """Tokens in the union of the held paths (shared whole pages counted once); the
    paths are page-aligned."""
    by_ns: dict[Hashable, list[np.ndarray]] = defaultdict(list)
    for h in held:
        if len(h.tokens):
            by_ns[h.namespace].append(h.tokens)
    total = 0
    for seqs in by_ns.values():
        # Any consistent lexicographic order keeps sequences that share a prefix adjacent;
        # raw int64 bytes give one (a prefix sorts before its extensions).
        seqs.sort(key=lambda t: t.tobytes())
        prev: np.ndarray | None = None
        for t in seqs:
            if prev is not None:
                shared = common_prefix_len(prev, t)
                total -= align_down(shared, page_size)
            total += len(t)
            prev = t
    return total


def retained_by_class(held: Sequence[tuple[str, Held]], page_size: int = 1) -> dict[str, int]:
    """Distinct retained tokens per class; a token held by several classes counts for
    the strongest ("pinned" > "hard" > "soft"), so the values sum to the union."""
    out: dict[str, int] = {}
    acc: list[Held] = []
    before = 0
    for cls in RETENTION_CLASSES:
        acc.extend(h for c, h in held if c == cls)
        now = distinct_tokens(acc, page_size)
        out[cls] = now - before
        before = now
    return out


def tenant_of(namespace: Hashable, multi_tenant: bool) -> str:
    """The tenant an engine-side namespace belongs to (frontend/tenants.py names them
    ``TENANT`` and ``TENANT/NS``; a gateway's tenants are ``gw-NAME``). "" is the local
    tenant: every namespace of a server without tenants, and local clients' beside
    gateways."""
    if not isinstance(namespace, str):
        return ""
    tenant = namespace.partition("/")[0]
    return tenant if multi_tenant or tenant.startswith("gw-") else ""


class Retention:
    """The cap over `records`' holders, and the releases it and the pool ask for."""

    def __init__(self, records: Records, cache: PrefixCache, cap: int, *,
                 per_tenant: int = 0, multi_tenant: bool = False,
                 tools: ToolWaits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.records = records
        self.cache = cache
        self.cap = cap
        self.tools = tools
        self.clock = clock
        # Told of a session waiting on tools as it is demoted (its history is still in
        # the pool then): the disk tier keeps it when there is no host tier to.
        self.on_demote_waiting: Callable[[Session], None] | None = None
        self.per_tenant = per_tenant  # 0: an equal share among the retaining tenants
        self.multi_tenant = multi_tenant
        # The retained counts (O(held tokens)) are memoised against the records' lock
        # version, since the scheduler reads them on every request it admits.
        self._total_memo: tuple[int, int] = (-1, 0)
        self._by_class_memo: tuple[int, dict[str, int]] = (-1, {})

    # ---------------------------------------------------------------- counts
    def retained_tokens(self) -> dict[str, int]:
        """Distinct retained tokens by class: "pinned", "hard", "soft"."""
        version = self.records.locks_version
        if self._by_class_memo[0] != version:
            by_class = retained_by_class(list(self.records.holders()), self.cache.page_size)
            self._by_class_memo = (version, by_class)
        return dict(self._by_class_memo[1])

    def retained_total(self) -> int:
        version = self.records.locks_version
        if self._total_memo[0] != version:
            total = distinct_tokens((h for _, h in self.records.holders()), self.cache.page_size)
            self._total_memo = (version, total)
        return self._total_memo[1]

    def cacheable(self, ids: np.ndarray) -> np.ndarray:
        """The page-aligned part of `ids`: what a holder of them can lock."""
        return ids[: align_down(len(ids), self.cache.page_size)]

    # ------------------------------------------------------------- admission
    def _retained_with(self, candidate: Held, skip: frozenset[str] = frozenset()) -> int:
        """Distinct retained tokens if `candidate` were held too (and `skip` were not);
        opening turns count with what they reserved (demoting does not undo that)."""
        held = [h for _, h in self.records.holders(skip)]
        held += [s.reserved for s in self.records.sessions.values() if s.reserved is not None]
        return distinct_tokens([*held, candidate], self.cache.page_size)

    def _soft_victims(self, exclude: Session | None = None) -> list[Session]:
        """Idle held soft sessions, in the order they are demoted: tool-aware (module doc)
        when the tools' order is on, else least recently used first."""
        victims = [
            s
            for s in self.records.sessions.values()
            if s.retention == SOFT
            and s.residency is Residency.HELD
            and not s.busy
            and s is not exclude
        ]
        tools = self.tools
        if tools is not None and tools.enabled:
            now = self.clock()
            victims.sort(key=lambda s: tools.demotion_key(s, now))
        else:
            victims.sort(key=lambda s: s.last_used)
        return victims

    # --------------------------------------------------------------- tenants
    def _tenant(self, namespace: Hashable) -> str:
        return tenant_of(namespace, self.multi_tenant)

    def quota_for(self, tenant: str) -> int:
        """What `tenant` may retain: --max-retained-per-tenant, else the cap shared
        equally among the tenants retaining tokens (it included), a quarter at least."""
        if self.per_tenant > 0:
            return min(self.per_tenant, self.cap)
        tenants = {self._tenant(h.namespace) for _, h in self.records.holders()} | {tenant}
        return self.cap if len(tenants) == 1 else max(self.cap // len(tenants), self.cap // 4)

    def tenant_retained(self, tenant: str, candidate: Held | None = None,
                        skip: frozenset[str] = frozenset()) -> int:
        """Distinct tokens `tenant`'s holders retain (with `candidate`, without `skip`)."""
        held = [h for _, h in self.records.holders(skip) if self._tenant(h.namespace) == tenant]
        held += [s.reserved for s in self.records.sessions.values()
                 if s.reserved is not None and self._tenant(s.namespace) == tenant]
        if candidate is not None:
            held.append(candidate)
        return distinct_tokens(held, self.cache.page_size)

    # -------------------------------------------------------------- fitting
    def _fit(self, candidate: Held, replacing: Session | None,
             over: Callable[[frozenset[str]], bool], victims: list[Session],
             reason: str) -> bool:
        """Demote `victims` (LRU first) until `over(skip)` is False; False, demoting
        nothing, when even all of them would not do."""
        skip = frozenset() if replacing is None else frozenset({replacing.id})
        if not over(skip):
            return True
        if over(skip | {v.id for v in victims}):
            return False
        for v in victims:
            self.demote(v, reason=reason)
            if not over(skip):
                break
        return True

    def _refusal(self, candidate: Held, replacing: Session | None = None) -> str | None:
        """Why `candidate` does not fit (demoting idle soft sessions for it first): None
        when it fits, "quota" (the tenant's own) or "cap" (the server's)."""
        tenant = self._tenant(candidate.namespace)
        quota = self.quota_for(tenant)
        if quota < self.cap:
            own = [v for v in self._soft_victims(exclude=replacing)
                   if self._tenant(v.namespace) == tenant]
            if not self._fit(candidate, replacing,
                             lambda skip: self.tenant_retained(tenant, candidate, skip) > quota,
                             own, "tenant retention quota"):
                return "quota"
        if not self._fit(candidate, replacing,
                         lambda skip: self._retained_with(candidate, skip) > self.cap,
                         self._soft_victims(exclude=replacing), "retention cap"):
            return "cap"
        return None

    def fits(self, candidate: Held, replacing: Session | None = None) -> bool:
        """Whether `candidate` (replacing what `replacing` holds) fits under its tenant's
        quota and the cap, demoting idle soft sessions (LRU; for the quota, the tenant's
        own) for it if needed. When even that would not do, the answer is False."""
        return self._refusal(candidate, replacing) is None

    def admit(self, candidate: Held) -> None:
        """`fits`, or a CAPACITY refusal that names only the asking tenant's figures
        (on a server without tenants, the server's)."""
        why = self._refusal(candidate)
        if why is None:
            return
        tenant = self._tenant(candidate.namespace)
        own = self.tenant_retained(tenant)
        more = self.tenant_retained(tenant, candidate) - own
        advice = "close sessions or unpin prefixes"
        if why == "quota":
            flag = ("--max-retained-per-tenant" if self.per_tenant > 0
                    else "an equal share of the cap among the tenants retaining tokens")
            message = (f"retention quota reached: this tenant's pins and sessions retain "
                       f"{own} of its {self.quota_for(tenant)} tokens ({flag}) and this needs "
                       f"{more} more, beyond what demoting its idle soft sessions frees; "
                       f"{advice}")
        elif self.multi_tenant or tenant:
            message = (f"the server's retention cap is reached (shared by its tenants): this "
                       f"tenant retains {own} tokens and this needs {more} more; {advice}, "
                       "or try again later")
        else:
            now = self.retained_total()
            message = (f"retention cap reached: pins and sessions retain {now} of {self.cap} "
                       f"tokens and this needs {self._retained_with(candidate) - now} more, "
                       f"beyond what demoting idle soft sessions frees; {advice} or raise "
                       "retained_cap")
        raise RequestError(ErrorCode.CAPACITY, message)

    def advance_lock(self, s: Session) -> bool:
        """After the history grew: lock its cached part if the cap allows (demoting idle
        soft sessions for it), else keep the previous lock; the unlocked rest is then
        kept after plain cache. True when a demoted session is held again."""
        m = self.cache.match(s.history, s.namespace)
        s.kv_len = m.length
        if m.length <= s.held_len:
            return False
        if self.fits(Held(s.namespace, s.history[: m.length]), replacing=s):
            was_demoted = s.residency is Residency.DEMOTED
            self.records.lock_at(s, m)
            return was_demoted
        self.cache.set_priority(m.node, DEMOTED_PRIORITY)
        s.priority_raised = True
        log.info(
            "session %s: retention cap (%d tokens) reached; %d of its %d cached tokens "
            "stay locked, the rest is ordinary cache",
            s.id[:8], self.cap, s.held_len, m.length,
        )  # fmt: skip
        return False

    def hold(self, s: Session) -> bool:
        """Lock the part of `s`'s wanted history the pool has again (a prefetch brought it
        back) if the cap allows, demoting idle soft sessions for it; the history it wants
        (`kv_len`) stays what it was. True when it is held now."""
        m = self.cache.match(s.wanted, s.namespace)
        if m.length <= s.held_len:
            return False
        if not self.fits(Held(s.namespace, s.wanted[: m.length]), replacing=s):
            return False
        self.records.lock_at(s, m)
        return True

    # -------------------------------------------------------------- releases
    def demote(self, s: Session, reason: str) -> None:
        """Release the session's lock; its cached history is kept after plain cache."""
        if s.residency is Residency.DEMOTED:
            return
        held = s.held_len
        if s.kv_len:
            node = s.node if s.kv_len == held else self.cache.match(s.wanted, s.namespace).node
            if node is not None and node.length:
                tools = self.tools
                expected = tools is not None and tools.expected_back(s, self.clock())
                self.cache.set_priority(node, EXPECTED_PRIORITY if expected else DEMOTED_PRIORITY)
                s.priority_raised = True
        self.records.unlock(s)
        if s.tool_wait is not None:
            s.tool_wait.demoted = True
            if self.on_demote_waiting is not None:
                self.on_demote_waiting(s)
        log.info("session %s demoted (%s): %d tokens now evictable cache", s.id[:8], reason, held)

    def lower_priority(self, s: Session, old: np.ndarray) -> None:
        """Give plain-cache priority back to the part of `old` (a path `s` no longer needs)
        that no other session's cached history runs through."""
        if not s.priority_raised or not len(old):
            return
        sessions = self.records.sessions
        want = common_prefix_len(old, s.wanted) if s.id in sessions else 0
        for d in sessions.values():
            if d is not s and d.namespace == s.namespace:
                want = max(want, common_prefix_len(old, d.wanted))
        m = self.cache.match(old, s.namespace)
        if m.length <= want:
            return
        self.cache.set_priority(m.node, 0)
        if want:
            kept = self.cache.match(old[:want], s.namespace).node
            self.cache.set_priority(kept, DEMOTED_PRIORITY)

    def tick(self, now: float) -> list[str]:
        """Demote idle sessions past their TTL; returns their ids."""
        expired = [
            s
            for s in self.records.sessions.values()
            if s.ttl_s is not None
            and not s.busy
            and s.residency is Residency.HELD
            and now - s.last_used >= s.ttl_s
        ]
        for s in expired:
            self.demote(s, reason="idle ttl")
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
            self.demote(s, reason="pool pressure")
            made += cache.evictable_size - before
        return made
