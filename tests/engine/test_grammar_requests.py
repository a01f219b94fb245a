"""Constrained decoding in the scheduler (tiny model, in-process): every output obeys
its grammar through n > 1, retraction and sessions; compilation never blocks other
requests; jump-forward saves decode steps and leaves the KV exactly as a prefill of the
same tokens would (checked against HF transformers); bad grammars are refused cleanly.

References: `re.fullmatch`, `jsonschema`, brute-force allowed-token sets, and HF
transformers' logits.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch
from radixlm.runtime.engine.wire import EngineAbort
from radixlm.runtime.grammar.compiler import GrammarCompiler
from radixlm.runtime.grammar.runtime import Grammars
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.grammar.vocab import tokenizer_info
from radixlm.runtime.model import ModelConfig
from radixlm.runtime.protocol import Error, ErrorCode, SamplingParams
from radixlm.tokenizer import Tokenizer
from scheduler_harness import (
    hf,
    hf_prompt_logprobs,
    make_harness,
    one_thread,
    random_prompt,
    scheduler_pool_integrity,
    tiny_dir,
)
from tiny_models import EOS_ID

from tests.engine.test_sessions_in_scheduler import C, open_session

# Fixtures shared with the other scheduler tests (pytest finds them by these names here).
SHARED_FIXTURES = (hf, make_harness, one_thread, scheduler_pool_integrity, tiny_dir)

DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-9]{2}"
ORDER = {
    "type": "object",
    "properties": {
        "customer_identifier": {"type": "integer", "minimum": 0, "maximum": 99999},
        "shipping_destination_city": {"type": "string", "maxLength": 6},
        "priority_level": {"enum": ["low", "high"]},
    },
    "required": ["customer_identifier", "shipping_destination_city", "priority_level"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.load(tiny_dir)


@pytest.fixture(scope="module")
def vocab(tiny_dir) -> int:
    return ModelConfig.from_dir(tiny_dir).vocab_size


@pytest.fixture(scope="module")
def grammars(tok, vocab):
    g = Grammars(tok, vocab, [EOS_ID])
    yield g
    g.close()


def regex(text: str) -> GrammarSpec:
    return GrammarSpec(kind="regex", text=text)


def schema(doc: dict) -> GrammarSpec:
    return GrammarSpec(kind="json_schema", text=json.dumps(doc))


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 1.0, **kw})


def text_of(tok, h, key, index=0) -> str:
    out = h.output(key, index)
    assert h.final[(key, index)].finish_reason == "stop", h.final[(key, index)]
    assert out[-1] == EOS_ID  # ended by EOS, which the grammar allowed only when complete
    return tok.decode(out[:-1])


def test_outputs_obey_their_grammars_in_one_batch(make_harness, grammars, tok):
    h = make_harness(grammars=grammars)
    rng = np.random.default_rng(1)
    dates = h.generate(random_prompt(rng, 9), sampling=sampled(seed=1), grammar=regex(DATE), n=3)
    orders = h.generate(random_prompt(rng, 7), sampling=sampled(seed=2), grammar=schema(ORDER), n=2)
    free = h.generate(random_prompt(rng, 5), max_tokens=12)
    h.run()
    for i in range(3):
        assert re.fullmatch(DATE, text_of(tok, h, dates, i))
    for i in range(2):
        jsonschema.validate(json.loads(text_of(tok, h, orders, i)), ORDER)
    assert len(h.output(free)) == 12  # the unconstrained neighbour is untouched


def test_logprobs_are_of_the_constrained_distribution(make_harness, grammars, tok, hf):
    """For a small finite language, the allowed set at each step is found by brute force;
    each returned logprob is HF's raw logprob renormalised over that set."""
    language = ["cat", "cats", "dog", "dogs"]
    h = make_harness(grammars=grammars)
    prompt = tok.encode("Pet:")
    key = h.generate(prompt, sampling=sampled(logprobs=True, seed=4),
                     grammar=regex("(cat|dog)s?"))
    h.run()
    out = h.output(key)
    lps = h.logprobs[(key, 0)]
    assert len(lps) == len(out)
    prefix = ""
    for i, t in enumerate(out):
        with torch.no_grad():
            raw = torch.log_softmax(hf(torch.tensor([prompt + out[:i]])).logits[0, -1].float(), -1)
        allowed = [a for a in range(tok.vocab_size) if a != EOS_ID and a not in tok.all_special_ids
                   and any(w.startswith(prefix + tok.decode([a])) for w in language)
                   and tok.decode([a])]  # fmt: skip
        if prefix in language:
            allowed.append(EOS_ID)
        expected = raw[t] - torch.logsumexp(raw[allowed], 0)
        assert lps[i] == pytest.approx(expected.item(), abs=1e-4), (i, prefix)
        prefix += tok.decode([t]) if t != EOS_ID else ""
    assert prefix in language


