"""The router's pure parts against brute-force references: the approximate tree's
matches, the balance rule, replay steps, merged stats, and session ids that never
collide across replicas."""

from __future__ import annotations

import random
from typing import Any

import pytest
import zmq
from radixlm.runtime.protocol import (
    Generate,
    Histogram,
    Input,
    Message,
    OpenSession,
    SessionInfo,
    StatsReply,
    TruncateSession,
)
from radixlm.runtime.router.config import ReplicaSpec, RouterConfig, parse_replica
from radixlm.runtime.router.merge import merge_stats
from radixlm.runtime.router.policy import Balance, choose
from radixlm.runtime.router.prefix_tree import ApproxTree
from radixlm.runtime.router.prefix_tree import _common as _common_at
from radixlm.runtime.router.records import Appended, Cut, Opened, Produced
from radixlm.runtime.router.replay import replay_steps
from radixlm.runtime.router.server import Client, Router


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _brute(sent: dict[int, list[str]], key: str) -> dict[int, int]:
    best = {r: max(_common(k, key) for k in keys) for r, keys in sent.items() if keys}
    return {r: n for r, n in best.items() if n > 0}


def test_common_prefix_lengths() -> None:
    rng = random.Random(1)
    for _ in range(5000):
        a = "".join(rng.choice("ab") for _ in range(rng.randint(0, 80)))
        b = "".join(rng.choice("ab") for _ in range(rng.randint(0, 80)))
        start = rng.randint(0, len(b))
        assert _common_at(a, b, start) == _common(a, b[start:])


@pytest.mark.parametrize("seed", range(5))
def test_tree_matches_like_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    tree = ApproxTree()
    sent: dict[int, list[str]] = {0: [], 1: [], 2: []}
    alphabet = "abc"
    for _ in range(300):
        key = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        replica = rng.randrange(3)
        tree.insert(key, replica, tree.path(key) if rng.random() < 0.5 else None)
        sent[replica].append(key)
        query = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        assert tree.match(query) == _brute(sent, query)
    # each replica's share counts every character of its part of the tree once
    for replica, keys in sent.items():
        prefixes = {k[:i] for k in keys for i in range(1, len(k) + 1)}
        assert tree.chars[replica] == len(prefixes)


def test_tree_forgets_lru_leaves_past_its_cap_and_dead_replicas() -> None:
    tree = ApproxTree(cap_chars=100)
    keys = [f"{i:03d}" + "x" * 27 for i in range(20)]  # 30 chars each, distinct from char 0..2
    for k in keys:
        tree.insert(k, 0)
        tree.insert(k, 1)
    assert tree.chars[0] <= 100
    assert tree.match(keys[-1]) == {0: 30, 1: 30}  # the most recent stays
    assert tree.match(keys[0]).get(0, 0) < 30  # the oldest went
    tree.insert(keys[-1], 2)
    tree.remove_replica(1)
    assert tree.match(keys[-1]) == {0: 30, 2: 30}
    tree.remove_prefix("01")  # keys 010-019 go; the "0" they share with 000-009 stays
    assert tree.match(keys[19]) == {0: 1, 2: 1}
    assert tree.chars[2] == 1


