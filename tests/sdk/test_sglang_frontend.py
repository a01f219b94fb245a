"""SGLang 0.5's frontend language on radixlm, against the protocol stub: each test states
the SGLang behaviour it checks (from SGLang's ``lang/api.py``, ``interpreter.py``,
``ir.py`` and ``backend/runtime_endpoint.py``) and recomputes the expected result from the
stub's toy model (tokens are characters), independently of the SDK.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import redirect_stdout
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
import radixlm as rl
from radixlm.runtime.protocol import Generate, Message, OpenSession, Pin, TruncateSession
from radixlm.sdk import dtypes
from radixlm.sdk.lang import Text, flatten
from radixlm.sdk.reasoning import REASONING_FORMATS, split_reasoning
from radixlm.sdk.server_args import engine_options
from radixlm.testing import EOS, StubServer, toy_logprob
from toy_stub import chars, text_of, toy_generate

pytest_plugins = ["toy_stub"]  # its fixtures: stub, client


def generates(stub: StubServer, since: int) -> list[Generate]:
    return stub.received_of(Generate)[since:]


def count(stub: StubServer, kind: type) -> int:
    return len(stub.received_of(kind))


# -- roles and scopes on the state ------------------------------------------------------------


def test_role_methods_on_the_state_are_the_role_expressions(client, stub) -> None:
    """interpreter.ProgramState._role_common: ``s.user(expr)`` appends the role expression
    (and returns it); ``with s.user():`` submits RoleBegin, the body, RoleEnd."""

    @rl.function
    def with_scopes(s, q):
        s.system("Be brief.")
        with s.user():
            s += "Q: " + q
        with s.assistant():
            s += rl.gen("a", max_tokens=4, ignore_eos=True)

    before = count(stub, Generate)
    state = with_scopes.run(q="why?", backend=client)
    sent = generates(stub, before)[-1]
    assert [(m.role, m.content) for m in sent.input.messages] == [
        ("system", "Be brief."), ("user", "Q: why?")]
    assert sent.input.add_generation_prompt
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[-1]["content"] == state["a"]
    returned = []

    @rl.function
    def returns(s):
        returned.append(s.user("hi"))

    returns.run(backend=client)
    assert [type(x).__name__ for x in flatten(returned[0])] == ["RoleBegin", "Text", "RoleEnd"]


def test_var_scope_captures_the_text_appended_inside(client) -> None:
    """_execute_var_scope_end: the variable is the text from the scope's beginning,
    generated text included."""

    @rl.function
    def scoped(s):
        s += "Intro. "
        with s.var_scope("v"):
            s += "x=" + rl.gen("g", max_tokens=5, ignore_eos=True) + ";"
        s += " after"

    state = scoped.run(backend=client, temperature=0)
    out = text_of(toy_generate(chars("Intro. x="), 5, ignore_eos=True))
    assert state["g"] == out
    assert state["v"] == f"x={out};"


def test_forks_item_plus_equals_appends_to_that_fork(client) -> None:
    """ProgramStateGroup.__setitem__ asserts the stored value is the same state: so
    ``forks[i] += expr`` works and replacing a fork does not."""

    @rl.function
    def branches(s):
        s += "Root:"
        forks = s.fork(2)
        for i in range(2):
            forks[i] += f" b{i}"
            forks[i] += rl.gen("tip", max_tokens=3, ignore_eos=True)
        with pytest.raises(TypeError, match="cannot be replaced"):
            forks[0] = forks[1]
        forks.join()

    state = branches.run(backend=client, temperature=0)
    assert state["tip"] == [text_of(toy_generate(chars(f"Root: b{i}"), 3, ignore_eos=True))
                            for i in range(2)]


def test_a_variable_can_be_set_after_the_run(client) -> None:
    """test_programs.test_dtype_gen: ``state["x"] = int(state["x"])`` on a finished state
    (StreamExecutor.set_var just stores it)."""

    @rl.function
    def one(s):
        s += "n:" + rl.gen("x", max_tokens=2)

    state = one.run(backend=client)
    state["x"] = 42
    state.set_var("y", "z")
    assert state["x"] == 42 and state["y"] == "z"


# -- gen's parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "regex", "stops"), [
    (int, dtypes.REGEX_INT, [" ", "\n"]), ("float", dtypes.REGEX_FLOAT, [" ", "\n"]),
    (str, dtypes.REGEX_STR, []), (bool, dtypes.REGEX_BOOL, []),
])
def test_dtype_becomes_a_regex_and_stops(client, stub, dtype, regex, stops) -> None:
    """RuntimeEndpoint._handle_dtype_to_regex: the dtype's regex, and for numbers " " and
    "\\n" added to the stops that apply (the gen's, else the run's)."""

    @rl.function
    def typed(s):
        s += "A: " + rl.gen("a", dtype=dtype, max_tokens=3)
        s += "B: " + rl.gen("b", dtype=dtype, stop="!", max_tokens=3)

    before = count(stub, Generate)
    typed.run(backend=client, stop=";")
    first, second = generates(stub, before)
    assert first.sampling.regex == regex and second.sampling.regex == regex
    assert first.sampling.stop == [";", *stops] and second.sampling.stop == ["!", *stops]


def test_gen_int_and_gen_string_and_dtype_over_regex(client, stub) -> None:
    """api.gen_int / gen_string are gen(dtype=int / str); a dtype with a regex warns and
    the dtype's regex is used. SGLang's regex values."""
    assert dtypes.REGEX_INT == r"[-+]?[0-9]+[ \n]*"
    assert dtypes.REGEX_STR == r"\"[\w\d\s]*\""
    assert rl.gen_int("n", 5) == rl.gen("n", 5, dtype=int)
    assert rl.gen_string("t") == rl.gen("t", dtype=str)
    with pytest.warns(UserWarning, match="dtype's regex is used"):
        both = rl.gen("x", dtype=int, regex="[a-z]+")
    assert both.sampling["regex"] == dtypes.REGEX_INT
    with pytest.raises(ValueError, match="int, float, str or bool"):
        rl.gen("x", dtype=list)
    with pytest.raises(ValueError, match="not a valid regex"):
        rl.gen("x", regex="(")


def test_gen_takes_sglang_positional_order(stub) -> None:
    """api.gen(name, max_tokens, min_tokens, n, stop, ...): positional in that order."""
    g = rl.gen("x", 10, 3, 2, "\n")
    assert g.sampling["max_tokens"] == 10 and g.sampling["min_tokens"] == 3
    assert g.n == 2 and g.sampling["stop"] == "\n"


def test_min_tokens_masks_eos_until_reached(client, stub) -> None:
    """min_new_tokens (penaltylib): EOS and stop ids get -inf logits until min_tokens
    tokens were generated; afterwards they end the output as usual."""
    # A prompt whose free continuation ends (at EOS) early: then min_tokens must matter.
    prompt = next(p for p in (f"Go{i}:" for i in range(200))
                  if len(toy_generate(chars(p), 40)) < 6 and toy_generate(chars(p), 40)[-1] == EOS)
    free = toy_generate(chars(prompt), 40)

    @rl.function
    def at_least(s):
        s += prompt + rl.gen("a", max_tokens=40, min_tokens=12)

    before = count(stub, Generate)
    state = at_least.run(backend=client, temperature=0)
    assert generates(stub, before)[0].sampling.min_tokens == 12
    expected = toy_generate(chars(prompt), 40, min_tokens=12)
    assert len(expected) >= 12 and len(free) < 6
    assert state["a"] == text_of(expected)
    assert state.get_meta_info("a")["completion_tokens"] == len(expected)


def test_stop_regex_ends_the_output_and_keeps_the_match(client) -> None:
    """FINISHED_MATCHED_REGEX: the output ends at the token where the regex first
    matches; detokenizer's trim_matched_stop finds the pattern literally, so a match of
    a real pattern stays in the text, and a literal pattern is trimmed like a stop."""
    prompt = "Say:"
    free = text_of(toy_generate(chars(prompt), 60, ignore_eos=True))
    letter = next(c for c in free[3:] if c.isalpha())
    pattern = f"[{letter}]"
    end = re.search(pattern, free).end()

    @rl.function
    def until(s, stop_regex):
        s += prompt + rl.gen("a", max_tokens=60, ignore_eos=True, stop_regex=stop_regex)

    state = until.run(stop_regex=pattern, backend=client, temperature=0)
    assert state["a"] == free[:end]
    assert state.get_meta_info("a")["finish_reason"] == {"type": "stop", "matched": pattern}
    state = until.run(stop_regex=letter, backend=client, temperature=0)  # literal: trimmed
    assert state["a"] == free[:end - 1]


def test_logprob_start_len_counts_in_the_whole_text(client) -> None:
    """logprob_start_len: input_token_logprobs from that token of the prompt (the whole
    text so far, the session's history included); the first has the logprob None
    (logprob_result_processor: ``[None] + input_token_logprobs[:-1]``)."""

    @rl.function
    def scored(s, start):
        s += "First part. "
        s += rl.gen("warm", max_tokens=3, ignore_eos=True)
        s += " Second."
        s += rl.gen("a", max_tokens=2, ignore_eos=True, return_logprob=True,
                    logprob_start_len=start)

    for start in (0, 5, 20):
        state = scored.run(start=start, backend=client, temperature=0)
        prompt = chars(state.text()[: len(state.text()) - len(state["a"])])
        meta = state.get_meta_info("a")
        values = [t[0] for t in meta["input_token_logprobs"]]
        # SGLang's scheduler: [None] + the logprobs of the tokens after the start.
        expected = [None if i == start else toy_logprob(prompt[:i], prompt[i])
                    for i in range(start, len(prompt))]
        assert values == pytest.approx(expected)
        ids = [t[1] for t in meta["input_token_logprobs"]]
        assert ids[1 if start == 0 else 0:] == prompt[max(start, 1):]
        assert meta["output_token_logprobs_length"] == 2


def test_return_text_in_logprobs_fills_the_token_texts(client) -> None:
    """return_text_in_logprobs: each (logprob, token_id, text) triple gets the token's
    text (a toy token is one character); without it the text is None."""

    @rl.function
    def scored(s, texts):
        s += "Hi there."
        s += rl.gen("a", max_tokens=3, ignore_eos=True, return_logprob=True,
                    logprob_start_len=3, return_text_in_logprobs=texts)

    meta = scored.run(texts=True, backend=client, temperature=0).get_meta_info("a")
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert [t[2] for t in meta[key]] == [chr(t[1]) for t in meta[key]]
    assert "".join(t[2] for t in meta["input_token_logprobs"]) == "there."
    meta = scored.run(texts=None, backend=client, temperature=0).get_meta_info("a")
    assert {t[2] for t in meta["output_token_logprobs"]} == {None}


def test_run_level_options_and_none_as_not_given(client, stub) -> None:
    """ir.SglFunction.run/run_batch: n, logprob_start_len, return_text_in_logprobs,
    stop_regex... are run options (the gens' defaults); None means not given."""

    @rl.function
    def one(s):
        s += "Q:" + rl.gen("a", max_tokens=2, ignore_eos=True)
        s += "R:" + rl.gen("b", max_tokens=2, ignore_eos=True, n=1)

    before = count(stub, Generate)
    state = one.run(backend=client, n=2, use_thread=False, logprob_start_len=None,
                    stop_regex=None, return_text_in_logprobs=None, min_new_tokens=None)
    first, second = generates(stub, before)
    assert first.n == 2 and second.n == 1  # the run's n, unless the gen gives its own
    assert isinstance(state["a"], list) and len(state["a"]) == 2
    states = one.run_batch([{}, {}], backend=client, logprob_start_len=None, n=1,
                           return_text_in_logprobs=None, stop_regex=None)
    assert [isinstance(s["a"], str) for s in states] == [True, True]


def test_run_batch_generator_style_yields_states_in_order(client, stub) -> None:
    """_run_program_batch_generator: a generator, yielding each state in order."""

    @rl.function
    def echo(s, word):
        s += word + rl.gen("a", max_tokens=2, ignore_eos=True)

    before = count(stub, Generate)
    gen = echo.run_batch([{"word": w} for w in ("x", "yy", "zzz")], backend=client,
                         generator_style=True)
    assert count(stub, Generate) == before  # nothing runs before it is iterated
    words = []
    for state in gen:
        assert state["a"] == text_of(toy_generate(chars(state.text()[: -2]), 2, ignore_eos=True))
        words.append(state.text()[:-2])
    assert words == ["x", "yy", "zzz"]
    assert list(echo.run_batch([("q",)], backend=client))[0].text().startswith("q")


# -- streaming meta info ---------------------------------------------------------------------


def test_streamed_pieces_carry_the_meta_of_their_tokens() -> None:
    """test_programs.test_stream_logprobs: each piece's meta has output_token_logprobs for
    its own tokens, and completion_tokens / output_token_logprobs_length as totals."""
    with StubServer(token_delay_s=0.002) as stub, rl.connect(stub.endpoint) as client:

        @rl.function
        def qa(s):
            s += "Tell:" + rl.gen("answer", max_tokens=24, ignore_eos=True, return_logprob=True)

        async def collect() -> list[tuple[str, Any]]:
            state = qa.run(backend=client, stream=True, temperature=0)
            return [piece async for piece in state.text_async_iter("answer", return_meta_data=True)]

        chunks = asyncio.run(collect())
        prompt = chars("Tell:")
        out = toy_generate(prompt, 24, ignore_eos=True)
        assert "".join(t for t, _ in chunks) == text_of(out)
        assert len(chunks) > 1
        seen = 0
        for text, meta in chunks:
            assert text
            total = meta["completion_tokens"]
            assert meta["output_token_logprobs_length"] == total
            assert len(meta["output_token_logprobs"]) == total - seen
            assert [t[0] for t in meta["output_token_logprobs"]] == pytest.approx(
                [toy_logprob(prompt + out[:i], out[i]) for i in range(seen, total)])
            assert [t[1] for t in meta["output_token_logprobs"]] == out[seen:total]
            seen = total
        assert seen == len(out)


# -- select -----------------------------------------------------------------------------------


def _choice_logprobs(prompt: str, choice: str) -> list[float]:
    ids = chars(prompt + choice)
    return [toy_logprob(ids[:i], ids[i]) for i in range(len(prompt), len(ids))]


def test_select_meta_has_sglangs_keys(client) -> None:
    """RuntimeEndpoint.select + TokenLengthNormalized: meta_info holds
    normalized_prompt_logprobs, input_token_logprobs and output_token_logprobs."""
    prompt, choices = "Pick:", [" ab", " c", " def"]

    @rl.function
    def pick(s):
        s += prompt + rl.select("x", choices)

    meta = pick.run(backend=client).get_meta_info("x")
    per_choice = [_choice_logprobs(prompt, c) for c in choices]
    for row, expected in zip(meta["input_token_logprobs"], per_choice, strict=True):
        assert [t[0] for t in row] == pytest.approx(expected)
    assert meta["normalized_prompt_logprobs"] == pytest.approx(
        [sum(r) / len(r) for r in per_choice])
    assert meta["output_token_logprobs"] == [[], [], []]
    assert [len(r) for r in meta["input_top_logprobs"]] == [len(r) for r in per_choice]


def test_unconditional_likelihood_normalized_compares_with_the_choice_alone(client) -> None:
    """UnconditionalLikelihoodNormalized: argmax of mean(logprob in context - logprob of
    the choice alone), the first unconditional one (no context) counted as 0."""
    prompt, choices = "Q: pick one\nA:", [" alpha", " be", " gamma ray"]

    @rl.function
    def pick(s):
        s += prompt + rl.select("x", choices, choices_method=rl.unconditional_likelihood_normalized)

    state = pick.run(backend=client)
    scores = []
    for c in choices:
        cond = _choice_logprobs(prompt, c)
        ids = chars(c)
        uncond = [0.0] + [toy_logprob(ids[:i], ids[i]) for i in range(1, len(ids))]
        scores.append(sum(a - b for a, b in zip(cond, uncond, strict=True)) / len(cond))
    assert state["x"] == choices[max(range(3), key=lambda i: scores[i])]
    assert state.get_meta_info("x")["normalized_unconditional_prompt_logprobs"] == pytest.approx(scores)


def test_a_choices_method_of_the_program_is_called_as_sglang_calls_it(client) -> None:
    """ChoicesSamplingMethod: called by keyword with the choices' scores; its decision is
    the select's value and its meta_info the select's meta."""
    calls = []

    class Longest(rl.ChoicesSamplingMethod):
        def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                     output_token_logprobs, unconditional_token_logprobs=None):
            calls.append((choices, len(input_token_logprobs), unconditional_token_logprobs))
            return rl.ChoicesDecision(max(choices, key=len), {"mine": True})

    @rl.function
    def pick(s):
        s += "Go:" + rl.select("x", [" a", " bbb", " cc"], choices_method=Longest())

    state = pick.run(backend=client)
    assert state["x"] == " bbb" and state.get_meta_info("x")["mine"] is True
    assert calls == [([" a", " bbb", " cc"], 3, None)]


# -- reasoning --------------------------------------------------------------------------------


def test_split_reasoning_follows_sglangs_parsers() -> None:
    """reasoning_parser: Qwen3 thinks only inside <think>; DeepSeek-R1 is in reasoning
    from the start (no opening tag needed); an unclosed block is all reasoning."""
    qwen3, r1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek-r1"]
    assert split_reasoning("<think>because</think>The answer is 42.", qwen3) == (
        "because", "The answer is 42.")
    assert split_reasoning("The answer is 42.", qwen3) == ("", "The answer is 42.")
    assert split_reasoning("I need to think...</think>The answer is 42.", r1) == (
        "I need to think...", "The answer is 42.")
    assert split_reasoning("<think>still thinking", qwen3) == ("still thinking", "")
    with pytest.raises(ValueError, match="model_type"):
        rl.separate_reasoning(rl.gen("a"))
    with pytest.raises(ValueError, match="unsupported model_type"):
        rl.separate_reasoning(rl.gen("a"), model_type="nope")
    with pytest.raises(ValueError, match="named"):
        rl.separate_reasoning(rl.gen(), model_type="qwen3")


def test_separate_reasoning_moves_the_block_out_of_the_text_and_the_session(client, stub) -> None:
    """_execute_separate_reasoning: the variable keeps the answer, <name>_reasoning_content
    the reasoning, and the state's text continues with the answer only -- so the model
    does not see the reasoning in what follows (the session is cut back and re-fed)."""
    choices = ["<think>hmm</think> yes", "<think>no way</think> no"]

    @rl.function
    def think(s):
        s += "Q:"
        s += rl.separate_reasoning(rl.select("x", choices), model_type="qwen3")
        s += " then" + rl.gen("after", max_tokens=4, ignore_eos=True)

    before = count(stub, TruncateSession)
    state = think.run(backend=client, temperature=0)
    assert state["x"] in (" yes", " no")
    reasoning = "hmm" if state["x"] == " yes" else "no way"
    answer = state["x"]
    assert state["x_reasoning_content"] == reasoning
    assert state.text() == f"Q:{answer} then{state['after']}"
    assert count(stub, TruncateSession) == before + 1
    # The continuation was generated on the text without the reasoning.
    assert state["after"] == text_of(toy_generate(chars(f"Q:{answer} then"), 4, ignore_eos=True))


# -- function: trace and cache --------------------------------------------------------------


def test_trace_records_the_expressions_without_running(client, stub) -> None:
    """SglFunction.trace: the body against a tracer state; arguments not given are
    placeholders; nothing reaches a backend."""

    @rl.function
    def prog(s, topic):
        s += "About " + topic + ":"
        s += rl.gen("a", max_tokens=3)
        s += s["a"]

    before = len(stub.received)
    traced = prog.trace()
    assert len(stub.received) == before
    kinds = [type(n).__name__ for n in traced.flatten_nodes()]
    assert kinds == ["Text", "Argument", "Text", "Gen", "Variable"]
    assert "a" in traced.variables
    given = prog.trace(topic="cats")
    assert given.nodes[0] == Text("About cats:")

    @rl.function
    def forked(s):
        s += "Root."
        forks = s.fork(2)
        forks += lambda i: f" branch {i}" + rl.gen("x", max_tokens=2)
        forks.join()
        with s.user():
            s += "done"

    traced = forked.trace()
    assert [type(n).__name__ for n in traced.nodes] == [
        "Text", "Fork", "Join", "RoleBegin", "Text", "RoleEnd"]
    assert [[type(n).__name__ for n in c.nodes] for c in traced.child_states] == [
        ["Text", "Gen"], ["Text", "Gen"]]
    assert "x" in traced.variables


def test_cache_pins_the_constant_prefix_and_runs_start_from_it(client, stub) -> None:
    """SglFunction.cache (interpreter.cache_program): the prefix before the first
    argument or gen is prefetched -- here pinned; a run then sends only the rest, and
    generates exactly what it would on the whole text."""
    preamble = "You are a careful assistant. Answer in one word. " * 2

    @rl.function
    def ask(s, q):
        s += preamble
        s += "Q: " + q + "\nA:" + rl.gen("a", max_tokens=4, ignore_eos=True)

    pins = count(stub, Pin)
    name = ask.cache(backend=client)
    # The constant text before the argument (SGLang's prefix: the leading constants).
    assert count(stub, Pin) == pins + 1
    assert stub.received_of(Pin)[-1].input.text == preamble + "Q: "
    assert ask.cache(backend=client) == name  # idempotent
    opens = count(stub, OpenSession)
    state = ask.run(q="why", backend=client, temperature=0)
    opened = stub.received_of(OpenSession)[opens]
    assert opened.pinned == name
    assert state.text().startswith(preamble)
    assert state["a"] == text_of(toy_generate(chars(f"{preamble}Q: why\nA:"), 4, ignore_eos=True))
    assert preamble not in "".join(g.input.text or "" for g in stub.received_of(Generate)[-1:])
    client.unpin(name)
    # The pin is gone: a run starts from scratch (and later runs no longer try it).
    opens = count(stub, OpenSession)
    again = ask.run(q="why", backend=client, temperature=0)
    assert again["a"] == state["a"] and again.text() == state.text()
    assert [m.pinned for m in stub.received_of(OpenSession)[opens:]] == [name, None]
    opens = count(stub, OpenSession)
    ask.run(q="why", backend=client, temperature=0)
    assert [m.pinned for m in stub.received_of(OpenSession)[opens:]] == [None]


def test_run_batch_prefills_a_long_constant_prefix_once(client, stub) -> None:
    """run_program_batch: with enable_precache_with_tracing and more than one program,
    a constant prefix over 64 characters is cached before the batch runs."""
    system = "You are a classifier of reviews; answer with one label only. " * 2

    @rl.function
    def classify(s, review):
        s += rl.system(system)
        s += rl.user(review)
        s += rl.assistant(rl.gen("label", max_tokens=2))

    before = count(stub, Generate)
    classify.run_batch([{"review": "good"}, {"review": "bad"}], backend=client)
    first = generates(stub, before)[0]
    assert first.sampling.max_tokens == 0 and first.session is None
    assert first.input.messages == [Message(role="system", content=system)]
    rl.global_config.enable_precache_with_tracing = False
    try:
        before = count(stub, Generate)
        classify.run_batch([{"review": "good"}, {"review": "bad"}], backend=client)
        assert all(g.sampling.max_tokens > 0 for g in generates(stub, before))
    finally:
        rl.global_config.enable_precache_with_tracing = True


# -- backends and global config ---------------------------------------------------------


def test_global_config_holds_the_default_backend(client) -> None:
    """api.set_default_backend writes global_config.default_backend; test_programs reads
    ``global_config.default_backend.endpoint.get_model_name()``; flush_cache and
    get_server_info answer False / None without a backend."""
    assert rl.get_server_info() is None
    rl.set_default_backend(client)
    try:
        assert rl.global_config.default_backend is client
        assert rl.global_config.default_backend.endpoint.get_model_name() == "stub-toy"
        assert client.endpoint == client.aclient.endpoint  # still the address, as a str
        info = rl.get_server_info()
        assert info["model_path"] == "stub-toy" and "internal_states" in info
        assert rl.flush_cache() is True
    finally:
        rl.set_default_backend(None)
    assert rl.flush_cache() is False


def test_verbosity_two_prints_the_text(client) -> None:
    """interpreter.run_internal: verbosity >= 2 prints the final text of every run."""

    @rl.function
    def hello(s):
        s += "Hello there"

    rl.global_config.verbosity = 2
    try:
        out = io.StringIO()
        with redirect_stdout(out):
            hello.run(backend=client)
    finally:
        rl.global_config.verbosity = 0
    assert out.getvalue() == "Hello there\n"


@pytest.fixture
def http_info(stub: StubServer) -> Iterator[tuple[str, dict[str, Any]]]:
    """An HTTP server answering /get_model_info as a radixlm HTTP frontend does."""
    answer: dict[str, Any] = {"status": 200, "body": {"model_path": "stub-toy",
                                                      "radixlm_endpoint": stub.endpoint}}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            ok = self.path == "/get_model_info"
            self.send_response(answer["status"] if ok else 404)
            self.end_headers()
            self.wfile.write(json.dumps(answer["body"]).encode())

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", answer
    finally:
        server.shutdown()
        server.server_close()


def test_runtime_endpoint_takes_a_servers_url(http_info, stub) -> None:
    """sgl.RuntimeEndpoint(base_url): an http URL of the server (its /get_model_info
    names the engine endpoint), or the engine endpoint itself."""
    url, answer = http_info
    with rl.RuntimeEndpoint(url) as backend:
        assert backend.get_model_name() == "stub-toy"
        assert backend.generate("hi", max_tokens=2).text
    with rl.RuntimeEndpoint(url + "/v1/") as backend:
        assert backend.endpoint == stub.endpoint
    with rl.RuntimeEndpoint(stub.endpoint) as backend:
        assert isinstance(backend, rl.Client)
    answer["body"] = {"model_path": "x"}  # an SGLang server: no radixlm endpoint
    with pytest.raises(rl.EngineDeadError, match="protocol endpoint"):
        rl.RuntimeEndpoint(url)
    answer["status"] = 401
    with pytest.raises(rl.EngineDeadError, match="api_key"):
        rl.RuntimeEndpoint(url)
    with pytest.raises(ValueError, match=r"ipc://\.\.\. or tcp://"):
        rl.RuntimeEndpoint("localhost:30000")


@pytest.mark.parametrize("name", ["OpenAI", "Anthropic", "LiteLLM", "VertexAI", "Crusoe"])
def test_hosted_backends_are_refused_with_what_to_use(name) -> None:
    with pytest.raises(rl.UnsupportedError, match=r"rl\.Engine\(\)"):
        getattr(rl, name)("gpt-4")


def test_image_and_video_are_refused_with_why() -> None:
    with pytest.raises(rl.UnsupportedError, match="text-only models"):
        rl.image("cat.png")
    with pytest.raises(rl.UnsupportedError, match="text-only models"):
        rl.video("cat.mp4", 8)


def test_sglang_server_args_become_serve_flags() -> None:
    """rl.Runtime / ServerArgs take SGLang's server arguments."""
    assert engine_options({"context_length": 2048, "random_seed": 3, "cuda_graph_max_bs": 4,
                           "attention_backend": "torch_native", "kv_tokens": 512}) == {
        "context_length": 2048, "seed": 3, "attention": "torch", "kv_tokens": 512}
    with pytest.raises(ValueError, match="tp_size"):
        rl.ServerArgs(model_path="default", tp_size=2)


def test_old_program_text_still_runs_under_warnings(client) -> None:
    """An SGLang habit: select's temperature 0.0 default and choices via gen()."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        @rl.function
        def pick(s):
            s += "Go:" + rl.gen("x", choices=[" a", " b"])

        assert pick.run(backend=client)["x"] in (" a", " b")
