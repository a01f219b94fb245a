"""The scheduler's session and pin glue: turns hit their history, n > 1 turns branch into
new sessions, pins are prefilled once, and retained KV never deadlocks the pool."""

from __future__ import annotations

import numpy as np
import scheduler_harness as harness
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.wire import (
    AppendVariants,
    ClientGone,
    EngineAbort,
    EngineCommand,
    EngineOpenSession,
    EnginePin,
    Variant,
)
from radixlm.runtime.protocol import (
    CloseSession,
    Error,
    ErrorCode,
    FlushCache,
    ForkSession,
    GetStats,
    ListSessions,
    Ok,
    Pinned,
    SamplingParams,
    SessionList,
    SessionOpened,
    SessionsForked,
    StatsReply,
    TruncateSession,
)
from scheduler_harness import hf_greedy, random_prompt

# The harness fixtures, by name.
hf, make_harness, tiny_dir = harness.hf, harness.make_harness, harness.tiny_dir
one_thread, scheduler_pool_integrity = harness.one_thread, harness.scheduler_pool_integrity


C = b"client-1"


def open_session(h, input_ids, **kw) -> SessionOpened:
    h.send(EngineOpenSession(client=C, rid="open", input_ids=list(input_ids), **kw))
    h.run()
    reply = h.replies.pop()
    assert isinstance(reply, SessionOpened), reply
    return reply


def command(h, msg, client=C):
    h.send(EngineCommand(client=client, msg=msg))
    return h.replies.pop()


def sessions_by_id(h) -> dict:
    reply = command(h, ListSessions(rid="ls"))
    assert isinstance(reply, SessionList)
    return {s.session: s for s in reply.sessions}


def test_turns_hit_their_history_and_match_hf(make_harness, hf):
    rng = np.random.default_rng(20)
    h = make_harness(sessions=True)
    first = random_prompt(rng, 30)
    opened = open_session(h, first)
    assert opened.length == 30
    sid = opened.session

    history = list(first)
    for _ in range(2):
        appended = random_prompt(rng, 6)
        key = h.generate(appended, max_tokens=5, client=C, session=sid)
        h.run()
        out = h.output(key)
        assert out == hf_greedy(hf, history + appended, 5)
        final = h.final[(key, 0)]
        assert final.session == sid
        # Every turn hits the whole previous history, the previous output included (its
        # last sampled token was run through the model before that turn ended).
        assert final.usage.cached_tokens == len(history)
        assert final.usage.prompt_tokens == len(history) + len(appended)
        history += appended + out
        assert final.session_length == len(history)
    assert sessions_by_id(h)[sid].length == len(history)


def test_busy_abort_and_unknown_sessions(make_harness):
    rng = np.random.default_rng(21)
    h = make_harness(sessions=True)
    sid = open_session(h, random_prompt(rng, 10)).session
    running = h.generate(random_prompt(rng, 4), max_tokens=20, client=C, session=sid)
    h.step()
    h.generate(random_prompt(rng, 4), client=C, session=sid)
    h.generate(random_prompt(rng, 4), client=b"someone-else", session=sid)
    codes = [r.code for r in h.replies if isinstance(r, Error)]
    assert codes == [ErrorCode.BUSY, ErrorCode.NOT_FOUND]
    h.send(EngineAbort(key=running))
    assert h.final[(running, 0)].finish_reason == "abort"
    assert sessions_by_id(h)[sid].length == 10  # an aborted turn leaves the history as it was
    assert not sessions_by_id(h)[sid].busy


