"""The engine's grammar pieces without the engine: compilation and its cache, per-sequence
state (fork, rollback), the batch mask in sampling, and jump-forward's re-tokenization.

References: Python's `re` and brute-force enumeration of small languages for allowed
tokens, `jsonschema` for JSON outputs, the tokenizer's own `encode` for token-exactness.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
from radixlm.runtime.engine.sampling import Sampler
from radixlm.runtime.grammar.bitmask import BatchMasker
from radixlm.runtime.grammar.compiler import CompilingGrammar, GrammarCompiler, GrammarError
from radixlm.runtime.grammar.jump_forward import plan_jump
from radixlm.runtime.grammar.matcher import GrammarState
from radixlm.runtime.grammar.spec import GrammarSpec
from radixlm.runtime.grammar.vocab import tokenizer_info
from radixlm.runtime.protocol import SamplingParams
from radixlm.tokenizer import Tokenizer

EXTRA_VOCAB = 16  # the model's logits are wider than the tokenizer (padding rows)


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def vocab(tok: Tokenizer) -> int:
    return tok.vocab_size + EXTRA_VOCAB


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer, vocab: int):
    c = GrammarCompiler(tokenizer_info(tok, vocab, tok.eos_token_ids))
    yield c
    c.close()


def state(compiler: GrammarCompiler, tok: Tokenizer, kind: str, text: str, **kw) -> GrammarState:
    return GrammarState(compiler.compile_now(GrammarSpec(kind=kind, text=text, **kw)),
                        tok.eos_token_ids)


@pytest.mark.parametrize(("kind", "text", "needle"), [
    ("regex", "a(b", "parenthesis"),
    ("ebnf", "root ::= undefined_rule", "undefined_rule"),
    ("json_schema", '{"type": "blah"}', "blah"),
    ("json_schema", '{"type": ', "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
])  # fmt: skip
def test_compile_errors_carry_the_compilers_message(compiler, kind, text, needle) -> None:
    with pytest.raises(GrammarError) as e:
        compiler.compile_now(GrammarSpec(kind=kind, text=text))
    assert needle in str(e.value) and str(e.value).startswith(kind), str(e.value)
    assert not str(e.value).startswith("[")  # xgrammar's timestamp/location prefix removed


def test_cache_by_spec_and_compiles_off_the_calling_thread(compiler) -> None:
    spec = GrammarSpec(kind="regex", text="(x|y){1,40}z")
    before = compiler.compiled
    first = compiler.get(spec)
    assert isinstance(first, CompilingGrammar)  # never compiled inline
    compiled = first.wait(30)
    assert compiler.get(spec) is compiled  # cached: returned at once, no new compile
    assert compiler.compiled == before + 1
    # Failures are not cached: asking again compiles (and fails) again.
    bad = GrammarSpec(kind="regex", text="(")
    for _ in range(2):
        got = compiler.get(bad)
        assert isinstance(got, CompilingGrammar)
        with pytest.raises(GrammarError):
            got.wait(30)
    assert compiler.compiled == before + 3


def allowed_by_language(tok: Tokenizer, prefix: str, language: list[str]) -> set[int]:
    """Tokens t such that prefix + text(t) is a prefix of some string of the language,
    plus EOS when prefix itself is in it (brute force over the vocabulary)."""
    out = {t for t in range(tok.vocab_size) if t not in tok.all_special_ids
           and (piece := tok.decode([t])) and "\ufffd" not in piece
           and any(w.startswith(prefix + piece) for w in language)}  # fmt: skip
    if prefix in language:
        out |= set(tok.eos_token_ids)
    return out


def test_mask_allows_exactly_the_language(compiler, tok, vocab) -> None:
    language = ["cat", "cats", "dog", "dogs", "the dog"]
    st = state(compiler, tok, "regex", "(cat|dog)s?|the dog")
    masker = BatchMasker(vocab)
    prefix = ""
    for step in range(8):
        mask = masker.fill([None, st])
        assert mask is not None and mask.rows == [1]
        logits = mask.apply(torch.zeros(2, vocab))
        assert torch.isfinite(logits[0]).all()  # the unconstrained row is untouched
        allowed = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
        assert allowed == allowed_by_language(tok, prefix, language), (step, prefix)
        if not allowed - set(tok.eos_token_ids):
            break
        t = min(allowed - set(tok.eos_token_ids), key=lambda t: (-len(tok.decode([t])), t))
        assert st.accept(t)
        prefix += tok.decode([t])
    assert prefix in language and st.complete


@pytest.mark.parametrize("seed", range(3))
def test_sampling_under_a_mask_matches_the_regex(compiler, tok, vocab, seed) -> None:
    pattern = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-9]{2}"
    sampler = Sampler(vocab)
    masker = BatchMasker(vocab)
    params = [SamplingParams(temperature=1.0, logprobs=True, top_logprobs=3)] * 4
    states = [state(compiler, tok, "regex", pattern) for _ in params]
    outs: list[list[int]] = [[] for _ in params]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(40):
        live = [i for i, s in enumerate(states) if not s.terminated]
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=gen) * 3
        mask = masker.fill([states[i] for i in live])
        raw = torch.log_softmax(mask.apply(logits.clone()), dim=-1)
        res = sampler.sample(logits, [params[i] for i in live], [outs[i] for i in live],
                             generators=[gen] * len(live), mask=mask)
        for row, (i, t) in enumerate(zip(live, res.token_ids, strict=True)):
            assert states[i].accept(t), "sampled a token the grammar forbids"
            outs[i].append(t)
            # Logprobs are those of the constrained distribution.
            assert res.logprobs is not None and res.logprobs[row] == pytest.approx(raw[row, t].item(), abs=1e-5)
            top = res.top_logprobs[row]  # type: ignore[index]
            assert all(torch.isfinite(raw[row, tid]) for tid, _ in top)
    for out in outs:
        assert out[-1] in tok.eos_token_ids
        assert re.fullmatch(pattern, tok.decode(out[:-1])), tok.decode(out)


def test_eos_only_when_the_grammar_accepts(compiler, tok, vocab) -> None:
    st = state(compiler, tok, "regex", "ab(c)?")
    masker = BatchMasker(vocab)
    eos = next(iter(tok.eos_token_ids))

    def eos_allowed() -> bool:
        return bool(torch.isfinite(masker.fill([st]).apply(torch.zeros(1, vocab))[0, eos]))  # type: ignore[union-attr]

    assert not eos_allowed()
    for t in tok.encode("ab"):
        assert st.accept(t)
    assert eos_allowed() and st.complete and not st.terminated
    assert st.accept(eos) and st.terminated


def test_fork_and_rollback_keep_states_apart(compiler, tok) -> None:
    st = state(compiler, tok, "regex", "(left|right)[0-9]+")
    st.accept_all(tok.encode("le"))
    child = st.fork()
    assert child.accept_all(tok.encode("ft1")) == len(tok.encode("ft1"))
    assert not st.complete and child.complete  # the parent did not move
    taken = st.accept_all(tok.encode("ft22"))
    st.rollback(taken)
    assert st.accepted == len(tok.encode("le")) and not st.complete
    assert st.accept_all(tok.encode("ft3")) == len(tok.encode("ft3")) and st.complete


LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_identifier": {"type": "integer"},
        "shipping_destination_city": {"type": "string", "maxLength": 8},
        "priority_level": {"enum": ["low", "high"]},
    },
    "required": ["customer_identifier", "shipping_destination_city", "priority_level"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(12))
def test_jump_forward_tokens_are_the_tokenizers(compiler, tok, vocab, seed) -> None:
    """Sample a JSON object under a schema with long fixed keys, jumping forward whenever
    the grammar forces text: each jump's tokens equal what the tokenizer makes of the
    same text in context, the result validates, and jumps save steps."""
    sampler, masker = Sampler(vocab), BatchMasker(vocab)
    st = state(compiler, tok, "json_schema", json.dumps(LONG_KEYS))
    prompt_last = tok.encode("Order:\n")[-1]
    out: list[int] = []
    steps = jumped = 0
    gen = torch.Generator().manual_seed(seed)
    while not st.terminated and len(out) < 200:
        mask = masker.fill([st])
        t = sampler.sample(torch.randn(1, vocab, generator=gen), [SamplingParams()], [out],
                           generators=[gen], mask=mask).token_ids[0]
        steps += 1
        assert st.accept(t)
        out.append(t)
        prev = out[-2] if len(out) > 1 else prompt_last
        plan = plan_jump(st, tok, prev, t, budget=200 - len(out) + 1)
        if plan is None:
            continue
        # Reference: the tokenizer's own tokens for prev + the jumped text (+ a tail).
        text = tok.decode([prev, *plan.tokens])
        expected = tok.encode(text + st.forced_text() + "\u0001")
        assert expected[: 1 + len(plan.tokens)] == [prev, *plan.tokens]
        out[-1:] = plan.tokens
        jumped += plan.gained
    assert out[-1] in tok.eos_token_ids
    jsonschema.validate(json.loads(tok.decode(out[:-1])), LONG_KEYS)
    assert st.accepted == len(out)
    # The long keys came without decode steps (at least their names' tokens).
    assert jumped >= sum(len(tok.encode(key)) for key in LONG_KEYS["properties"]), (jumped, steps)


def test_compile_time_is_measured_not_asserted(compiler) -> None:
    """Cached lookups return the same compiled grammar (timing lives in the benchmark)."""
    spec = GrammarSpec(kind="json_schema", text=json.dumps(LONG_KEYS))
    t0 = time.perf_counter()
    compiled = compiler.compile_now(spec)
    assert compiler.compile_now(spec) is compiled
    assert time.perf_counter() - t0 < 60


def test_length_limited_json_strings_admit_no_control_characters(compiler, tok, vocab) -> None:
    """JSON forbids raw control characters in strings, limited or not."""
    for prop in ({"type": "string", "maxLength": 6}, {"type": "string"}):
        schema = {"type": "object", "properties": {"a": prop}, "required": ["a"]}
        st = state(compiler, tok, "json_schema", json.dumps(schema))
        assert st.accept_all(tok.encode('{"a": "')) == len(tok.encode('{"a": "'))
        logits = BatchMasker(vocab).fill([st]).apply(torch.zeros(1, vocab))  # type: ignore[union-attr]
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        texts = [tok.decode([t]) for t in allowed if t < tok.vocab_size]
        assert texts and not [t for t in texts if any(ord(c) < 0x20 for c in t)], prop