def test_max_tokens_cuts_a_match_short(make_harness, grammars, tok):
    h = make_harness(grammars=grammars)
    key = h.generate(tok.encode("Id:"), sampling=sampled(max_tokens=3), grammar=regex("x{20}y"))
    h.run()
    assert h.final[(key, 0)].finish_reason == "length"
    text = tok.decode(h.output(key))
    assert text and set(text) == {"x"} and len(text) < 20  # a prefix of the only match


class GatedCompiler(GrammarCompiler):
    """Compiles only once `gate` is set: a compilation that takes as long as the test
    wants."""

    def __init__(self, info, gate: threading.Event) -> None:
        super().__init__(info)
        self.gate = gate

    def _compile(self, spec):
        assert self.gate.wait(60)
        return super()._compile(spec)


def test_a_slow_compile_does_not_hold_other_requests(make_harness, tok, vocab):
    gate = threading.Event()
    slow = Grammars(tok, vocab, [EOS_ID],
                    compiler=GatedCompiler(tokenizer_info(tok, vocab, {EOS_ID}), gate))
    try:
        h = make_harness(grammars=slow)
        waiting = h.generate(tok.encode("Date:"), sampling=sampled(seed=3), grammar=regex(DATE))
        other = h.generate(tok.encode("Hello"), max_tokens=10)
        while (other, 0) not in h.final:
            h.step()
        assert len(h.output(other)) == 10  # decoded to the end while the grammar compiled
        assert len(h.sched.table.compiling) == 1 and not h.tokens[(waiting, 0)]
        assert h.cache.sizes().free + h.cache.sizes().evictable == h.cache.capacity
        gate.set()
        h.run()
        assert re.fullmatch(DATE, text_of(tok, h, waiting))
    finally:
        gate.set()
        slow.close()


def test_abort_while_compiling_and_bad_grammars(make_harness, tok, vocab, grammars):
    gate = threading.Event()
    slow = Grammars(tok, vocab, [EOS_ID],
                    compiler=GatedCompiler(tokenizer_info(tok, vocab, {EOS_ID}), gate))
    try:
        h = make_harness(grammars=slow)
        key = h.generate(tok.encode("x"), sampling=sampled(), grammar=regex("a+"), n=2)
        h.step()
        h.send(EngineAbort(key=key))
        assert {h.final[(key, i)].finish_reason for i in range(2)} == {"abort"}
        assert not h.sched.table.compiling and not h.sched.has_work()
    finally:
        gate.set()
        slow.close()
    h = make_harness(grammars=grammars)
    for spec, needle in [(regex("(a"), "parenthesis"), (schema({"type": "blah"}), "blah"),
                         (GrammarSpec(kind="ebnf", text="root ::= nothing"), "nothing")]:
        key = h.generate(tok.encode("x"), sampling=sampled(), grammar=spec)
        h.run()
        error = h.replies.pop()
        assert isinstance(error, Error) and error.code == ErrorCode.INVALID_PARAMS
        assert needle in error.message and error.message.startswith(spec.kind), error.message
        assert h.final[(key, 0)].finish_reason == "error"
    ok = h.generate(tok.encode("x"), sampling=sampled(seed=5), grammar=regex("ok"))
    h.run()
    assert text_of(tok, h, ok) == "ok"  # still serving