def test_n_branches_continue_in_new_sessions(make_harness, hf):
    rng = np.random.default_rng(22)
    h = make_harness(sessions=True)
    base = random_prompt(rng, 20)
    sid = open_session(h, base).session
    appended = random_prompt(rng, 5)
    key = h.generate(appended, n=2, client=C, session=sid,
                     sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    h.run()
    prompt = base + appended
    branches = [h.final[(key, i)] for i in range(2)]
    listed = sessions_by_id(h)
    assert listed[sid].length == len(prompt)  # the turn's own session grows by the input
    for i, b in enumerate(branches):
        assert h.output(key, i) == hf_greedy(hf, prompt, 4)
        assert b.session not in (None, sid)
        assert b.session_length == len(prompt) + 4
        assert listed[b.session].length == len(prompt) + 4
    assert branches[0].session != branches[1].session


def test_pin_then_open_from_it(make_harness, hf):
    rng = np.random.default_rng(23)
    h = make_harness(sessions=True, page_size=4)
    system = random_prompt(rng, 26)
    h.send(EnginePin(client=C, rid="pin", name="sys", input_ids=system))
    h.run()
    reply = h.replies.pop()
    assert isinstance(reply, Pinned) and reply.length == 26
    h.send(EnginePin(client=C, rid="pin2", name="sys", input_ids=system))
    assert h.replies.pop().code == ErrorCode.DUPLICATE_ID
    opened = open_session(h, [], pinned="sys")
    assert opened.length == 26
    appended = random_prompt(rng, 5)
    key = h.generate(appended, max_tokens=3, client=C, session=opened.session)
    h.run()
    assert h.output(key) == hf_greedy(hf, system + appended, 3)
    assert h.final[(key, 0)].usage.cached_tokens == 24  # the pin's whole pages
    stats = command(h, GetStats(rid="s"))
    assert isinstance(stats, StatsReply) and stats.invariant_ok
    assert (stats.pins, stats.sessions, stats.running) == (1, 1, 0)
    assert stats.retained_tokens["pinned"] == 24


def test_commands_fork_truncate_close_flush(make_harness):
    rng = np.random.default_rng(24)
    h = make_harness(sessions=True)
    sid = open_session(h, random_prompt(rng, 12)).session
    forked = command(h, ForkSession(rid="f", session=sid, n=2))
    assert isinstance(forked, SessionsForked) and len(forked.sessions) == 2
    assert isinstance(command(h, TruncateSession(rid="t", session=forked.sessions[0], length=5)),
                      Ok)
    assert sessions_by_id(h)[forked.sessions[0]].length == 5
    assert command(h, CloseSession(rid="c", session="missing")).code == ErrorCode.NOT_FOUND
    for s in [sid, *forked.sessions]:
        assert isinstance(command(h, CloseSession(rid="c", session=s)), Ok)
    assert isinstance(command(h, FlushCache(rid="x")), Ok)
    assert h.cache.sizes().evictable == 0 and h.cache.sizes().protected == 0


def test_one_close_names_several_sessions(make_harness):
    rng = np.random.default_rng(25)
    h = make_harness(sessions=True)
    sid = open_session(h, random_prompt(rng, 12)).session
    a, b, c = command(h, ForkSession(rid="f", session=sid, n=3)).sessions
    assert isinstance(command(h, CloseSession(rid="c1", session=a, sessions=[b])), Ok)
    # Partly refused: the known ones close anyway, the error names what stays open.
    reply = command(h, CloseSession(rid="c2", sessions=[c, "missing", sid]))
    assert isinstance(reply, Error) and reply.code == ErrorCode.NOT_FOUND
    assert "missing" in reply.message and "1 of 3" in reply.message
    assert sessions_by_id(h) == {}
    # (a close naming nothing is the frontend's to refuse: server/test_bad_input_errors.py)
    assert h.cache.sizes().protected == 0


def test_retained_sessions_never_deadlock_the_pool(make_harness, hf):
    rng = np.random.default_rng(25)
    cfg = EngineConfig(retained_cap=200)
    h = make_harness(sessions=True, capacity=256, engine_config=cfg)
    hard = open_session(h, random_prompt(rng, 100), retention="hard").session
    soft = open_session(h, random_prompt(rng, 90), retention="soft").session
    # Cannot fit beside the hard session's 100 tokens: refused up front.
    h.generate(random_prompt(rng, 120), max_tokens=60)
    assert h.replies.pop().code == ErrorCode.CAPACITY
    # Fits only once the idle soft session is demoted (make_room) and its KV evicted.
    p = random_prompt(rng, 100)
    key = h.generate(p, max_tokens=40)
    h.run()
    assert h.output(key) == hf_greedy(hf, p, 40)
    listed = sessions_by_id(h)
    assert listed[soft].retention == "demoted" and listed[hard].retention == "hard"


def test_client_gone_aborts_requests_and_closes_sessions(make_harness):
    rng = np.random.default_rng(26)
    h = make_harness(sessions=True)
    sid = open_session(h, random_prompt(rng, 10)).session
    key = h.generate(random_prompt(rng, 5), max_tokens=30, client=C, session=sid)
    other = h.generate(random_prompt(rng, 5), max_tokens=3, client=b"other")
    h.step()
    h.send(ClientGone(client=C))
    assert h.final[(key, 0)].finish_reason == "abort"
    h.run()
    assert len(h.output(other)) == 3
    assert sessions_by_id(h) == {}
    assert h.cache.sizes().protected == 0


def _fork_run(make_harness, prompt, seed: int) -> list[list[int]]:
    """Open a session, fork it 3 ways and run one seeded sampled turn on each fork."""
    h = make_harness(sessions=True)
    sid = open_session(h, prompt).session
    forks = command(h, ForkSession(rid="f", session=sid, n=3)).sessions
    sampling = SamplingParams(max_tokens=8, temperature=0.7, seed=seed, ignore_eos=True)
    keys = [h.generate([5, 6], sampling=sampling, session=f, client=C) for f in forks]
    h.run()
    assert not h.replies, h.replies  # no errors
    return [h.output(k) for k in keys]


def test_forks_given_one_seed_sample_distinct_reproducible_branches(make_harness):
    rng = np.random.default_rng(27)
    prompt = random_prompt(rng, 12)
    outputs = _fork_run(make_harness, prompt, seed=0)
    # Like the branches of one n > 1 request, sibling forks draw their own streams...
    assert len({tuple(o) for o in outputs}) == 3, outputs
    # ... and the same program with the same seed samples the same again.
    assert _fork_run(make_harness, prompt, seed=0) == outputs
    # A session opened directly keeps the plain meaning of its seed: its turn samples
    # what a sessionless request over the same tokens does.
    h = make_harness(sessions=True)
    sid = open_session(h, prompt).session
    sampling = SamplingParams(max_tokens=8, temperature=0.7, seed=0, ignore_eos=True)
    in_session = h.generate([5, 6], sampling=sampling, session=sid, client=C)
    plain = h.generate([*prompt, 5, 6], sampling=sampling)
    h.run()
    assert h.output(in_session) == h.output(plain)


def test_the_engine_picks_the_rendering_for_how_each_history_ends(make_harness):
    """An append arrives rendered for every end a history may have; the engine, which
    holds the history, picks: an empty one takes the full render, an open assistant turn
    its closing markup (without the end token when the history already ends with it), a
    closed one the plain delta. Raw ids keep the turn open; forks inherit the flag; a
    truncate closes it."""
    rng = np.random.default_rng(28)
    h = make_harness(sessions=True)
    body = [7, 8]

    def history(session: str) -> list[int]:
        return h.sched.sessions.manager.get(session, C).history.tolist()

    def append(session: str, after: dict[int, Variant] | None = None, **kw) -> list[int]:
        before = history(session)
        variants = AppendVariants(if_empty=Variant(ids=[3]), if_open=Variant(ids=[4]),
                                  if_open_after=after)
        h.generate(body, max_tokens=1, client=C, session=session, variants=variants, **kw)
        h.run()
        return history(session)[len(before):]

    empty = open_session(h, []).session
    assert append(empty)[:3] == [3, *body]  # the full render's prefix: BOS, system prompt
    closed = open_session(h, random_prompt(rng, 10)).session
    assert append(closed, assistant_open=True)[:2] == body  # then the turn is left open
    last = history(closed)[-1]
    assert append(closed, {last + 1: Variant(ids=[5])})[:3] == [4, *body]
    last = history(closed)[-1]
    assert append(closed, {last: Variant(ids=[5])})[:3] == [5, *body]
    h.generate([9], max_tokens=1, client=C, session=closed)  # raw ids: still open
    h.run()
    a, b = command(h, ForkSession(rid="f", session=closed, n=2)).sessions
    assert append(a)[:3] == [4, *body]
    assert isinstance(command(h, TruncateSession(rid="t", session=b, length=5)), Ok)
    assert append(b)[:2] == body
    whole = AppendVariants(if_open=Variant(ids=[6, 6], whole=True))
    h.generate(body, max_tokens=1, client=C, session=a, variants=whole)
    h.run()
    assert history(a)[-3:-1] == [6, 6]
    # A rendering the template could not make is refused when it is the one needed.
    h.generate(body, max_tokens=1, client=C, session=empty,
               variants=AppendVariants(if_empty=Variant(ids=[3]), closed_error="no append"))
    h.generate([1], max_tokens=1, client=C, session=open_session(h, []).session,
               variants=AppendVariants(empty_error="chat template: cannot start"))
    h.run()
    refusals = [r for r in h.replies if isinstance(r, Error)]
    assert [(r.code, r.message) for r in refusals] == [
        (ErrorCode.INVALID_PARAMS, "no append"),
        (ErrorCode.INVALID_PARAMS, "chat template: cannot start")]