def test_balance_rule() -> None:
    b = Balance(cache_threshold=0.5, abs_tokens=100, new_abs_tokens=100, rel=1.5)
    live = [0, 1, 2]
    tree = ApproxTree()
    key = "k" * 100
    tree.insert("k" * 60 + "x", 1)
    tree.insert("k" * 10 + "y", 2)
    match = tree.path(key)
    assert (match.length(0), match.length(1), match.length(2)) == (0, 60, 10)
    # cache: the longest match wins when it covers half the key, even if busier
    assert choose(b, live, set(live), match, 100, [0, 50, 0], {}, 0) == 1
    # room: a short match does not decide; the least loaded (then the smaller tree) does
    short = tree.path("k" * 40 + "z" * 60)
    assert choose(b, live, set(live), short, 100, [5, 0, 0], {1: 9, 2: 3}, 0) == 2
    assert choose(b, live, set(live), short, 100, [5, 0, 0], {1: 3, 2: 9}, 0) == 1
    # imbalance: far apart in absolute and relative terms, the idlest wins
    assert choose(b, live, set(live), match, 100, [300, 400, 200], {}, 0) == 2
    # ...but a long conversation cached at home stays there unless the gap is larger
    # than what the other replica would have to compute of it
    long = ApproxTree()
    long.insert("c" * 4000, 1)
    home = long.path("c" * 4000)
    assert choose(b, live, set(live), home, 4000, [0, 900, 0], {}, 0) == 1
    assert choose(b, live, set(live), home, 4000, [0, 1100, 0], {}, 0) == 0
    # far apart in absolute terms only (400 < 1.5 * 300): still the cache
    assert choose(b, live, set(live), match, 100, [300, 400, 300], {}, 0) == 1
    # a dead replica's match does not count
    assert choose(b, [0, 2], set([0, 2]), match, 100, [0, 0, 0], {}, 0) == 0
    # the gap: new work is balanced sooner than a continuation (a key that runs through
    # the whole of a leaf: a conversation's next turn)
    assert not match.continues() and home.continues()
    wide = Balance(cache_threshold=0.5, abs_tokens=1000, new_abs_tokens=100, rel=1.5)
    assert choose(wide, live, set(live), match, 100, [300, 400, 200], {}, 0) == 2
    assert choose(wide, live, set(live), home, 4000, [0, 900, 0], {}, 0) == 1  # stays
    assert choose(wide, live, set(live), home, 4000, [0, 1100, 0], {}, 0) == 0
    rr = Balance(policy="round_robin")
    assert [choose(rr, live, set(live), match, 100, [0, 0, 0], {}, t) for t in range(4)] == [0, 1, 2, 0]


def test_replay_steps_rebuild_the_log_in_order() -> None:
    opened = OpenSession(rid="o", input=Input(text="hi"), retention="soft")
    turn = Input(messages=[Message(role="user", content="a")])
    log: list[Any] = [Opened(opened), Appended(turn, None), Produced([1, 2]), Produced([3]),
                      Cut(4), Appended(Input(text=" more"), None), Produced([5])]
    first, steps = replay_steps(log)
    assert first is opened
    assert [type(s).__name__ for s in steps] == ["Generate", "Generate", "TruncateSession",
                                                 "Generate", "Generate"]
    assert all(s.sampling.max_tokens == 0 for s in steps if isinstance(s, Generate))
    assert steps[0].input is turn and steps[1].input.input_ids == [1, 2, 3]  # type: ignore[union-attr]
    assert isinstance(steps[2], TruncateSession) and steps[2].length == 4
    assert steps[4].input.input_ids == [5]  # type: ignore[union-attr]


