"""SessionManager against the real PrefixCache, driven through the request lifecycle
with a fake model (no forward pass).

The fake model's K for position i is a rolling hash of the tokens up to i, written into
a real KVPool; after every test each cached slot must still hold the value of its own
path, which catches a restore (host tier) or a lock that hands out the wrong KV. The
retained-token count is checked against a brute-force set of held prefixes, and the
pool invariant free + evictable + protected == capacity after every test.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import pytest
import torch
from radixlm.cache import KVPool, OutOfSlots, PrefixCache
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.sessions import Residency, SessionManager
from radixlm.runtime.protocol import MAX_FORK, ErrorCode
from radixlm.runtime.rules import RequestError

ALICE, BOB = b"alice", b"bob"
_MOD = 2**31 - 1


@contextlib.contextmanager
def refused(code: str) -> Iterator[pytest.ExceptionInfo[RequestError]]:
    """The block raises the manager's refusal with this protocol error code."""
    with pytest.raises(RequestError) as err:
        yield err
    assert err.value.code == code, err.value


def fake_kv(tokens: np.ndarray) -> np.ndarray:
    """K of every position: a hash of the whole prefix ending there."""
    out = np.empty(len(tokens), dtype=np.float64)
    h = 7
    for i, t in enumerate(tokens.tolist()):
        h = (h * 1000003 + t + 1) % _MOD
        out[i] = h
    return out


class Turn(NamedTuple):
    prompt: int
    cached: int  # not computed: device hit + restored
    restored: int
    recomputed: int
    computed: int


def ids(rng: random.Random, n: int) -> np.ndarray:
    return np.array([rng.randrange(1, 50) for _ in range(n)], dtype=np.int64)