def test_an_engine_without_grammars_refuses_them(make_harness, tok):
    h = make_harness()
    h.generate(tok.encode("x"), sampling=sampled(), grammar=regex("a"))
    error = h.replies.pop()
    assert isinstance(error, Error) and error.code == ErrorCode.INVALID_PARAMS


def test_retracted_constrained_requests_resume_in_their_grammar(make_harness, grammars, tok):
    """A pool too small for every request: the newest are retracted and recomputed; each
    keeps its grammar state (its output is kept), so every output still matches."""
    pattern = "(ab|cd|ef){25}"
    h = make_harness(grammars=grammars, capacity=160)
    rng = np.random.default_rng(7)
    keys = [h.generate(random_prompt(rng, 6), sampling=sampled(max_tokens=70, seed=i),
                       grammar=regex(pattern)) for i in range(5)]
    h.run()
    assert h.sched.counters.retractions > 0
    for key in keys:
        assert re.fullmatch(pattern, text_of(tok, h, key))


def test_jump_forward_in_a_session_keeps_history_token_exact(make_harness, grammars, tok, hf):
    """A constrained turn with jump-forward, then a free turn in the same session: the
    history is prompt + the returned tokens, and the next turn's prompt logprobs (computed
    on the cached KV, jumped tokens included) equal HF's over the same tokens."""
    h = make_harness(grammars=grammars, sessions=True)
    first = tok.encode("Order record:\n")
    sid = open_session(h, first).session
    steps0 = h.sched.counters.steps
    key = h.generate(tok.encode("JSON:"), sampling=sampled(seed=11), grammar=schema(ORDER),
                     client=C, session=sid)
    h.run()
    turn = h.output(key)
    jsonschema.validate(json.loads(tok.decode(turn[:-1])), ORDER)
    assert h.sched.counters.jumped_tokens >= sum(len(tok.encode(k)) for k in ORDER["properties"])
    history = first + tok.encode("JSON:") + turn
    assert h.final[(key, 0)].session_length == len(history)
    steps_used = h.sched.counters.steps - steps0
    assert steps_used < len(turn)  # fewer forwards than output tokens
    follow = tok.encode(" Thanks!")
    key2 = h.generate(follow, max_tokens=1, client=C, session=sid, prompt_logprobs_start=0)
    h.run()
    final = h.final[(key2, 0)]
    # The whole turn was cached (but its last token, whose logits score the first new one).
    assert final.usage.cached_tokens == len(history) - 1
    expected = hf_prompt_logprobs(hf, history + follow, len(history))
    np.testing.assert_allclose(final.prompt_logprobs, expected, atol=1e-4)


def test_abort_mid_generation_keeps_outputs_in_the_grammar(make_harness, tok, grammars):
    """Abort after some constrained tokens: each branch ends `abort` with text that is a
    prefix of the language, the grammar states are dropped, and the next constrained
    request (same compiled grammar) runs to a complete match."""
    h = make_harness(grammars=grammars)
    key = h.generate(tok.encode("x"), sampling=sampled(max_tokens=150), grammar=regex("[ab]{60}"),
                     n=2)
    for _ in range(500):
        if all(len(h.tokens[(key, i)]) >= 3 for i in range(2)):
            break
        if not h.step():
            time.sleep(0.002)  # the grammar compiles on its thread
    assert all(len(h.tokens[(key, i)]) >= 3 for i in range(2)), "no constrained tokens yet"
    h.send(EngineAbort(key=key))
    for i in range(2):
        assert h.final[(key, i)].finish_reason == "abort"
        text = tok.decode(h.output(key, i))
        assert re.fullmatch("[ab]*", text) and len(text) < 60, text
    assert not h.sched.has_work()
    again = h.generate(tok.encode("x"), sampling=sampled(seed=9), grammar=regex("[ab]{60}"))
    h.run()
    assert re.fullmatch("[ab]{60}", text_of(tok, h, again))