def test_merged_stats_sum_and_recompute_the_hit_rate() -> None:
    def stats(capacity: int, prompt: int, cached: int, ok: bool = True) -> StatsReply:
        return StatsReply(rid="x", capacity=capacity, free=capacity, evictable=0, protected=0,
                          private=0, retained_tokens={"hard": capacity // 10}, retained_cap=1,
                          host_capacity=0, host_used=0, sessions=1, pins=0, running=1,
                          waiting=0, prompt_tokens_total=prompt, cached_tokens_total=cached,
                          hit_rate=cached / prompt, invariant_ok=ok, generated_tokens_total=2,
                          retractions=0, fair_preemptions=0, capped_steps=0,
                          finish_reasons={"stop": 1}, latency={"ttft": Histogram(
                              bounds=[0.1], counts=[1, capacity // 100], sum=1.0, count=2)})

    merged = merge_stats("r", [stats(100, 10, 5), stats(300, 30, 25, ok=False)])
    assert (merged.rid, merged.capacity, merged.sessions, merged.running) == ("r", 400, 2, 2)
    assert merged.retained_tokens == {"hard": 40} and merged.finish_reasons == {"stop": 2}
    assert merged.latency["ttft"].counts == [2, 4] and merged.latency["ttft"].count == 4
    assert merged.hit_rate == pytest.approx(30 / 40)
    assert merged.invariant_ok is False


def test_replica_specs() -> None:
    assert parse_replica("tcp://10.0.0.2:5555") == ReplicaSpec("tcp://10.0.0.2:5555")
    for bad in ("10.0.0.2:5555", "tcp://h:1,server_key=a", "tcp://h:1,colour=red"):
        with pytest.raises(ValueError):
            parse_replica(bad)


def test_session_ids_never_collide_across_replicas() -> None:
    """Two replicas may (by chance) make the same id: the client still gets two distinct
    sessions, each routed to its own replica under its own id there."""
    ctx: zmq.Context[Any] = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    monitor = ctx.socket(zmq.PAIR)
    try:
        config = RouterConfig(replicas=(ReplicaSpec("ipc:///nonexistent/a"),
                                        ReplicaSpec("ipc:///nonexistent/b")))
        router = Router(config, ctx, front, monitor, None)
        client = Client(b"c", -1, None)
        table = router.sessions
        first = table.adopt(client, 0, "f" * 32, [], 1, "")
        second = table.adopt(client, 1, "f" * 32, [], 2, "")
        assert first.vid == "f" * 32 != second.vid
        assert (table.records[first.vid].home, table.records[second.vid].home) == (0, 1)
        assert table.records[second.vid].inner == "f" * 32
        info = SessionInfo(session="f" * 32, length=2, idle_s=0.0, retention="hard", busy=False)
        assert table.view(1, info).session == second.vid  # type: ignore[union-attr]
        assert table.view(0, info).session == first.vid  # type: ignore[union-attr]
        router.close()
    finally:
        front.close(0)
        monitor.close(0)
        ctx.term()


def test_replicas_on_gpus_take_their_own_devices() -> None:
    from radixlm.runtime.config import EngineConfig
    from radixlm.runtime.router.cli import replica_config

    gpus = EngineConfig(device="cuda", tensor_parallel_size=2)
    assert [replica_config(gpus, i).device for i in range(3)] == ["cuda:0", "cuda:2", "cuda:4"]
    assert replica_config(EngineConfig(device="cuda:1"), 3).device == "cuda:1"
    assert replica_config(EngineConfig(device="cpu"), 3).device == "cpu"


def _prefixes(keys: list[str]) -> int:
    return len({k[:i] for k in keys for i in range(1, len(k) + 1)})


def _gap(balance: Balance, sent: dict[int, list[str]], key: str) -> int:
    """A continuation (`key` extends a key sent before, to any replica, that no other
    sent key extends) gets the wider gap."""
    keys = {k for ks in sent.values() for k in ks}
    continues = any(key.startswith(k) and not any(o != k and o.startswith(k) for o in keys)
                    for k in keys)
    return balance.abs_tokens if continues else balance.new_abs_tokens


def _reference_place(balance: Balance, sent: dict[int, list[str]], live: list[int], key: str,
                     loads: list[int], turn: int) -> tuple[int, int, str]:
    """policy.py's rule written out naively: each live replica's longest common prefix
    with anything it was sent, its load, its share of the tree."""
    rule = "one"
    if balance.policy == "round_robin":
        replica, rule = live[turn % len(live)], "round robin"
    elif len(live) == 1:
        replica = live[0]
    else:
        length = {r: max((_common(k, key) for k in sent[r]), default=0) for r in live}
        lo, hi = min(loads[r] for r in live), max(loads[r] for r in live)
        if hi - lo > _gap(balance, sent, key) and hi > balance.rel * lo:
            replica = min(live, key=lambda r: (loads[r] + (len(key) - length[r]) // 4,
                                               -length[r], r))
            rule = "imbalance"
        else:
            best = max(length.values())
            if best > 0 and best >= balance.cache_threshold * len(key):
                replica = min((r for r in live if length[r] == best),
                              key=lambda r: (loads[r], r))
                rule = "cache"
            else:
                replica = min((r for r in live if loads[r] == lo),
                              key=lambda r: (_prefixes(sent[r]), r))
                rule = "room"
    matched = max((_common(k, key) for k in sent[replica]), default=0)
    return replica, max(0, len(key) // 4 - matched // 4) + 8, rule


@pytest.mark.parametrize("seed", range(6))
def test_routing_decisions_equal_a_brute_force_reference(seed: int) -> None:
    """`Routing.place` (tree walk, policy, insert) against the rule computed naively, on
    random workloads: shared prefixes, replicas going out and back, loads rising and
    falling across all three rules."""
    from radixlm.runtime.router.routing import Routing

    rng = random.Random(seed)
    replicas = rng.choice([2, 3, 5, 8])
    balance = Balance(policy="round_robin" if seed == 5 else "cache_aware",
                      cache_threshold=rng.choice([0.3, 0.5, 0.8]),
                      abs_tokens=rng.choice([5, 20, 60]), new_abs_tokens=rng.choice([3, 20]),
                      rel=rng.choice([1.2, 1.5, 3.0]))
    routing = Routing(balance, replicas)
    sent: dict[int, list[str]] = {r: [] for r in range(replicas)}
    stems = ["".join(rng.choice("abcd") for _ in range(rng.randint(4, 40))) for _ in range(6)]
    rules, kinds = set(), set()
    for turn in range(400):
        key = rng.choice(stems) + "".join(rng.choice("abcd") for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.3:
            stems.append(key)  # a conversation that goes on
        live = sorted(rng.sample(range(replicas), rng.randint(1, replicas)))
        routing.alive = frozenset(live)
        *want, rule = _reference_place(balance, sent, live, key, routing.loads, turn)
        continued = _gap(balance, sent, key) == balance.abs_tokens
        got = routing.place(key, live, None, 8)
        assert got == tuple(want), (turn, key, live, routing.loads)
        rules.add(rule)
        routing.loads[got[0]] += got[1]
        sent[got[0]].append(key)
        kinds.add("continues" if continued else "new")
        for r in range(replicas):  # requests finishing
            if rng.random() < 0.2:
                routing.unload(r, rng.randint(0, 40))
        assert routing.tree.chars == {r: _prefixes(k) for r, k in sent.items() if k}
    assert kinds == {"continues", "new"}
    if balance.policy == "cache_aware":
        assert {"imbalance", "cache", "room"} <= rules, rules


def _bare_router(replicas: int) -> tuple[Router, Any]:
    ctx: zmq.Context[Any] = zmq.Context()
    front, monitor = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PAIR)
    config = RouterConfig(replicas=tuple(ReplicaSpec(f"ipc:///nonexistent/{i}")
                                         for i in range(replicas)))
    router = Router(config, ctx, front, monitor, None)

    def done() -> None:
        router.close()
        front.close(0)
        monitor.close(0)
        ctx.term()
    return router, done


def test_sigterm_is_never_swallowed_by_the_per_message_guard() -> None:
    """SIGTERM raises StopRequested wherever the loop is; the guard that turns one
    message's bug into an error reply must let it through (it did not: the router
    then ran on after SIGTERM)."""
    from radixlm.runtime.cli.common import StopRequested

    router, done = _bare_router(1)
    try:
        def stop(client: Client, data: bytes) -> None:
            raise StopRequested
        router.dispatch = stop  # type: ignore[method-assign]
        with pytest.raises(StopRequested):
            router._dispatch_guarded(Client(b"c", -1, None), b"")
    finally:
        done()


def test_opens_from_a_hot_pin_spread_over_replicas_still_placing_it() -> None:
    from radixlm.runtime.router.records import PinRecord

    router, done = _bare_router(3)
    try:
        for r in router.replicas.replicas:
            r.up = True
        router.send = lambda client, replica, msg: None  # type: ignore[method-assign]
        client = Client(b"c", -1, None)
        pin = PinRecord("p", None, Input(text="x"), None, "\x00\x00x", 1, holders={0})
        pin.uses = router.config.hot_pin_uses  # the next use makes it hot
        homes = []
        for _ in range(6):  # a burst: no placement answered yet
            home = router.pins.home(client, pin, router.live())
            router.sessions.homed[home] += 1
            homes.append(home)
        assert pin.placing == {1, 2} and pin.holders == {0}
        assert sorted(homes) == [0, 0, 1, 1, 2, 2], homes
    finally:
        done()
