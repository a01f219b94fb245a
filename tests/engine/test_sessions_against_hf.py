"""Sessions end to end: Scheduler + SessionManager + a tiny random Llama on CPU.

Every generated token is checked against HF transformers' greedy decoding of the same
full prompt (an independent reference: no radix cache, no session), so reuse, fork,
truncate, demotion and host-tier restore must all be exact, not just fast. Usage figures
are checked against what the history says must have been cached. After every test the
pool invariant holds and the locked tokens are exactly the retained ones.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from radixlm.cache import KVPool, PrefixCache
from radixlm.runtime import protocol as wire
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.options import SchedulerOptions
from radixlm.runtime.engine.sampling import Sampler
from radixlm.runtime.engine.scheduler import Scheduler
from radixlm.runtime.engine.sessions import Residency, SessionManager
from radixlm.runtime.engine.wire import (
    EngineCommand,
    EngineGenerate,
    EngineOpenSession,
    EnginePin,
    StepOutputs,
    ToClient,
)
from radixlm.runtime.model.config import ModelConfig
from radixlm.runtime.model.runner import ModelRunner
from tiny_models import EOS_ID, make_tiny_checkpoint

ALICE, BOB = b"alice", b"bob"
VOCAB_LO, VOCAB_HI = 3, 400  # ordinary tokens of the tiny tokenizer


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core runner the spinning
    OpenMP workers make every forward ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sessions"), "llama", seed=3)


@pytest.fixture(scope="module")
def reference(model_dir):
    """HF transformers greedy decoding without any cache: the expected tokens."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()

    @torch.no_grad()
    def greedy(prompt: Sequence[int], n: int) -> list[int]:
        ids = list(map(int, prompt))
        out = []
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
        return out

    return greedy


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    usage: wire.Usage | None = None
    session: str | None = None
    session_length: int | None = None
    finish_reason: str | None = None


