"""Programs (``@rl.function``) against the protocol stub: what goes on the wire (deltas,
forks, n-branch generations), what comes back (fork/join, select, streaming), session
hygiene (closed at the end, on errors and on cancellation) and concurrency.

Expected outputs are recomputed from the stub's toy model (`toy_generate`, `toy_logprob`)
on the token sequence the program should have built, independently of the SDK.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import anyio
import pytest
import radixlm as rl
from radixlm.runtime.protocol import CloseSession, ForkSession, Generate, Message, OpenSession
from radixlm.testing import IM_END, StubServer, render_chatml, toy_logprob
from toy_stub import chars, text_of, toy_generate

pytest_plugins = ["toy_stub"]  # its fixtures: stub, client


def sent(stub: StubServer, kind: type, since: int = 0) -> list:
    return stub.received_of(kind)[since:]


def closed_ids(stub: StubServer, since: int = 0) -> list[str]:
    """Every session id the client closed (closes deferred together leave as one)."""
    return [sid for m in sent(stub, CloseSession, since) for sid in m.ids()]


def test_turns_send_only_their_delta_and_hit_the_previous_turn(client, stub) -> None:
    @rl.function
    def chat(s, questions):
        s += rl.system("You are terse.")
        for i, q in enumerate(questions):
            s += rl.user(q)
            s += rl.assistant(rl.gen(f"a{i}", max_tokens=6, ignore_eos=True))

    start = len(stub.received)
    state = chat.run(questions=["one", "two", "three", "four", "five"], backend=client)
    generates = sent(stub, Generate, len([m for m in stub.received[:start]
                                          if isinstance(m, Generate)]))
    assert len(generates) == 5 and len(sent(stub, OpenSession)) >= 1
    # Turn 1 carries the system and user messages; every later turn only its user message.
    assert [m.role for m in generates[0].input.messages] == ["system", "user"]
    for g, q in zip(generates[1:], ["two", "three", "four", "five"], strict=True):
        assert [(m.role, m.content) for m in g.input.messages] == [("user", q)]
        assert g.input.add_generation_prompt and g.session == generates[0].session
    # Each turn's cached tokens are the whole history the previous turn left.
    metas = [state.get_meta_info(f"a{i}") for i in range(5)]
    for before, after in zip(metas, metas[1:], strict=False):
        assert after["cached_tokens"] == before["session_length"]
    # The reference: the full conversation, re-rendered from scratch, generated turn by turn.
    history = chars(render_chatml([Message(role="system", content="You are terse.")], False))
    for i, q in enumerate(["one", "two", "three", "four", "five"]):
        prefix = f"{IM_END}\n" if i else ""
        history += chars(prefix + render_chatml([Message(role="user", content=q)], True))
        out = toy_generate(history, 6, ignore_eos=True)
        assert state[f"a{i}"] == text_of(out)
        history += out
    assert [m["role"] for m in state.messages()] == ["system"] + ["user", "assistant"] * 5


def test_text_and_messages_open_the_session_in_pieces_and_the_gen_carries_the_last(
        client, stub) -> None:
    """The delta of a first turn mixing plain text and messages: the session opens with
    the first piece, each piece of another kind is appended once (messages in a row as
    one), and the gen's request carries the assistant turn's own text."""
    @rl.function
    def mixed(s):
        s += "Intro. "
        s += rl.system("Be brief.")
        s += rl.user("Hi?")
        s += rl.assistant("Sure: " + rl.gen("a", max_tokens=5, ignore_eos=True))
        s += rl.user("More?")

    opens, gens = len(sent(stub, OpenSession)), len(sent(stub, Generate))
    state = mixed.run(backend=client)
    [opened] = sent(stub, OpenSession, opens)
    assert opened.input.text == "Intro. " and opened.input.messages is None
    append, turn = sent(stub, Generate, gens)
    assert append.sampling.max_tokens == 0 and append.input.add_generation_prompt
    assert [(m.role, m.content) for m in append.input.messages] == [
        ("system", "Be brief."), ("user", "Hi?")]
    assert turn.input.text == "Sure: " and turn.session == append.session
    messages = [Message(role="system", content="Be brief."), Message(role="user", content="Hi?")]
    history = chars("Intro. " + render_chatml(messages, True) + "Sure: ")
    answer = text_of(toy_generate(history, 5, ignore_eos=True))
    assert state["a"] == answer
    assert state.text() == "Intro. Be brief.Hi?Sure: " + answer + "More?"
    assert state.messages() == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi?"},
                                {"role": "assistant", "content": "Sure: " + answer},
                                {"role": "user", "content": "More?"}]


def test_fork_join_gathers_each_branch(client, stub) -> None:
    @rl.function
    def branches(s):
        s += "Question: pick a color."
        forks = s.fork(3)
        forks += lambda i: f" Option {i}:" + rl.gen("color", max_tokens=5, ignore_eos=True)
        forks.join()
        s += " Done."

    before = len(sent(stub, ForkSession))
    state = branches.run(backend=client)
    assert len(sent(stub, ForkSession, before)) == 1
    expected = [text_of(toy_generate(chars(f"Question: pick a color. Option {i}:"), 5,
                                      ignore_eos=True)) for i in range(3)]
    assert state["color"] == expected
    assert state.text() == "Question: pick a color. Done."
    # Every fork starts from the shared prefix, held by the engine (never re-sent).
    assert all(m["cached_tokens"] >= len("Question: pick a color.")
               for m in state.get_meta_info("color"))


def test_nested_forks_and_concat_join(client) -> None:
    @rl.function
    def tree(s):
        s += "Root"
        level1 = s.fork(2)
        level1 += lambda i: f"/{i}"
        for child in level1:
            level2 = child.fork(2)
            level2 += lambda j: f"/{j}" + rl.gen("leaf", max_tokens=2, ignore_eos=True)
            level2.join()
        level1.join(mode="concate_and_append")
        return level1

    state = tree.run(backend=client)
    assert state.text() == "Root/0/1"  # the level-1 forks' own text, appended in order
    for i, child in enumerate(state.ret_value):
        leaves = [text_of(toy_generate(chars(f"Root/{i}/{j}"), 2, ignore_eos=True))
                  for j in range(2)]
        assert child["leaf"] == leaves


def test_a_state_done_after_its_fork_hands_its_session_over(client, stub) -> None:
    def two_leaves(s):
        s += "Root"
        forks = s.fork(2)
        forks += lambda i: f"/{i}" + rl.gen("leaf", max_tokens=3, ignore_eos=True)
        return forks

    @rl.function
    def tree(s):
        return two_leaves(s)  # the root does nothing more: its session goes to a fork

    @rl.function
    def judge(s):
        two_leaves(s).join()
        s += rl.gen("after", max_tokens=2, ignore_eos=True)  # the root goes on: no hand-over

    leaves = [text_of(toy_generate(chars(f"Root/{i}"), 3, ignore_eos=True)) for i in (0, 1)]
    for program, forked in ((tree, 1), (judge, 2)):
        opened, forks = len(sent(stub, OpenSession)), len(sent(stub, ForkSession))
        closes = len(sent(stub, CloseSession))
        state = program.run(backend=client)
        assert [m.n for m in sent(stub, ForkSession, forks)] == [forked]
        client.stats()  # after every close the program sent
        made = len(sent(stub, OpenSession, opened)) + forked
        closed = closed_ids(stub, closes)
        assert len(closed) == len(set(closed)) == made  # each session closed once
        if program is tree:
            assert [child["leaf"] for child in state.ret_value] == leaves
        else:
            assert state["leaf"] == leaves


@pytest.mark.parametrize("method", ["token_length_normalized", "sum", "greedy"])
def test_select_picks_the_argmax_of_choice_logprobs(client, stub, method) -> None:
    prompt = "The answer is"
    choices = [" yes", " no", " maybe not", " perhaps"]

    @rl.function
    def pick(s):
        s += prompt
        s += rl.select("choice", choices=choices, choices_method=method)
        s += rl.gen("after", max_tokens=3, ignore_eos=True)

    state = pick.run(backend=client)
    rows = []
    for c in choices:  # independently: logprob of each choice token after the prompt
        ids = chars(prompt + c)
        rows.append([toy_logprob(ids[:i], ids[i]) for i in range(len(prompt), len(ids))])
    if method == "token_length_normalized":
        best = max(range(4), key=lambda i: sum(rows[i]) / len(rows[i]))
    elif method == "sum":
        best = max(range(4), key=lambda i: sum(rows[i]))
    else:  # first token decides unless tied
        best = max(range(4), key=lambda i: rows[i][0])
    assert state["choice"] == choices[best]
    meta = state.get_meta_info("choice")
    assert [round(x, 6) for x in meta["normalized_prompt_logprobs"]] == [
        round(sum(r) / len(r), 6) for r in rows]
    # The state continues in the chosen branch: the gen follows the chosen text.
    assert state["after"] == text_of(toy_generate(chars(prompt + choices[best]), 3,
                                                  ignore_eos=True))
    assert not math.isnan(meta["scores"][0])


def test_gen_n_prefills_once_and_continues_with_the_first(client, stub) -> None:
    @rl.function
    def sample(s):
        s += "Name a fruit:"
        s += rl.gen("fruit", n=4, max_tokens=4, temperature=0.8, ignore_eos=True)
        s += rl.gen("more", max_tokens=2, ignore_eos=True)

    before = len(sent(stub, Generate))
    computed_before = stub.prompt_tokens_total - stub.cached_tokens_total
    state = sample.run(backend=client)
    generates = sent(stub, Generate, before)
    assert [g.n for g in generates] == [4, 1]
    fruits = state["fruit"]
    assert isinstance(fruits, list) and len(fruits) == 4 and len(set(fruits)) > 1
    assert state.text() == "Name a fruit:" + fruits[0] + state["more"]
    # The n=4 request computed its prompt once (not 4 times); the follow-up continues in
    # branch 0's session, whose history (prompt + output) the stub's cache already holds.
    computed = stub.prompt_tokens_total - stub.cached_tokens_total - computed_before
    assert computed == len("Name a fruit:")


@pytest.fixture(scope="module")
def paced_stub() -> Iterator[StubServer]:
    """Generates a token every 5 ms, so streamed text arrives in several pieces."""
    with StubServer(token_delay_s=0.005) as server:
        yield server


def test_streamed_text_equals_the_finished_text(paced_stub) -> None:
    @rl.function
    def story(s):
        s += "Once"
        s += rl.gen("story", max_tokens=30, ignore_eos=True)

    with rl.connect(paced_stub.endpoint) as client:
        streamed = story.run(backend=client, stream=True)
        pieces = list(streamed.text_iter("story"))
        assert len(pieces) > 1
        assert "".join(pieces) == streamed["story"] == story.run(backend=client)["story"]
        assert "".join(story.run(backend=client, stream=True).text_iter()) == streamed.text()

        async def collect(state: rl.ProgramState) -> str:  # from another event loop
            return "".join([piece async for piece in state.text_async_iter("story")])

        assert anyio.run(collect, story.run(backend=client, stream=True)) == streamed["story"]


def test_run_batch_runs_programs_concurrently() -> None:
    with StubServer(token_delay_s=0.01) as stub, rl.connect(stub.endpoint) as client:
        @rl.function
        def classify(s, text):
            s += f"Text: {text}\nLabel:"
            s += rl.select("label", choices=[" good", " bad"])
            s += rl.gen("why", max_tokens=5, ignore_eos=True)

        items = [{"text": f"item {i}"} for i in range(8)]
        states = classify.run_batch(items, backend=client, max_concurrency=4)
        assert client.aclient.peak_generating > 1 and stub.max_running > 1
        for item, state in zip(items, states, strict=True):
            ids = chars(f"Text: {item['text']}\nLabel:" + state["label"])
            assert state["why"] == text_of(toy_generate(ids, 5, ignore_eos=True))
        assert client.stats()["sessions"] == 0


def test_cancelling_a_program_aborts_and_closes_its_sessions() -> None:
    with StubServer(token_delay_s=0.02) as stub:
        @rl.function
        def long(s):
            s += "Go"
            forks = s.fork(3)
            forks += rl.gen("x", max_tokens=1000, ignore_eos=True)
            forks.join()

        async def main() -> None:
            async with rl.AsyncClient(stub.endpoint) as client:
                with anyio.move_on_after(0.3) as scope:
                    await long.arun(backend=client)
                assert scope.cancelled_caught
                stats = await client.stats()
                assert stats["sessions"] == 0 and stats["running"] == 0
        anyio.run(main)
        # Every session the program made (opened, or forked) was closed, once.
        made = len(sent(stub, OpenSession)) + sum(m.n for m in sent(stub, ForkSession))
        closed = closed_ids(stub)
        assert made >= 3 and len(closed) == len(set(closed)) == made


def test_engine_errors_surface_typed_and_leave_nothing_open(client, stub) -> None:
    @rl.function
    def bad(s):
        s += "x"
        s += rl.gen("y", max_tokens=2, top_p=0.0)

    with pytest.raises(rl.InvalidParamsError):
        bad.run(backend=client)
    states = bad.run_batch([{}, {}], backend=client)
    assert all(isinstance(s.error(), rl.InvalidParamsError) for s in states)
    with pytest.raises(rl.InvalidParamsError):
        states[0]["y"]

    @rl.function
    def raises(s):
        s += "x" + rl.gen("y", max_tokens=3)
        raise KeyError("from the body")

    before = len(stub.received)
    with pytest.raises(KeyError):
        raises.run(backend=client)
    # A body that raised runs none of its ops.
    assert not [m for m in stub.received[before:] if isinstance(m, (Generate, OpenSession))]

    @rl.function
    def gen_in_user(s):
        s += rl.user(rl.gen("q", max_tokens=3))

    with pytest.raises(rl.ProgramError, match="inside rl.user"):
        gen_in_user.run(backend=client)


def test_async_programs_and_sglang_spellings(paced_stub) -> None:
    stub = paced_stub
    @rl.function
    async def agent(s, goal):
        s += f"Goal: {goal}\n"
        for step in range(3):
            s += f"Step {step}:" + rl.gen("step", max_tokens=3, ignore_eos=True) + "\n"
            if (await s.aget("step")) == "never":
                break
        return step

    @rl.function()
    def sub(s):
        s += rl.gen("inner", choices=[" a", " b"])  # gen(choices=...) is select

    @rl.function
    def outer(s):
        s += "Pick:"
        sub(s)  # a program called with a state runs inline
        with s.copy() as c:
            c += rl.gen("copied", max_tokens=2, ignore_eos=True)

    @rl.function
    def story(s):
        s += "Once" + rl.gen("story", max_tokens=12, ignore_eos=True)

    async def main() -> None:
        async with rl.AsyncClient(stub.endpoint) as client:
            state = await agent.arun(goal="test", backend=client)
            assert state.ret_value == 2
            states = await agent.arun_batch([{"goal": "a"}, {"goal": "b"}], backend=client)
            assert [s.ret_value for s in states] == [2, 2]
            out = await outer.arun(backend=client)
            assert out["inner"] in (" a", " b")
            assert len(out["copied"]) == 1
            async with story.astream(backend=client) as live:
                pieces = [p async for p in live.text_async_iter("story")]
            assert len(pieces) > 1 and "".join(pieces) == live["story"]
            assert live["story"] == text_of(toy_generate(chars("Once"), 12, ignore_eos=True))
            assert (await client.stats())["sessions"] == 0

    anyio.run(main)


def test_default_backend_and_sync_async_bridge(stub) -> None:
    @rl.function
    def hello(s):
        s += "Hi" + rl.gen("x", max_tokens=2, ignore_eos=True)

    with rl.connect(stub.endpoint) as client:
        rl.set_default_backend(client)
        try:
            assert hello.run()["x"] == hello(backend=client)["x"]
            state = anyio.run(hello.arun)  # a sync client's program awaited from another loop
            assert state["x"] == text_of(toy_generate(chars("Hi"), 2, ignore_eos=True))
        finally:
            rl.set_default_backend(None)
    with pytest.raises(rl.ProgramError, match="no backend"):
        hello.run()


def test_a_sync_body_reading_mid_way(client) -> None:
    @rl.function
    def agent(s):
        s += "Goal:"
        for i in range(3):
            s += f" step{i}" + rl.gen("x", max_tokens=3, ignore_eos=True)
            if s["x"] == "never":  # waits for the gen; the supervisor started at this read
                break
        forks = s.fork(2)
        forks += rl.gen("y", max_tokens=2, ignore_eos=True)
        forks.join()
        return s["y"]

    text = "Goal:"
    for i in range(3):
        text += f" step{i}"
        text += text_of(toy_generate(chars(text), 3, ignore_eos=True))
    y = text_of(toy_generate(chars(text), 2, ignore_eos=True))
    for stream in (False, True):
        state = agent.run(backend=client, stream=stream)
        assert state.text() == text and state.ret_value == [y, y]