class FakeEngine:
    """The scheduler's side of the contract, one request at a time."""

    def __init__(
        self,
        capacity: int,
        *,
        page_size: int = 1,
        retained_cap: int = 0,
        host_kv_tokens: int = 0,
        ttl_s: float = 0.0,
    ) -> None:
        self.now = 0.0
        clock = self.clock
        self.cache = PrefixCache(capacity, page_size, "priority", clock=clock)
        self.pool = KVPool(1, 1, 1, capacity, page_size, torch.float64, "cpu")
        config = EngineConfig(
            retained_cap=retained_cap, host_kv_tokens=host_kv_tokens, default_session_ttl_s=ttl_s
        )
        self.sm = SessionManager(self.cache, config, clock, kv_pool=self.pool)

    def clock(self) -> float:
        return self.now

    # --------------------------------------------------------------- lifecycle
    def run(
        self,
        prompt: np.ndarray,
        output: Sequence[int] = (),
        *,
        ns: str | None = None,
        session: str | None = None,
    ) -> Turn:
        """Prefill `prompt`, decode `output`, insert, hand the history to the session,
        unlock, free. As in the scheduler, a session turn feeds its last sampled token
        through one more decode row (the next turn hits the whole history); a plain
        request does not (its last token has no KV)."""
        cache = self.cache
        full = np.concatenate([prompt, np.asarray(output, dtype=np.int64)])
        kv_len = len(full) - (1 if len(output) and session is None else 0)
        m = cache.match(prompt, ns)
        cache.lock(m.node)
        restored = self.sm.tiers.restore(session, m.length) if session else None
        if restored is None:
            restored = np.zeros(0, dtype=np.int64)
        reused = m.length + len(restored)
        recomputed = self.sm.recomputed_tokens(session, reused) if session else 0
        try:
            new = self._alloc(kv_len - reused)
        except OutOfSlots:
            cache.free(restored)
            cache.unlock(m.node)
            if session:
                self.sm.abort_turn(session)
            raise
        slots = np.concatenate([m.slots, restored, new])
        self.pool.k[0][torch.from_numpy(slots[reused:kv_len]), 0, 0] = torch.from_numpy(
            fake_kv(full[:kv_len])[reused:]
        )
        res = cache.insert(full[:kv_len], slots[:kv_len], ns)
        aligned = kv_len - kv_len % cache.page_size
        cache.free(slots[m.length : res.cached_len])  # duplicates
        cache.free(slots[aligned:])  # never joined the tree
        if session:
            self.sm.end_turn(session, full)
        cache.unlock(m.node)
        return Turn(len(prompt), reused, len(restored), recomputed, kv_len - reused)

    def _alloc(self, n: int) -> np.ndarray:
        try:
            return self.cache.alloc(n)
        except OutOfSlots:
            if not self.sm.make_room(n):
                raise
            return self.cache.alloc(n)

    def turn(
        self, sid: str, appended: Sequence[int], output: Sequence[int] = (), client: bytes = ALICE
    ) -> Turn:
        prompt = self.sm.begin_turn(sid, client, appended)
        ns = self.sm.get(sid, client).namespace
        return self.run(prompt, output, ns=ns, session=sid)

    def open(
        self,
        input_ids: Sequence[int] = (),
        *,
        client: bytes = ALICE,
        ns: str | None = None,
        retention: str = "hard",
        ttl_s: float | None = None,
        pinned: str | None = None,
    ) -> str:
        s = self.sm.open(client, ns, retention, ttl_s, pinned, input_ids)
        if len(input_ids):
            try:
                self.turn(s.id, input_ids, client=client)
            except OutOfSlots:
                self.sm.close(s.id, client)
                raise
        return s.id

    def pin(self, name: str, ids_: np.ndarray, ns: str | None = None) -> None:
        self.sm.pinned.check(name, ids_, ns)
        self.run(ids_, ns=ns)
        self.sm.pinned.pin(name, ids_, ns)

    def history(self, sid: str, client: bytes = ALICE) -> np.ndarray:
        return self.sm.get(sid, client).history

    def used(self) -> int:
        return self.cache.capacity - self.cache.sizes().free

    # --------------------------------------------------------------- checks
    def check(self) -> None:
        """Everything that must hold whenever no request is running."""
        cache, sm = self.cache, self.sm
        cache.check_integrity(private=0)
        # Every cached slot holds the KV of its own path (no wrong restore, no reuse).
        tree = cache.tree
        stack = list(tree.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.length:
                want = fake_kv(tree.path_tokens(node))[node.depth - node.length :]
                got = self.pool.k[0][torch.from_numpy(node.value.copy()), 0, 0].numpy()
                assert np.array_equal(got, want), f"wrong KV under {node!r}"
        # Brute force: distinct (namespace, prefix ending a page) of every pinned/held
        # path, times the page size (the tree shares whole pages only).
        page = cache.page_size
        held: set[tuple[object, tuple[int, ...]]] = set()
        paths = [(p.namespace, p.ids[: p.held_len]) for p in sm.pins()]
        paths += [
            (s.namespace, s.history[: s.held_len])
            for s in sm.sessions()
            if s.residency is Residency.HELD
        ]
        for ns, path in paths:
            assert cache.match(path, ns).length == len(path), "a held path is not cached"
            held.update(
                (ns, tuple(path[:end].tolist())) for end in range(page, len(path) + 1, page)
            )
        retained = len(held) * page
        assert sm.retained_total() == retained
        assert sum(sm.retained_tokens().values()) == retained
        # With no request running, the locked tokens are exactly the retained ones.
        assert cache.sizes().protected == retained
        assert retained <= sm.retained_cap
        for s in sm.sessions():
            assert not s.busy
            assert s.held_len <= s.kv_len <= s.length
            assert (s.residency is Residency.HELD) == (s.node is not None) or not s.held_len
        if sm.host is not None:
            sm.host.allocator.check_integrity()


@pytest.fixture
def engines() -> list[FakeEngine]:
    return []


@pytest.fixture(autouse=True)
def _invariant_after_each_test(engines: list[FakeEngine]):
    yield
    for e in engines:
        e.check()


@pytest.fixture
def make(engines: list[FakeEngine]):
    def _make(capacity: int, **kw) -> FakeEngine:
        e = FakeEngine(capacity, **kw)
        engines.append(e)
        return e

    return _make


# ------------------------------------------------------------------- turns
def test_ten_turn_conversation_reuses_the_whole_history_under_pressure(make):
    rng = random.Random(0)
    e = make(1000)
    sid = e.open()
    prev = 0
    for turn_no in range(10):
        appended, output = ids(rng, rng.randrange(15, 30)), ids(rng, rng.randrange(4, 9))
        t = e.turn(sid, appended, output)
        assert t.cached == prev, f"turn {turn_no}"  # the whole previous history
        assert t.computed == len(appended) + len(output)
        assert t.recomputed == t.restored == 0
        prev = e.sm.get(sid, ALICE).length
        # Other traffic that does not fit beside it: only evictable cache may go.
        for _ in range(4):
            e.run(ids(rng, 150), ids(rng, 3))
        e.check()
    assert e.sm.get(sid, ALICE).held_len == prev


def test_history_is_prompt_plus_output_and_must_extend(make):
    e = make(200)
    sid = e.open([1, 2, 3])
    e.turn(sid, [4, 5], [6, 7])
    assert e.history(sid).tolist() == [1, 2, 3, 4, 5, 6, 7]
    e.sm.begin_turn(sid, ALICE, [8])
    with pytest.raises(ValueError, match="does not extend"):
        e.sm.end_turn(sid, [1, 2, 9])
    e.sm.abort_turn(sid)
    assert e.history(sid).tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert e.sm.end_turn("unknown", [1]) is None  # closed meanwhile: a no-op


def test_fork_costs_nothing_and_branches_grow_by_their_own_tokens(make):
    rng = random.Random(1)
    e = make(2000)
    sid = e.open(ids(rng, 300))  # prefill-only: the whole history has KV
    used, retained = e.used(), e.sm.retained_total()
    forks = e.sm.fork(sid, ALICE, 4)
    assert len(set(forks)) == 4 and sid not in forks
    assert (e.used(), e.sm.retained_total()) == (used, retained)
    assert all(e.history(f).tolist() == e.history(sid).tolist() for f in forks)
    added = 0
    for i, f in enumerate(forks):
        # Branches start with different tokens: nothing of one is a prefix of another.
        appended = np.concatenate([[100 + i], ids(rng, rng.randrange(10, 40))])
        output = ids(rng, 5)
        t = e.turn(f, appended, output)
        assert t.cached == 300
        added += len(appended) + len(output)
    assert e.used() - used == added
    assert e.sm.retained_total() - retained == added


def test_fork_makes_as_many_distinct_sessions_as_the_frontend_allows(make):
    e = make(1000)
    sid = e.open(ids(random.Random(9), 20))
    assert len(set(e.sm.fork(sid, ALICE, MAX_FORK))) == MAX_FORK  # (n is the frontend's rule)


def test_truncate_rewinds_and_leaves_the_tail_as_evictable_cache(make):
    rng = random.Random(2)
    e = make(1000)
    sid = e.open(ids(rng, 40))
    e.turn(sid, ids(rng, 30), ids(rng, 10))
    old = e.history(sid)
    kv_len = len(old)
    e.sm.truncate(sid, ALICE, 25)
    assert e.history(sid).tolist() == old[:25].tolist()
    sizes = e.cache.sizes()
    assert sizes.protected == 25
    assert sizes.evictable == kv_len - 25
    assert e.cache.match(old).length == kv_len  # the tail is still cached
    t = e.turn(sid, ids(rng, 7), ids(rng, 3))
    assert t.cached == 25 and t.computed == 7 + 3
    with refused(ErrorCode.INVALID_PARAMS):
        e.sm.truncate(sid, ALICE, e.history(sid).size + 1)
    e.sm.truncate(sid, ALICE, 0)
    assert e.sm.retained_total() == 0


def test_fork_after_truncate_and_close_release_only_their_own_locks(make):
    rng = random.Random(3)
    e = make(1000)
    sid = e.open(ids(rng, 60))
    (f,) = e.sm.fork(sid, ALICE, 1)
    e.sm.truncate(f, ALICE, 20)
    e.sm.close(sid, ALICE)
    assert e.cache.sizes().protected == 20
    with refused(ErrorCode.NOT_FOUND):
        e.sm.begin_turn(sid, ALICE, [1])
    assert e.turn(f, [5, 6]).cached == 20


# --------------------------------------------------------------- ownership
def test_another_clients_session_is_not_found_and_one_turn_at_a_time(make):
    e = make(200)
    sid = e.open([1, 2, 3, 4])
    for call in (
        lambda: e.sm.begin_turn(sid, BOB, [5]),
        lambda: e.sm.fork(sid, BOB, 2),
        lambda: e.sm.truncate(sid, BOB, 1),
        lambda: e.sm.close(sid, BOB),
        lambda: e.sm.begin_turn(sid, ALICE, [5], namespace="other"),
    ):
        with refused(ErrorCode.NOT_FOUND) as err:
            call()
        assert err.value.code == ErrorCode.NOT_FOUND
    assert e.sm.list(BOB) == []
    e.sm.begin_turn(sid, ALICE, [5])
    for call in (
        lambda: e.sm.begin_turn(sid, ALICE, [6]),
        lambda: e.sm.fork(sid, ALICE, 1),
        lambda: e.sm.truncate(sid, ALICE, 1),
        lambda: e.sm.close(sid, ALICE),
    ):
        with refused(ErrorCode.BUSY) as err:
            call()
        assert err.value.code == ErrorCode.BUSY
    (row,) = e.sm.list(ALICE)
    assert row.busy and row.session == sid and row.retention == "hard"
    e.sm.abort_turn(sid)
    assert e.turn(sid, [5], [6]).cached == 4


def test_ids_are_128_bit_random_and_client_gone_closes_only_its_sessions(make):
    rng = random.Random(4)
    e = make(500)
    e.pin("tools", ids(rng, 30))
    mine = [e.open(ids(rng, 10), pinned="tools") for _ in range(3)]
    theirs = e.open(ids(rng, 10), client=BOB, pinned="tools")
    assert all(len(s) == 32 and int(s, 16) >= 0 for s in mine)
    assert len(set(mine)) == 3
    e.sm.begin_turn(mine[0], ALICE, [1])  # busy sessions are closed too
    assert e.sm.client_gone(ALICE) == 3
    e.sm.abort_turn(mine[0])  # the aborted request's abort_turn is then a no-op
    assert [r.session for r in e.sm.list(BOB)] == [theirs]
    assert e.sm.num_pins == 1
    assert e.sm.retained_tokens() == {"pinned": 30, "hard": 10, "soft": 0}


def test_bad_parameters_are_refused_with_their_codes(make):
    e = make(200)
    for kw, code in (
        ({"retention": "firm"}, ErrorCode.INVALID_PARAMS),
        ({"ttl_s": 0.0}, ErrorCode.INVALID_PARAMS),
        ({"pinned": "nope"}, ErrorCode.NOT_FOUND),
    ):
        with pytest.raises(RequestError) as err:
            e.open(**kw)
        assert err.value.code == code
    sid = e.open([1, 2])
    with refused(ErrorCode.INVALID_PARAMS):
        e.sm.truncate(sid, ALICE, -1)
    with refused(ErrorCode.NOT_FOUND):
        e.sm.pinned.unpin("nope")


# --------------------------------------------------------------------- pins
def test_pins_are_shared_named_and_namespaced(make):
    rng = random.Random(5)
    e = make(1000)
    tools = ids(rng, 80)
    e.pin("tools", tools)
    with refused(ErrorCode.DUPLICATE_ID) as err:
        e.pin("tools", tools)
    assert err.value.code == ErrorCode.DUPLICATE_ID
    with refused(ErrorCode.NOT_FOUND):
        e.open(pinned="tools", ns="tenant")
    a = e.open(pinned="tools")
    b = e.open(ids(rng, 5), pinned="tools", retention="soft")
    assert e.history(a).tolist() == tools.tolist()
    assert e.turn(a, ids(rng, 4)).cached == 80
    assert e.sm.retained_tokens() == {"pinned": 80, "hard": 4, "soft": 5}
    e.sm.pinned.unpin("tools")  # the sessions keep their own locks on the prefix
    assert e.sm.retained_tokens() == {"pinned": 0, "hard": 84, "soft": 5}
    e.sm.close(a, ALICE)
    e.sm.close(b, ALICE)
    assert e.cache.sizes().protected == 0


# ------------------------------------------------------------------ retention
def test_idle_ttl_demotes_on_a_fake_clock_and_the_next_turn_still_works(make):
    rng = random.Random(6)
    e = make(400, ttl_s=60.0, retained_cap=400)
    short = e.open(ids(rng, 100), ttl_s=10.0, retention="soft")
    default = e.open(ids(rng, 100))
    forever = e.open(ids(rng, 20), client=BOB)
    e.sm.tick()
    e.now = 9.9
    assert e.sm.tick() == []
    e.now = 10.0
    assert e.sm.tick() == [short]
    e.now = 61.0
    e.sm.begin_turn(forever, BOB, [1])  # busy sessions are not idle
    assert e.sm.tick(e.now) == [default]
    e.sm.abort_turn(forever)
    rows = {r.session: r for r in e.sm.list(ALICE)}
    assert rows[short].retention == "demoted" and rows[short].idle_s == pytest.approx(61.0)
    assert e.sm.retained_tokens()["soft"] == 0
    # Plain traffic evicts part of the demoted history; the next turn recomputes it.
    e.run(ids(rng, 350))
    t = e.turn(short, ids(rng, 10), ids(rng, 2))
    assert t.recomputed > 0
    assert t.cached + t.recomputed == 100
    assert e.sm.get(short, ALICE).residency is Residency.HELD  # held again after the turn
    assert e.turn(short, [3]).cached == 100 + 10 + 2


def test_cap_refuses_beyond_it_or_demotes_idle_soft_sessions_lru(make):
    rng = random.Random(7)
    e = make(1000, retained_cap=100)
    e.pin("sys", ids(rng, 60))
    with refused(ErrorCode.CAPACITY) as err:
        e.open(ids(rng, 50))
    assert err.value.code == ErrorCode.CAPACITY
    s1 = e.open(ids(rng, 20), retention="soft")
    e.now = 1.0
    s2 = e.open(ids(rng, 20), retention="soft")
    assert e.sm.retained_total() == 100
    e.now = 2.0
    h = e.open(ids(rng, 20))  # hard: the least recently used soft session yields
    res = {r.session: r.retention for r in e.sm.list(ALICE)}
    assert res == {s1: "demoted", s2: "soft", h: "hard"}
    forks = e.sm.fork(h, ALICE, 3)  # shared paths count once: no demotion needed
    assert e.sm.retained_total() == 100 and len(forks) == 3
    with refused(ErrorCode.CAPACITY):
        e.pin("more", ids(rng, 30))  # a pin may displace s2 only: 20 < 30 needed
    assert e.sm.get(s2, ALICE).residency is Residency.HELD  # nothing demoted in vain
    e.pin("more", ids(rng, 20))
    assert e.sm.get(s2, ALICE).residency is Residency.DEMOTED
    # A hard session whose own turn crosses the cap keeps its earlier lock; the new
    # tokens are ordinary cache (kept after plain cache), and the next turn reports any
    # of them it had to recompute.
    t = e.turn(h, ids(rng, 30))
    s = e.sm.get(h, ALICE)
    assert (s.residency, s.held_len, s.kv_len) == (Residency.HELD, 20, 50)
    assert t.cached == 20
    e.run(ids(rng, 1000 - 100))  # evicts all unlocked cache
    assert e.turn(h, [1]).recomputed == 30


def test_eviction_order_plain_cache_then_demoted_tails_never_held(make):
    rng = random.Random(8)
    e = make(600, retained_cap=300)
    held = e.open(ids(rng, 150))
    demoted = e.open(ids(rng, 150), retention="soft")
    e.sm.make_room(1)
    assert e.sm.get(demoted, ALICE).residency is Residency.DEMOTED
    junk = ids(rng, 150)
    e.run(junk)  # plain cache, used *after* the demotion: LRU alone would evict it last
    # Need 150 more slots than are free: the plain cache goes, the demoted history stays.
    e.run(ids(rng, 300))
    assert e.cache.match(junk).length < 150
    assert e.cache.match(e.history(demoted)).length == 150
    e.run(ids(rng, 450))  # now the demoted tail must go; the held session never does
    assert e.cache.match(e.history(demoted)).length < 150
    assert e.cache.match(e.history(held)).length == 150
    with pytest.raises(OutOfSlots):
        e.run(ids(rng, 451))


def test_make_room_demotes_idle_soft_sessions_only(make):
    rng = random.Random(9)
    e = make(400, retained_cap=400)
    hard = e.open(ids(rng, 120))
    soft = [e.open(ids(rng, 60), retention="soft") for _ in range(3)]
    e.now = 5.0
    e.sm.begin_turn(soft[0], ALICE, [1])  # busy: not a victim
    made = e.sm.make_room(50)
    assert made == 60
    assert [e.sm.get(s, ALICE).residency for s in soft] == [
        Residency.HELD,
        Residency.DEMOTED,
        Residency.HELD,
    ]
    assert e.sm.make_room(1000) == 60  # the last idle soft one; hard and busy stay
    assert e.sm.get(hard, ALICE).residency is Residency.HELD
    e.sm.abort_turn(soft[0])


def test_at_the_cap_the_rest_of_the_pool_always_serves_running_work(make):
    """Oversubscription: retained sessions and pins at the cap, then more work than
    fits. Each request finishes (soft sessions yield) or fails with a clear error."""
    rng = random.Random(10)
    e = make(512, retained_cap=256)
    e.pin("sys", ids(rng, 64))
    hard = [e.open(ids(rng, 32), pinned="sys") for _ in range(3)]
    soft = [e.open(ids(rng, 32), pinned="sys", retention="soft") for _ in range(3)]
    assert e.sm.retained_total() == 256
    deadline = time.monotonic() + 20
    errors = 0
    for i in range(60):
        try:
            if i % 3 == 0:
                e.run(ids(rng, 250), ids(rng, 4))  # < capacity - cap: must always fit
            else:
                sid = rng.choice(hard + soft)
                e.turn(sid, ids(rng, rng.randrange(20, 120)), ids(rng, 4))
                if e.sm.get(sid, ALICE).length > 120:  # the agent compacts its context
                    e.sm.truncate(sid, ALICE, 96)
        except (OutOfSlots, RequestError) as err:
            errors += 1
            assert str(err)
        e.check()
        assert time.monotonic() < deadline
    assert errors == 0  # growth beyond the cap demotes instead of failing


# ---------------------------------------------------------------- host tier
def test_host_tier_restores_a_demoted_history_instead_of_recomputing(make):
    rng = random.Random(11)
    e = make(400, host_kv_tokens=400, retained_cap=200)
    sid = e.open(ids(rng, 150), retention="soft")
    e.turn(sid, ids(rng, 20), ids(rng, 6))
    kv_len = e.sm.get(sid, ALICE).held_len
    e.sm.make_room(1)
    e.run(ids(rng, 400))  # evicts every cached token of the session
    assert e.cache.match(e.history(sid)).length == 0
    assert e.sm.host_used == kv_len
    t = e.turn(sid, ids(rng, 5), ids(rng, 2))
    assert t.restored == kv_len and t.recomputed == 0 and t.cached == kv_len
    assert e.sm.host_used == 0  # restored segments leave the host tier
    # check() (after the test) verifies the restored slots hold the KV of their path.


def test_host_tier_is_bounded_and_partial_restores_recompute_the_rest(make):
    rng = random.Random(12)
    e = make(400, host_kv_tokens=100, retained_cap=200)
    sid = e.open(ids(rng, 40), retention="soft")
    for _ in range(4):
        e.turn(sid, ids(rng, 30), ids(rng, 1))  # nodes of 30 tokens each
    kv_len = e.sm.get(sid, ALICE).held_len
    e.sm.make_room(1)
    e.run(ids(rng, 400))
    assert e.sm.host_used <= 100
    t = e.turn(sid, [1, 2], [3])
    assert 0 < t.restored <= 100
    assert t.cached + t.recomputed == kv_len
    e.sm.close(sid, ALICE)
    assert e.sm.host_used == 0


def test_closed_sessions_are_not_kept_in_host_memory(make):
    rng = random.Random(13)
    e = make(300, host_kv_tokens=300)
    sid = e.open(ids(rng, 100), retention="soft")
    e.sm.close(sid, ALICE)
    e.run(ids(rng, 300))
    assert e.sm.host_used == 0


def test_forks_of_a_demoted_session_restore_from_the_same_host_copy(make):
    rng = random.Random(14)
    e = make(300, host_kv_tokens=300)
    sid = e.open(ids(rng, 100), retention="soft")
    e.sm.make_room(1)
    (f,) = e.sm.fork(sid, ALICE, 1)
    assert e.sm.get(f, ALICE).residency is Residency.DEMOTED
    e.run(ids(rng, 300))
    assert e.turn(f, [1]).restored == 100
    assert e.turn(sid, [2]).cached == 100  # now on the device again: a plain hit


# ------------------------------------------------------------- random walk
@pytest.mark.parametrize("page_size,seed", [(1, 0), (4, 1), (1, 2)])
def test_random_operations_keep_every_invariant(make, page_size, seed):
    rng = random.Random(seed)
    e = make(512, page_size=page_size, retained_cap=256, host_kv_tokens=128 if seed != 2 else 0)
    clients = [ALICE, BOB]
    opened: list[tuple[str, bytes]] = []
    pins: list[str] = []
    for step in range(250):
        e.now += rng.random() * 3
        op = rng.random()
        try:
            if op < 0.15 or not opened:
                c = rng.choice(clients)
                pinned = rng.choice(pins) if pins and rng.random() < 0.5 else None
                sid = e.open(
                    ids(rng, rng.randrange(0, 40)),
                    client=c,
                    retention=rng.choice(["hard", "soft"]),
                    ttl_s=rng.choice([None, 5.0, 20.0]),
                    pinned=pinned,
                )
                opened.append((sid, c))
            elif op < 0.5:
                sid, c = rng.choice(opened)
                e.turn(sid, ids(rng, rng.randrange(1, 40)), ids(rng, rng.randrange(0, 8)), c)
            elif op < 0.58:
                sid, c = rng.choice(opened)
                opened += [(f, c) for f in e.sm.fork(sid, c, rng.randrange(1, 4))]
            elif op < 0.64:
                sid, c = rng.choice(opened)
                e.sm.truncate(sid, c, rng.randrange(0, e.sm.get(sid, c).length + 1))
            elif op < 0.70:
                sid, c = opened.pop(rng.randrange(len(opened)))
                e.sm.close(sid, c)
            elif op < 0.75:
                name = f"p{step}"
                e.pin(name, ids(rng, rng.randrange(8, 60)))
                pins.append(name)
            elif op < 0.78 and pins:
                e.sm.pinned.unpin(pins.pop(rng.randrange(len(pins))))
            elif op < 0.85:
                e.sm.tick()
            elif op < 0.97:
                e.run(ids(rng, rng.randrange(10, 300)), ids(rng, rng.randrange(0, 5)))
            else:
                c = rng.choice(clients)
                e.sm.client_gone(c)
                opened = [(s, o) for s, o in opened if o != c]
        except (RequestError, OutOfSlots) as err:
            assert isinstance(err, OutOfSlots) or err.code == ErrorCode.CAPACITY, err
        e.check()