class Engine:
    """A scheduler with sessions, driven in-process (no sockets)."""

    def __init__(
        self,
        model_dir,
        kv_tokens: int,
        *,
        retained_cap: int = 0,
        host_kv_tokens: int = 0,
    ) -> None:
        self.now = 100.0
        cfg = ModelConfig.from_dir(model_dir)
        self.pool = KVPool(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_tokens, 1, torch.float32, "cpu"
        )
        runner = ModelRunner(model_dir, "cpu", torch.float32, self.pool, attention="torch")
        self.cache = PrefixCache(kv_tokens, 1, "priority")
        config = EngineConfig(retained_cap=retained_cap, host_kv_tokens=host_kv_tokens)
        self.sm = SessionManager(self.cache, config, self.clock, kv_pool=self.pool)
        options = SchedulerOptions(
            context_length=cfg.max_position_embeddings, check_invariants=True
        )
        self.sched = Scheduler(
            self.cache,
            runner,
            Sampler(cfg.vocab_size),
            options,
            eos_token_ids=[EOS_ID],
            sessions=self.sm,
            clock=self.clock,
        )
        self._keys = itertools.count(1)
        self._rids = itertools.count(1)
        self.replies: dict[str, object] = {}
        self.results: dict[int, dict[int, Result]] = defaultdict(lambda: defaultdict(Result))
        self.rid_of: dict[int, str] = {}

    def clock(self) -> float:
        return self.now

    # -------------------------------------------------------------- messages
    def send(self, msg) -> None:
        self.sched.handle(msg)
        self._collect()

    def _collect(self) -> None:
        for out in self.sched.take_outbox():
            if isinstance(out, ToClient):
                reply = wire.decode_server(out.data)
                self.replies[reply.rid] = reply
            elif isinstance(out, StepOutputs):
                for o in out.outputs:
                    r = self.results[o.key][o.index]
                    r.tokens += o.token_ids
                    if o.finish_reason is not None:
                        r.finish_reason = o.finish_reason
                        r.usage, r.session = o.usage, o.session
                        r.session_length = o.session_length

    def drain(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.sched.has_work():
            assert time.monotonic() < deadline, "the engine did not finish its work in time"
            self.sched.step()
            self._collect()

    def rid(self) -> str:
        return f"r{next(self._rids)}"

    def submit(
        self,
        ids: Sequence[int],
        *,
        session: str | None = None,
        max_tokens: int = 6,
        n: int = 1,
        client: bytes = ALICE,
    ) -> int:
        key = next(self._keys)
        rid = self.rid()
        self.rid_of[key] = rid
        sampling = wire.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.send(
            EngineGenerate(
                key=key,
                client=client,
                rid=rid,
                input_ids=[int(t) for t in ids],
                sampling=sampling,
                session=session,
                n=n,
            )
        )
        return key

    def generate(self, ids: Sequence[int], **kw) -> Result:
        key = self.submit(ids, **kw)
        self.drain()
        error = self.replies.get(self.rid_of[key])
        assert error is None, error
        return self.results[key][0]

    def open(self, input_ids: Sequence[int] = (), *, client: bytes = ALICE, **kw):
        rid = self.rid()
        self.send(
            EngineOpenSession(client=client, rid=rid, input_ids=[int(t) for t in input_ids], **kw)
        )
        self.drain()
        return self.replies[rid]

    def pin(self, name: str, ids: Sequence[int]):
        rid = self.rid()
        self.send(EnginePin(client=ALICE, rid=rid, name=name, input_ids=[int(t) for t in ids]))
        self.drain()
        return self.replies[rid]

    def command(self, msg, client: bytes = ALICE):
        self.send(EngineCommand(client=client, msg=msg))
        return self.replies[msg.rid]

    def history(self, sid: str, client: bytes = ALICE) -> list[int]:
        return self.sm.get(sid, client).history.tolist()

    def used(self) -> int:
        return self.cache.capacity - self.cache.sizes().free

    def check(self) -> None:
        self.drain()
        self.sched.check_integrity()
        self.cache.check_integrity(0)
        assert self.cache.sizes().protected == self.sm.retained_total()
        assert self.sm.retained_total() <= self.sm.retained_cap
        assert not any(s.busy for s in self.sm.sessions())


@pytest.fixture
def engines() -> list[Engine]:
    return []


@pytest.fixture(autouse=True)
def _invariant_after_each_test(engines):
    yield
    for e in engines:
        e.check()


@pytest.fixture
def make(engines, model_dir):
    def _make(kv_tokens: int, **kw) -> Engine:
        e = Engine(model_dir, kv_tokens, **kw)
        engines.append(e)
        return e

    return _make


def ids(rng: random.Random, n: int, first: int | None = None) -> list[int]:
    out = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]
    if first is not None:
        out[0] = first
    return out


# ------------------------------------------------------------------------ turns
def test_ten_turns_each_reuses_the_whole_previous_history(make, reference):
    rng = random.Random(0)
    e = make(384)
    opened = e.open(ids(rng, 20))
    assert isinstance(opened, wire.SessionOpened) and opened.length == 20
    sid = opened.session
    history = e.history(sid)
    for turn in range(10):
        appended = ids(rng, rng.randrange(6, 12))
        r = e.generate(appended, session=sid, max_tokens=6)
        prompt = history + appended
        assert r.tokens == reference(prompt, 6), f"turn {turn}"
        # The whole previous history (its last sampled token included) is reused.
        assert r.usage.cached_tokens == len(history), f"turn {turn}"
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.recomputed_tokens == r.usage.restored_tokens == 0
        history = prompt + r.tokens
        assert e.history(sid) == history and r.session_length == len(history)
        # Plain traffic that does not fit beside the session: only unlocked cache goes.
        e.generate(ids(rng, 190), max_tokens=1)


