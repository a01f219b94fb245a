"""A session turn reports Done with its last sampled token; that token's KV (the *tail*)
is computed one step later, and messages naming the session wait for it instead of
meeting `busy`, so the next turn still hits the whole history."""

from __future__ import annotations

import numpy as np
import scheduler_harness as harness
from radixlm.runtime import protocol
from radixlm.runtime.engine.wire import ClientGone, EngineAbort, EngineCommand
from radixlm.runtime.protocol import CloseSession, Error, ForkSession, Ok, SessionsForked
from scheduler_harness import hf_greedy, random_prompt, stop_inside

from tests.engine.test_sessions_in_scheduler import C, command, open_session, sessions_by_id

# The harness fixtures, by name.
hf, make_harness, tiny_dir = harness.hf, harness.make_harness, harness.tiny_dir
one_thread, scheduler_pool_integrity = harness.one_thread, harness.scheduler_pool_integrity


def start_turn(h, rng, history_len: int, appended_len: int,
               max_tokens: int) -> tuple[str, list[int], int]:
    """Open a session over `history_len` random tokens and send a greedy turn appending
    `appended_len` more: (session, its prompt, the turn's key)."""
    first = random_prompt(rng, history_len)
    sid = open_session(h, first).session
    appended = random_prompt(rng, appended_len)
    return sid, first + appended, h.generate(appended, max_tokens=max_tokens, client=C,
                                             session=sid)


def steps_until_final(h, key: int) -> int:
    steps = 0
    while (key, 0) not in h.final:
        assert h.step()
        steps += 1
    return steps


def test_done_comes_with_the_last_token_and_the_next_turn_waits_for_the_tail(make_harness, hf):
    rng = np.random.default_rng(40)
    h = make_harness(sessions=True)
    sid, prompt, key = start_turn(h, rng, 24, 5, max_tokens=3)
    # Prefill samples token 1, two decodes sample tokens 2 and 3: Done in that step.
    assert steps_until_final(h, key) == 3
    history = prompt + h.output(key)
    assert h.final[(key, 0)].session_length == len(history)
    assert h.sched.has_work()  # the tail row is still to run

    # The client answers at once: a fork, then the next turn. Both wait for the tail.
    h.send(EngineCommand(client=C, msg=ForkSession(rid="fork", session=sid)))
    nxt = random_prompt(rng, 4)
    key2 = h.generate(nxt, max_tokens=4, client=C, session=sid)
    assert h.replies == [], h.replies  # held: neither busy nor answered yet
    rows = []
    forward = h.sched.model.forward
    h.sched.model.forward = lambda batch: rows.append(len(batch.logits_indptr) and
                                                      batch.logits_indptr[-1]) or forward(batch)
    h.step()  # the tail: its token's KV, no logits
    h.sched.model.forward = forward
    assert rows == [0]
    forked = h.replies.pop()
    assert isinstance(forked, SessionsForked), forked
    h.run()
    final = h.final[(key2, 0)]
    assert final.usage.cached_tokens == len(history)  # the whole previous history hit
    assert h.output(key2) == hf_greedy(hf, history + nxt, 4)
    listed = sessions_by_id(h)
    assert listed[forked.sessions[0]].length == len(history)
    assert listed[sid].length == len(history) + 4 + 4
    assert not any(isinstance(r, Error) for r in h.replies)


def test_abort_of_a_held_turn_and_client_gone_during_a_tail(make_harness):
    rng = np.random.default_rng(41)
    h = make_harness(sessions=True)
    sid = open_session(h, random_prompt(rng, 12)).session
    key = h.generate(random_prompt(rng, 3), max_tokens=2, client=C, session=sid)
    steps_until_final(h, key)
    length = h.final[(key, 0)].session_length
    key2 = h.generate(random_prompt(rng, 3), max_tokens=5, client=C, session=sid)
    h.send(EngineAbort(key=key2))  # aborts the held turn: replayed after it, in order
    h.run()
    assert h.final[(key2, 0)].finish_reason == "abort"
    listed = sessions_by_id(h)[sid]
    assert listed.length == length and not listed.busy

    # A close naming a session in its tail (and an idle one) waits for that tail.
    h.send(EngineCommand(client=C, msg=ForkSession(rid="f2", session=sid)))
    forked = h.replies.pop().sessions[0]
    key5 = h.generate(random_prompt(rng, 3), max_tokens=2, client=C, session=sid)
    steps_until_final(h, key5)
    h.send(EngineCommand(client=C, msg=CloseSession(rid="both", sessions=[forked, sid])))
    assert h.replies == []  # held (a listing now would wait as well)
    h.run()
    assert isinstance(h.replies.pop(), Ok) and sessions_by_id(h) == {}
    sid = open_session(h, random_prompt(rng, 12)).session

    # A client that vanishes while its turn runs the tail: its held turn is dropped, its
    # sessions closed, nothing leaks (the harness checks the pool after every step).
    key3 = h.generate(random_prompt(rng, 3), max_tokens=2, client=C, session=sid)
    steps_until_final(h, key3)
    key4 = h.generate(random_prompt(rng, 3), max_tokens=2, client=C, session=sid)
    h.send(ClientGone(client=C))
    h.run()
    assert (key4, 0) not in h.final
    assert sessions_by_id(h) == {}
    h.check_quiescent()


