"""SGLang habits the SDK accepts (against the protocol stub): ``gen(max_new_tokens=)``,
``choices_method="sum_logprobs"``, ``rl.flush_cache``, a misspelt ``run`` keyword named
as the SDK's error, seeded forks that sample like ``n > 1`` branches, and the chat REPL's
``/help``. Expected outputs are recomputed from the stub's toy model."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from functools import partial

import anyio
import pytest
import radixlm as rl
from radixlm.runtime.protocol import Generate
from radixlm.sdk import repl
from radixlm.testing import toy_logprob
from toy_stub import chars, text_of, toy_generate

pytest_plugins = ["toy_stub"]  # its fixtures: stub, client


def test_gen_takes_max_new_tokens_as_max_tokens(client, stub) -> None:
    @rl.function
    def short(s):
        s += "Count:" + rl.gen("a", max_new_tokens=3, ignore_eos=True)

    before = len(stub.received_of(Generate))
    state = short.run(backend=client, temperature=0)
    assert stub.received_of(Generate)[before].sampling.max_tokens == 3
    assert state["a"] == text_of(toy_generate(chars("Count:"), 3, ignore_eos=True, shift=0))
    assert rl.gen("a", max_tokens=5, max_new_tokens=5) == rl.gen("a", max_tokens=5)
    with pytest.raises(ValueError, match="one option"):
        rl.gen("a", max_tokens=4, max_new_tokens=5)
    with pytest.raises(TypeError, match=r"'max_new_token' \(did you mean 'max_new_tokens'\?\)"):
        rl.gen("a", max_new_token=4)


@pytest.mark.parametrize("method", ["sum_logprobs", rl.sum_logprobs])
def test_select_by_sum_logprobs_by_name_or_object(client, method) -> None:
    prompt, choices = "Pick:", [" a", " bb", " ccc"]

    @rl.function
    def pick(s):
        s += prompt + rl.select("x", choices=choices, choices_method=method)

    state = pick.run(backend=client)
    # The reference: each choice's total toy logprob after the prompt.
    totals = []
    for c in choices:
        ids = chars(prompt + c)
        totals.append(sum(toy_logprob(ids[:i], ids[i]) for i in range(len(prompt), len(ids))))
    assert state["x"] == choices[max(range(3), key=lambda i: totals[i])]
    assert state.get_meta_info("x")["scores"] == pytest.approx(totals)


def test_flush_cache_on_the_backend(client, stub) -> None:
    client.generate("flush me please", max_tokens=1)
    assert client.generate("flush me please", max_tokens=1).meta_info["cached_tokens"] > 0
    rl.flush_cache(client)
    assert client.generate("flush me please", max_tokens=1).meta_info["cached_tokens"] == 0
    with rl.RuntimeEndpoint(stub.endpoint) as endpoint:
        endpoint.flush_cache()
        rl.set_default_backend(endpoint)
        try:
            rl.flush_cache()
        finally:
            rl.set_default_backend(None)
    assert rl.flush_cache() is False  # SGLang's api.flush_cache: no backend, nothing to do


def test_a_misspelt_run_keyword_is_the_sdks_error_before_anything_is_sent(client, stub) -> None:
    @rl.function
    def answer(s, question):
        s += question + rl.gen("a", max_tokens=2)

    before = len(stub.received)
    with pytest.raises(TypeError, match=r"answer\.run\(\) got an unexpected keyword argument "
                                        r"'temprature' \(did you mean 'temperature'\?\)"):
        answer.run(question="Why?", backend=client, temprature=0)
    with pytest.raises(TypeError, match=r"'questoin' \(did you mean 'question'\?\)"):
        answer.run(questoin="Why?", backend=client)
    assert len(stub.received) == before  # nothing reached the engine

    # A batch's keywords are all gen defaults: sync and async batches refuse a misspelt
    # one alike, naming the closest of every option a gen takes.
    with pytest.raises(TypeError, match=r"run_batch\(\) got an unexpected keyword argument "
                                        r"'logprob_start_length' \(did you mean "
                                        r"'logprob_start_len'\?\)"):
        answer.run_batch([{"question": "Why?"}], backend=client, logprob_start_length=0)
    with pytest.raises(TypeError, match=r"arun_batch\(\) got an unexpected keyword argument "
                                        r"'logprob_start_length' \(did you mean "
                                        r"'logprob_start_len'\?\)"):
        anyio.run(partial(answer.arun_batch, [{"question": "Why?"}], backend=client,
                          logprob_start_length=0))
    assert len(stub.received) == before

    @rl.function
    def open_ended(s, **extra):  # a body taking **kwargs accepts any name
        s += str(sorted(extra))

    assert open_ended.run(backend=client, colour="red").text() == "['colour']"


def test_seeded_forks_sample_like_n_branches_and_rerun_the_same(client) -> None:
    prompt = "Ideas:"

    @rl.function
    def ideas(s):
        s += prompt
        forks = s.fork(3)
        forks += rl.gen("idea", max_tokens=8, ignore_eos=True)
        forks.join()

    first = ideas.run(backend=client, temperature=0.7, seed=5)["idea"]
    again = ideas.run(backend=client, temperature=0.7, seed=5)["idea"]
    # Fork i samples as branch i of an n=3 request seeded 5 would: seed 5 + i.
    assert first == [text_of(toy_generate(chars(prompt), 8, ignore_eos=True, shift=5 + i))
                     for i in range(3)]
    assert len(set(first)) == 3 and again == first
    assert ideas.run(backend=client, temperature=0.7, seed=6)["idea"] != first


def test_seeded_nested_forks_add_their_indices(client) -> None:
    @rl.function
    def tree(s):
        s += "Q:"
        outer = s.fork(2)
        leaves = [leaf for state in outer for leaf in state.fork(2)]
        for leaf in leaves:
            leaf += rl.gen("leaf", max_tokens=6, ignore_eos=True)
        return leaves

    leaves = tree.run(backend=client, temperature=0.9, seed=100).ret_value
    want = [text_of(toy_generate(chars("Q:"), 6, ignore_eos=True, shift=100 + i + j))
            for i in range(2) for j in range(2)]
    assert [leaf["leaf"] for leaf in leaves] == want


def test_chat_repl_help_lists_every_command(stub) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        code = repl.main(["--endpoint", stub.endpoint, "--temperature", "0",
                          "--max-tokens", "3", "--message", "/help", "--message", "hi"])
    assert code == 0
    lines = out.getvalue().splitlines()
    for command, what in repl.COMMANDS.items():
        assert any(line.split() and line.split()[0] == command and what in line
                   for line in lines), command
    assert "/help" in repl.COMMANDS and "/exit" in repl.COMMANDS
    # "/help" was not sent as a chat message; "hi" was, and got its reply.
    assert sum("tokens in" in line for line in lines) == 1