def test_fork_into_four_grows_the_pool_only_by_the_branches(make, reference):
    rng = random.Random(1)
    e = make(1024)
    sid = e.open(ids(rng, 60)).session
    used = e.used()
    forked = e.command(wire.ForkSession(rid=e.rid(), session=sid, n=4))
    assert isinstance(forked, wire.SessionsForked) and len(set(forked.sessions)) == 4
    assert e.used() == used  # no copy
    base = e.history(sid)
    appended = [ids(rng, rng.randrange(5, 15), first=VOCAB_LO + i) for i in range(4)]
    keys = [
        e.submit(a, session=f, max_tokens=5) for f, a in zip(forked.sessions, appended, strict=True)
    ]  # all four run together
    e.drain()
    for key, a in zip(keys, appended, strict=True):
        r = e.results[key][0]
        assert r.tokens == reference(base + a, 5)
        assert r.usage.cached_tokens == len(base)  # no recompute
    assert e.used() - used == sum(len(a) + 5 for a in appended)


def test_truncate_then_continue(make, reference):
    rng = random.Random(2)
    e = make(512)
    sid = e.open(ids(rng, 30)).session
    e.generate(ids(rng, 10), session=sid, max_tokens=6)
    full = e.history(sid)
    assert isinstance(e.command(wire.TruncateSession(rid=e.rid(), session=sid, length=35)), wire.Ok)
    assert e.history(sid) == full[:35]
    appended = ids(rng, 8)
    r = e.generate(appended, session=sid, max_tokens=6)
    assert r.usage.cached_tokens == 35
    assert r.tokens == reference(full[:35] + appended, 6)
    bad = e.command(wire.TruncateSession(rid=e.rid(), session=sid, length=10_000))
    assert isinstance(bad, wire.Error) and bad.code == wire.ErrorCode.INVALID_PARAMS


def test_n_branches_continue_in_their_own_sessions(make, reference):
    rng = random.Random(3)
    e = make(512)
    sid = e.open(ids(rng, 20)).session
    base = e.history(sid)
    appended = ids(rng, 6)
    key = e.submit(appended, session=sid, max_tokens=4, n=3)
    e.drain()
    branches = e.results[key]
    assert len(branches) == 3
    assert e.history(sid) == base + appended  # the input only
    for r in branches.values():
        assert r.session not in (None, sid)
        assert e.history(r.session) == base + appended + r.tokens
        assert r.tokens == reference(base + appended, 4)  # greedy: all alike


# -------------------------------------------------------------------- ownership
def test_another_clients_session_is_not_found_and_a_second_turn_is_busy(make):
    rng = random.Random(4)
    e = make(256)
    sid = e.open(ids(rng, 10)).session
    key = e.submit(ids(rng, 4), session=sid, client=BOB)
    err = e.replies[e.rid_of[key]]
    assert isinstance(err, wire.Error) and err.code == wire.ErrorCode.NOT_FOUND
    first = e.submit(ids(rng, 4), session=sid)
    second = e.submit(ids(rng, 4), session=sid)
    err = e.replies[e.rid_of[second]]
    assert isinstance(err, wire.Error) and err.code == wire.ErrorCode.BUSY
    e.drain()
    assert e.rid_of[first] not in e.replies and len(e.results[first][0].tokens) == 6
    listed = e.command(wire.ListSessions(rid=e.rid()), client=BOB)
    assert isinstance(listed, wire.SessionList) and listed.sessions == []


# -------------------------------------------------------------------- retention
def test_cap_refuses_pins_and_hard_opens_and_demotes_soft_sessions(make):
    rng = random.Random(5)
    e = make(512, retained_cap=64)
    assert isinstance(e.pin("tools", ids(rng, 40)), wire.Pinned)
    refused = e.open(ids(rng, 40))
    assert isinstance(refused, wire.Error) and refused.code == wire.ErrorCode.CAPACITY
    soft = e.open(ids(rng, 20), retention="soft").session
    e.now += 1
    hard = e.open(ids(rng, 20)).session
    rows = {r.session: r.retention for r in e.command(wire.ListSessions(rid=e.rid())).sessions}
    assert rows == {soft: "demoted", hard: "hard"}
    refused = e.pin("more", ids(rng, 10))
    assert isinstance(refused, wire.Error) and refused.code == wire.ErrorCode.CAPACITY
    assert e.sm.retained_tokens() == {"pinned": 40, "hard": 20, "soft": 0}


