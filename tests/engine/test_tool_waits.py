"""Sessions waiting on tools, in the scheduler (tiny model, in-process).

A turn that carried tools and ends in a call of one leaves its session waiting on it; the
engine reads the call from the output itself (the one call parser). Under pressure the
waiting history is demoted to the host tier (and on to disk), and brought back before the
result is appended -- on the client's hint (`tool_done_soon`), on the engine's estimate,
or at the append -- and the turn that follows is token-exact: its prompt is the
conversation as transformers' `apply_chat_template` renders it, with the model's call as
its own tokens, and its output is HF transformers' greedy continuation of that prompt.
Every test ends with the pool invariant and the cache's own checks (the harness).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import scheduler_harness as harness
import transformers
from radixlm.cache.disk_kv import DiskKV
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.sessions import SessionManager
from radixlm.runtime.engine.sessions.disk_backup import layout_of
from radixlm.runtime.engine.wire import EngineCommand
from radixlm.runtime.grammar.runtime import Grammars
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.model import ModelConfig
from radixlm.runtime.protocol import (
    Error,
    ErrorCode,
    ForkSession,
    GetStats,
    Ok,
    SessionsForked,
    StatsReply,
    ToolDoneSoon,
)
from radixlm.tokenizer import Tokenizer
from scheduler_harness import hf_greedy
from tiny_models import EOS_ID

from tests.engine.test_sessions_in_scheduler import C, open_session, sessions_by_id

hf, make_harness, tiny_dir = harness.hf, harness.make_harness, harness.tiny_dir
one_thread, scheduler_pool_integrity = harness.one_thread, harness.scheduler_pool_integrity

CALL = r'\{"name": "search", "arguments": \{"q": "[a-z]{3}"\}\}'
PLACEHOLDER = "@@REPLY@@"


@pytest.fixture(scope="module")
def grammars(tiny_dir):
    g = Grammars(Tokenizer.load(tiny_dir), ModelConfig.from_dir(tiny_dir).vocab_size, [EOS_ID])
    yield g
    g.close()


@pytest.fixture(scope="module")
def hf_tok(tiny_dir) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


def render(hf_tok: Any, messages: list[dict[str, str]]) -> str:
    return hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode(hf_tok: Any, text: str) -> list[int]:
    return hf_tok.encode(text, add_special_tokens=False)


FIRST = [{"role": "system", "content": "Call search to look things up."},
         {"role": "user", "content": "find the cache"}]


def appended_result(hf_tok: Any, first: list[dict[str, str]], result: str) -> list[int]:
    """What a tool result appends after the model's reply (its own tokens): the markup
    transformers' template puts between that reply and the result's turn, then the turn."""
    full = render(hf_tok, [*first, {"role": "assistant", "content": PLACEHOLDER},
                           {"role": "tool", "content": result}])
    before, after = full.split(PLACEHOLDER)
    assert before == render(hf_tok, first)
    return encode(hf_tok, after)


def call_turn(h, sid: str, appended: list[int], tools=("search", "fetch"), grammar=True) -> int:
    key = h.generate(appended, max_tokens=64, client=C, session=sid,
                     tools=list(tools) if tools else None,
                     grammar=GrammarSpec(kind="regex", text=CALL) if grammar else None)
    h.run()
    return key


def manager_of(h) -> SessionManager:
    m = h.sched.sessions.manager
    assert m is not None
    return m


def stats(h) -> StatsReply:
    h.send(EngineCommand(client=C, msg=GetStats(rid="st")))
    reply = h.replies.pop()
    assert isinstance(reply, StatsReply)
    return reply


def test_a_turn_ending_in_a_call_waits_on_that_tool(make_harness, grammars, hf_tok):
    h = make_harness(sessions=True, grammars=grammars)
    first = encode(hf_tok, render(hf_tok, FIRST))
    sid = open_session(h, first, retention="soft").session
    key = call_turn(h, sid, [])
    text = h.tokenizer.decode(h.output(key))
    assert text.startswith('{"name": "search"'), text
    listed = sessions_by_id(h)[sid]
    assert listed.tools == ["search"] and listed.tier == "device"
    assert stats(h).tool_waits == {"device": 1}
    m = manager_of(h)
    wait = m.records.sessions[sid].tool_wait
    assert wait is not None and wait.tools == ("search",)

    # The result comes: one round trip of "search", and the session waits on nothing.
    time.sleep(0.05)
    reply = h.output(key)
    h.generate(appended_result(hf_tok, FIRST, "found it"), max_tokens=4, client=C, session=sid)
    h.run()
    assert m.records.sessions[sid].tool_wait is None
    trip = stats(h).tool_round_trip_s["search"]
    assert 0.04 <= trip < 5.0, trip
    assert sessions_by_id(h)[sid].tools is None
    assert reply  # (the call's tokens stayed the history's)


def test_no_wait_without_tools_or_without_a_call(make_harness, grammars, hf_tok):
    h = make_harness(sessions=True, grammars=grammars)
    first = encode(hf_tok, render(hf_tok, FIRST))
    sid = open_session(h, first, retention="soft").session
    call_turn(h, sid, [], tools=None)  # a call's text, but the request carried no tools
    assert sessions_by_id(h)[sid].tools is None
    call_turn(h, sid, [], tools=("fetch",))  # a call of a tool it was not given
    assert sessions_by_id(h)[sid].tools is None
    key = call_turn(h, sid, [], tools=("search",), grammar=False)  # free text: no call
    assert not h.tokenizer.decode(h.output(key)).lstrip().startswith("{")
    assert sessions_by_id(h)[sid].tools is None


def demote_and_evict(h, sid: str) -> None:
    """Memory pressure: the session is demoted and everything evictable evicted (into the
    tiers that are on)."""
    m = manager_of(h)
    s = m.records.sessions[sid]
    m.retention.demote(s, reason="test pressure")
    h.sched.flush_cache()
    assert h.cache.cached_len(s.wanted, s.namespace) == 0


def check_next_turn(h, hf, hf_tok, sid: str, first: list[int], call: list[int]) -> Any:
    """The result's turn: HF's greedy continuation of the conversation as transformers
    renders it (the call as its own tokens); returns its final output."""
    appended = appended_result(hf_tok, FIRST, "the cache is in cache/")
    key = h.generate(appended, max_tokens=6, client=C, session=sid)
    h.run()
    assert h.output(key) == hf_greedy(hf, first + call + appended, 6)
    return h.final[(key, 0)]


def test_demoted_to_host_and_prefetched_on_the_hint_is_token_exact(make_harness, grammars,
                                                                     hf_tok, hf):
    h = make_harness(sessions=True, grammars=grammars,
                     engine_config=EngineConfig(host_kv_tokens=1024))
    first = encode(hf_tok, render(hf_tok, FIRST))
    sid = open_session(h, first, retention="soft").session
    call = h.output(call_turn(h, sid, []))
    m = manager_of(h)
    s = m.records.sessions[sid]
    demote_and_evict(h, sid)
    assert sessions_by_id(h)[sid].tier == "host"
    assert stats(h).tool_waits == {"host": 1}

    h.send(EngineCommand(client=C, msg=ToolDoneSoon(rid="soon", session=sid)))
    assert isinstance(h.replies.pop(), Ok)
    h.sched.maybe_tick()  # the loop's next pass brings it back
    assert h.cache.cached_len(s.wanted, s.namespace) == s.kv_len
    assert sessions_by_id(h)[sid].tier == "device"
    assert sessions_by_id(h)[sid].retention == "soft"  # held again
    final = check_next_turn(h, hf, hf_tok, sid, first, call)
    assert final.usage.cached_tokens == len(first) + len(call)  # all of it a device hit
    assert final.usage.recomputed_tokens == 0 and final.usage.restored_tokens == 0
    p = stats(h).prefetch
    assert p["hinted"] == 1 and p["started"] == 1 and p["hits"] == 1 and p["misses"] == 0


def test_without_a_hint_the_append_restores_it_token_exact(make_harness, grammars, hf_tok, hf):
    h = make_harness(sessions=True, grammars=grammars,
                     engine_config=EngineConfig(host_kv_tokens=1024))
    first = encode(hf_tok, render(hf_tok, FIRST))
    sid = open_session(h, first, retention="soft").session
    call = h.output(call_turn(h, sid, []))
    demote_and_evict(h, sid)
    final = check_next_turn(h, hf, hf_tok, sid, first, call)
    assert final.usage.restored_tokens == len(first) + len(call)
    assert final.usage.recomputed_tokens == 0
    assert stats(h).prefetch["misses"] == 1


def test_demoted_to_disk_and_prefetched_by_the_estimate_is_token_exact(
        make_harness, grammars, hf_tok, hf, tmp_path: Path):
    """No host tier: the waiting session's blocks go to disk as it is demoted (not
    dropped); its tool's estimate (round trips seen before) says the result is near, and
    the history is read back before it comes."""
    h = make_harness(sessions=True, grammars=grammars, capacity=2048)
    store = DiskKV(tmp_path / "kv", layout_of(h.pool), 64 * 2**20)
    m = SessionManager(h.cache, EngineConfig(), kv_pool=h.pool, disk=store)
    h.sched.sessions.manager = m
    try:
        first = encode(hf_tok, render(hf_tok, FIRST))
        sid = open_session(h, first, retention="soft").session
        s = m.records.sessions[sid]
        for trip in (0.2, 0.25, 0.15):  # round trips of "search" seen before: ~0.2 s
            m.tools.trips.observe("", "search", trip)
        call = h.output(call_turn(h, sid, []))
        assert store.num_blocks == 0  # (not durable: nothing saved after the turn)
        demote_and_evict(h, sid)
        assert store.flush()
        assert store.num_blocks == s.kv_len // 64
        assert sessions_by_id(h)[sid].tier == "disk"
        deadline = time.monotonic() + 10
        while h.cache.cached_len(s.wanted, s.namespace) < s.kv_len // 64 * 64:
            assert time.monotonic() < deadline, "the estimate's prefetch never came"
            h.sched.maybe_tick(time.monotonic() + 1.0)  # (ticks: not rate-limited here)
            time.sleep(0.01)
        assert m.tools.counts["started"] == 1
        final = check_next_turn(h, hf, hf_tok, sid, first, call)
        whole = (len(first) + len(call)) // 64 * 64
        assert final.usage.cached_tokens >= whole
        assert final.usage.recomputed_tokens == len(first) + len(call) - final.usage.cached_tokens
    finally:
        store.close()


def test_the_hint_for_an_unknown_or_busy_session(make_harness, grammars, hf_tok):
    h = make_harness(sessions=True, grammars=grammars)
    sid = open_session(h, encode(hf_tok, render(hf_tok, FIRST))).session
    h.send(EngineCommand(client=b"someone-else", msg=ToolDoneSoon(rid="x", session=sid)))
    refused = h.replies.pop()
    assert isinstance(refused, Error) and refused.code == ErrorCode.NOT_FOUND
    h.send(EngineCommand(client=C, msg=ToolDoneSoon(rid="y", session=sid)))
    assert isinstance(h.replies.pop(), Ok)  # waits on nothing: nothing to do
    assert stats(h).prefetch.get("hinted", 0) == 0


def test_a_fork_of_a_waiting_session_takes_its_wait(make_harness, grammars, hf_tok, hf):
    """(An HTTP continuation forks the held history a call ended.) The forks wait on the
    tool, the parent does not; the result's turn in a fork ends that fork's wait."""
    h = make_harness(sessions=True, grammars=grammars)
    first = encode(hf_tok, render(hf_tok, FIRST))
    sid = open_session(h, first, retention="soft").session
    call = h.output(call_turn(h, sid, []))
    h.send(EngineCommand(client=C, msg=ForkSession(rid="f", session=sid, n=2)))
    forked = h.replies.pop()
    assert isinstance(forked, SessionsForked)
    listing = sessions_by_id(h)
    assert listing[sid].tools is None
    assert [listing[f].tools for f in forked.sessions] == [["search"], ["search"]]
    final = check_next_turn(h, hf, hf_tok, forked.sessions[0], first, call)
    assert final.usage.cached_tokens == len(first) + len(call)
    assert sessions_by_id(h)[forked.sessions[0]].tools is None
    assert "search" in stats(h).tool_round_trip_s