def test_a_turn_ended_by_a_stop_string_keeps_exactly_its_kept_tokens(make_harness, hf):
    """The engine ends the turn at the stop string: its Done reports the kept tokens and
    the history holds exactly them, so the next turn hits all of it."""
    rng = np.random.default_rng(42)
    h = make_harness(sessions=True)
    first, appended = random_prompt(rng, 16), random_prompt(rng, 4)
    ref = hf_greedy(hf, first + appended, 24)
    stop, kept, _ = stop_inside(h.tokenizer, appended, ref, 3)
    sid = open_session(h, first).session
    key = h.generate(appended, client=C, session=sid, sampling=protocol.SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))
    h.run()
    final = h.final[(key, 0)]
    assert (final.finish_reason, final.matched_stop) == ("stop", stop)
    assert h.output(key) == ref[:kept] and final.usage.completion_tokens == kept
    history = first + appended + ref[:kept]
    assert final.session_length == len(history) == sessions_by_id(h)[sid].length
    nxt = random_prompt(rng, 3)
    key2 = h.generate(nxt, max_tokens=3, client=C, session=sid)
    h.run()
    assert h.final[(key2, 0)].usage.cached_tokens == len(history)
    assert h.output(key2) == hf_greedy(hf, history + nxt, 3)


def test_tokens_that_may_begin_a_stop_string_are_held_back(make_harness, hf):
    """Streamed outputs stop short of the stop string's start: no output carries a token
    past the kept ones, and the last output carries what was held back."""
    rng = np.random.default_rng(43)
    h = make_harness()
    prompt = random_prompt(rng, 12)
    ref = hf_greedy(hf, prompt, 20)
    stop, kept, _ = stop_inside(h.tokenizer, prompt, ref, 6, length=4)
    key = h.generate(prompt, sampling=protocol.SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))
    sent: list[int] = []
    while (key, 0) not in h.final:
        h.step()
        sent = h.tokens[(key, 0)]
        assert sent == ref[: len(sent)] and len(sent) <= kept
    assert sent == ref[:kept]
    h.run()


def test_a_listing_right_after_the_done_shows_the_turn(make_harness):
    """The client is told the turn is done one step before its tail ends: its session
    listing waits for that step, so it never shows the old length; another client's
    listing does not wait."""
    h = make_harness(sessions=True)
    sid, prompt, key = start_turn(h, np.random.default_rng(44), 10, 3, max_tokens=4)
    steps_until_final(h, key)
    history = prompt + h.output(key)
    assert h.sched.has_work()  # the tail is still to run
    h.send(EngineCommand(client=b"someone-else", msg=protocol.ListSessions(rid="other")))
    assert h.replies.pop().sessions == []  # answered at once
    h.send(EngineCommand(client=C, msg=protocol.ListSessions(rid="mine")))
    assert h.replies == []  # held for the tail
    h.run()
    listed = h.replies.pop()
    assert isinstance(listed, protocol.SessionList) and listed.sessions[0].length == len(history)
    assert not listed.sessions[0].busy


def test_a_client_gone_during_its_tail_keeps_a_durable_turn(make_harness, tmp_path):
    """The Done of a durable session's turn went out; the client disconnects before the
    tail row runs. The turn it was told about stands: another connection of the tenant
    resumes the session at the length that Done reported (it was lost before)."""
    from radixlm.runtime.protocol import ResumeSession, SessionOpened

    rng = np.random.default_rng(43)
    h = make_harness(sessions=True, state_dir=tmp_path)
    sid = open_session(h, random_prompt(rng, 12), durable=True).session
    key = h.generate(random_prompt(rng, 3), max_tokens=3, client=C, session=sid)
    steps_until_final(h, key)
    length = h.final[(key, 0)].session_length
    assert h.sched.has_work()  # the tail is still to run
    h.send(ClientGone(client=C))
    h.run()
    back = command(h, ResumeSession(rid="r", session=sid), client=b"another")
    assert isinstance(back, SessionOpened) and back.length == length, back
    h.send(EngineCommand(client=b"another", msg=CloseSession(rid="c", session=sid)))