def test_ttl_demotion_then_the_next_turn_recomputes_what_was_evicted(make, reference):
    rng = random.Random(6)
    e = make(256, retained_cap=128)
    sid = e.open(ids(rng, 30), retention="soft", ttl_s=5.0).session
    e.generate(ids(rng, 10), session=sid, max_tokens=6)
    held = e.sm.get(sid, ALICE).held_len
    e.now += 6
    e.sched.maybe_tick(e.now)
    assert e.sm.get(sid, ALICE).residency is Residency.DEMOTED
    e.generate(ids(rng, 240), max_tokens=2)  # evicts (most of) the demoted history
    history = e.history(sid)
    appended = ids(rng, 5)
    r = e.generate(appended, session=sid, max_tokens=6)
    assert r.usage.recomputed_tokens > 0 and r.usage.restored_tokens == 0
    assert r.usage.cached_tokens + r.usage.recomputed_tokens == held
    assert r.tokens == reference(history + appended, 6)
    assert e.sm.get(sid, ALICE).residency is Residency.HELD  # held again


def test_host_tier_restore_equals_recompute(make, reference):
    rng = random.Random(7)
    e = make(256, retained_cap=128, host_kv_tokens=256)
    sid = e.open(ids(rng, 30), retention="soft", ttl_s=5.0).session
    e.generate(ids(rng, 10), session=sid, max_tokens=6)
    held = e.sm.get(sid, ALICE).held_len
    e.now += 6
    e.sched.maybe_tick(e.now)
    e.generate(ids(rng, 240), max_tokens=2)
    assert e.sm.host_used > 0
    history = e.history(sid)
    appended = ids(rng, 5)
    r = e.generate(appended, session=sid, max_tokens=6)
    assert r.usage.restored_tokens > 0
    assert r.usage.cached_tokens + r.usage.recomputed_tokens == held
    assert r.tokens == reference(history + appended, 6)


def test_oversubscribed_pool_finishes_or_refuses_everything_in_time(make, reference):
    """Pins and sessions fill the retention cap, then more work than the pool holds
    arrives at once: every request finishes or gets a clear error, within a bound."""
    rng = random.Random(8)
    e = make(320, retained_cap=160)
    assert isinstance(e.pin("sys", ids(rng, 40)), wire.Pinned)
    hard = [e.open(ids(rng, 30), pinned="sys").session for _ in range(2)]
    soft = [e.open(ids(rng, 30), pinned="sys", retention="soft").session for _ in range(2)]
    assert e.sm.retained_total() == 160
    start = time.monotonic()
    keys = {}
    for sid in hard + soft:
        a = ids(rng, rng.randrange(10, 40))
        keys[e.submit(a, session=sid, max_tokens=8)] = e.history(sid) + a
    for _ in range(6):
        p = ids(rng, rng.randrange(60, 120))
        keys[e.submit(p, max_tokens=8)] = p
    too_big = e.submit(ids(rng, 250), max_tokens=8)  # beyond the pool less pins + hard
    e.drain(timeout_s=60)
    assert time.monotonic() - start < 60
    err = e.replies[e.rid_of[too_big]]
    assert isinstance(err, wire.Error) and err.code in (wire.ErrorCode.CAPACITY, wire.ErrorCode.TOO_LONG)
    for key, prompt in keys.items():
        r = e.results[key][0]
        assert e.rid_of[key] not in e.replies, e.replies.get(e.rid_of[key])
        assert r.finish_reason == "length"
        assert r.tokens == reference(prompt, 8)
    for sid in hard:  # hard sessions were never released
        assert e.sm.get(sid, ALICE).residency is Residency.HELD
    assert np.all([e.cache.match(e.history(s)).length >= 70 for s in hard])
