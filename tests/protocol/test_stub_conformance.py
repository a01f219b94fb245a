"""One protocol conformance suite, run against both the real engine (the shared tiny-model
server) and `radixlm.testing.StubServer`: the stub users test their programs against must
behave as the engine does wherever a client can tell.

The expectations come from the protocol's own rules (docs/protocol.md), not from either
implementation: turn N+1 finds all of turn N cached, a fork starts from its parent's
whole history, a session's length is its prompt plus its output, errors carry their
codes, a stream adds up to its ``done``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import radixlm as rl
from radixlm.runtime.protocol import MAX_FORK, MAX_N, MAX_TOP_LOGPROBS
from radixlm.testing import StubServer


@pytest.fixture(scope="module", params=["engine", "stub"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "stub":
        with StubServer() as stub:
            yield stub.endpoint
    else:
        yield request.getfixturevalue("server").endpoint


@pytest.fixture
def client(endpoint: str) -> Iterator[rl.Client]:
    with rl.connect(endpoint) as c:
        yield c
        assert c.list_sessions() == [], "the test left sessions open"


def usage(result: rl.GenerateResult) -> tuple[int, int, int]:
    m = result.meta_info
    return m["prompt_tokens"], m["cached_tokens"], m["completion_tokens"]


GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True}


def test_each_turn_finds_the_whole_history_cached(client: rl.Client) -> None:
    with client.session(system="You answer in one word.", **GREEDY) as chat:
        length = chat.length
        assert length > 0
        for question in ["Colour?", "Fruit?", "Animal?"]:
            result = chat.send(question, max_tokens=4)
            prompt, cached, completion = usage(result)
            assert cached == length  # the history, every token of it
            assert completion == 4 and result.finish_reason == "length"
            length = result.meta_info["session_length"]
            assert length == prompt + completion == chat.length


def test_an_appended_message_is_the_delta_of_the_full_render(client: rl.Client) -> None:
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "Hello there"}
    whole = client.tokenize(messages=[system, user], add_generation_prompt=True)
    opened = client.open_session(messages=[system])
    try:
        result = client.generate(messages=[user], session=opened.session, max_tokens=1)
        assert result.meta_info["prompt_tokens"] == len(whole)
        assert client.tokenize(messages=[system], add_generation_prompt=False) == whole[
            :opened.length]
    finally:
        client.close_session(opened.session)


def test_forks_start_from_the_whole_history(client: rl.Client) -> None:
    parent = client.open_session("Once upon a time")
    length = client.generate(" there", session=parent.session, max_tokens=3,
                             **GREEDY).meta_info["session_length"]
    forks = client.fork_session(parent.session, 3)
    try:
        assert len(set(forks)) == 3 and parent.session not in forks
        for i, sid in enumerate(forks):
            result = client.generate(f" {i}", session=sid, max_tokens=2, **GREEDY)
            # The whole history; later forks may also share a first appended token.
            assert usage(result)[1] == length if i == 0 else usage(result)[1] >= length
        lengths = {s["session"]: s["length"] for s in client.list_sessions()}
        assert lengths[parent.session] == length  # the parent is untouched
        assert all(lengths[sid] > length for sid in forks)
    finally:
        for sid in [*forks, parent.session]:
            client.close_session(sid)


def test_truncate_cuts_the_history(client: rl.Client) -> None:
    opened = client.open_session("A long enough history to cut")
    sid = opened.session
    try:
        cut = opened.length - 2
        client.truncate_session(sid, cut)
        prompt, cached, _ = usage(client.generate(input_ids=[client.tokenize("x")[-1]],
                                                  session=sid, max_tokens=1))
        assert (prompt, cached) == (cut + 1, cut)
        with pytest.raises(rl.InvalidParamsError):
            client.truncate_session(sid, cut + 100)
    finally:
        client.close_session(sid)


def test_unknown_and_closed_sessions_are_not_found(client: rl.Client) -> None:
    sid = client.open_session("hello").session
    client.close_session(sid)
    with pytest.raises(rl.NotFoundError):
        client.generate("again", session=sid, max_tokens=1)
    with pytest.raises(rl.NotFoundError):
        client.close_session(sid)
    with pytest.raises(rl.NotFoundError):
        client.fork_session("no-such-session", 1)


def test_pins(client: rl.Client) -> None:
    name = f"conformance-{uuid.uuid4().hex[:8]}"
    length = client.pin(name, "You are a tool-using assistant.")
    try:
        assert length == len(client.tokenize("You are a tool-using assistant."))
        with pytest.raises(rl.DuplicateIdError):
            client.pin(name, "again")
        opened = client.open_session(pin=name)
        assert opened.length == length
        result = client.generate(" Go.", session=opened.session, max_tokens=1)
        assert usage(result)[1] == length
        client.close_session(opened.session)
    finally:
        client.unpin(name)
    with pytest.raises(rl.NotFoundError):
        client.unpin(name)
    with pytest.raises(rl.NotFoundError):
        client.open_session(pin=name)


@pytest.mark.parametrize(("call", "error"), [
    (lambda c: c.generate("x", n=0, max_tokens=1), rl.InvalidParamsError),
    (lambda c: c.generate("x", n=MAX_N + 1, max_tokens=1), rl.InvalidParamsError),
    (lambda c: c.generate("x", max_tokens=1, top_p=0.0), rl.InvalidParamsError),
    (lambda c: c.generate("x", max_tokens=1, temperature=-1.0), rl.InvalidParamsError),
    (lambda c: c.generate("", max_tokens=1), rl.EmptyPromptError),
    (lambda c: c.generate("x", max_tokens=c.context_length), rl.TooLongError),
    (lambda c: c.generate("abc", max_tokens=1, prompt_logprobs_start=99), rl.InvalidParamsError),
    (lambda c: c.generate("x", max_tokens=1, top_logprobs=MAX_TOP_LOGPROBS + 1),
     rl.InvalidParamsError),
], ids=["n=0", "n>max", "top_p=0", "temperature<0", "empty", "too-long", "logprobs-start",
        "top_logprobs>max"])
def test_bad_requests_get_their_error_codes(client: rl.Client, call: Any, error: type) -> None:
    with pytest.raises(error):
        call(client)
    assert client.generate("still serving", max_tokens=1).meta_info["completion_tokens"] == 1


def test_fork_n_out_of_range_is_invalid(client: rl.Client) -> None:
    sid = client.open_session("fork me").session
    try:
        for n in (0, MAX_FORK + 1):
            with pytest.raises(rl.InvalidParamsError):
                client.fork_session(sid, n)
    finally:
        client.close_session(sid)


def test_a_stream_adds_up_to_its_done(client: rl.Client) -> None:
    with client.stream("Tell me a story", max_tokens=8, **GREEDY) as stream:
        deltas = list(stream)
    result = stream.result
    assert "".join(d.text for d in deltas) == result.text
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert usage(result)[2] == len(result.token_ids) == 8
    assert client.generate("Tell me a story", max_tokens=8, **GREEDY).text == result.text


def test_prompt_tokens_are_the_tokenized_prompt(client: rl.Client) -> None:
    ids = client.tokenize("Hello world, again")
    assert usage(client.generate("Hello world, again", max_tokens=1))[0] == len(ids)
    assert usage(client.generate(input_ids=ids, max_tokens=1))[0] == len(ids)
    result = client.generate(input_ids=ids, max_tokens=0, prompt_logprobs_start=0)
    assert len(result.prompt_logprobs) == len(ids) - 1  # the first token has no context
    assert all(lp <= 0 for lp in result.prompt_logprobs)


def test_prompt_logprobs_start_counts_in_the_input_up_to_its_length(client: rl.Client) -> None:
    """One rule with and without a session: 0 <= start <= the input's length (the length
    itself asks for no values), in the tokens the request appends."""
    ids = client.tokenize("Hello world, again")
    at_end = client.generate(input_ids=ids, max_tokens=1, prompt_logprobs_start=len(ids))
    assert at_end.prompt_logprobs == []
    with pytest.raises(rl.InvalidParamsError):
        client.generate(input_ids=ids, max_tokens=1, prompt_logprobs_start=len(ids) + 1)
    with pytest.raises(rl.InvalidParamsError):
        client.generate(input_ids=ids, max_tokens=1, prompt_logprobs_start=-1)
    sid = client.open_session("A history first.").session
    try:
        appended = client.tokenize(" and more")
        for start, values in ((0, len(appended)), (len(appended), 0)):
            result = client.generate(input_ids=appended, session=sid, max_tokens=0,
                                     prompt_logprobs_start=start)
            assert len(result.prompt_logprobs) == values
        with pytest.raises(rl.InvalidParamsError):
            client.generate(input_ids=appended, session=sid, max_tokens=0,
                            prompt_logprobs_start=len(appended) + 1)
    finally:
        client.close_session(sid)


def test_a_seed_repeats_and_branches_differ(client: rl.Client) -> None:
    options = {"max_tokens": 8, "temperature": 0.9, "ignore_eos": True}
    first = client.generate("Pick a word:", seed=7, **options)
    assert client.generate("Pick a word:", seed=7, **options).token_ids == first.token_ids
    branches = client.generate("Pick a word:", seed=7, n=3, **options)
    assert len({tuple(b.token_ids) for b in branches}) == 3
    assert [b.index for b in branches] == [0, 1, 2]


def test_flush_cache_drops_what_nothing_holds(client: rl.Client) -> None:
    prompt = f"A prompt only this test sends {uuid.uuid4().hex}"
    client.generate(prompt, max_tokens=1)
    assert usage(client.generate(prompt, max_tokens=1))[1] > 0
    client.flush_cache()
    assert usage(client.generate(prompt, max_tokens=1))[1] == 0


def test_list_sessions_shows_this_clients_sessions(client: rl.Client) -> None:
    a = client.open_session("first")
    b = client.open_session("second one")
    listed = {s["session"]: s for s in client.list_sessions()}
    assert set(listed) == {a.session, b.session}
    assert listed[a.session]["length"] == a.length and not listed[a.session]["busy"]
    for s in (a, b):
        client.close_session(s.session)
