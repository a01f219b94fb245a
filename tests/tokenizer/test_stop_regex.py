"""`StopRegex` and `check_patterns` against a brute-force reference: ``re.search`` over
the whole text after every token (SGLang's rule: the output ends after the first token
at which its text matches), and SGLang's trim (``str.find`` of the pattern); then the
engine's `TokenStopMatcher` with patterns against the same reference over token streams."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixlm.tokenizer import TokenStopMatcher
from radixlm.tokenizer.stop_regex import MAX_STOP_REGEX, StopRegex, check_patterns

from tests.tokenizer.test_stop_matcher import VOCAB, ToyTokenizer  # decode is concatenation


@pytest.mark.parametrize("patterns", [
    ["[0-9]+"], [r"\n\n"], ["END"], ["a{2,3}b", "zz"], [r"\bthe\b"], ["^abc"], ["x$"],
    [r"(foo|bar)\.", r"\d\d"], ["(?<=q)u"],
])
def test_the_output_ends_at_the_token_where_the_text_first_matches(patterns) -> None:
    rng = random.Random(7)
    alphabet = "abfoqurxzETND 0123456789.\n"
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        cuts = sorted(set(rng.sample(range(1, len(text) + 1), k=min(len(text), 12))) | {len(text)})
        # SGLang checks after every token: the first token after which the text matches.
        expected = next(((c, p) for c in cuts for p in patterns if re.search(p, text[:c])), None)
        matcher, got, prev = StopRegex(patterns), None, 0
        for cut in cuts:
            if matcher.search(text[:cut], cut - prev):
                got = (cut, matcher.hit)
                break
            prev = cut
        assert got == expected, (text, cuts, patterns)


def test_a_bounded_pattern_is_searched_near_the_new_text_only() -> None:
    m = StopRegex(["ab"])
    assert not m.search("xxab" + "y" * 10, 1)  # an old match: found when it was new
    assert m.search("xxxxab", 1) and m.hit == "ab"


def test_sglangs_trim_is_a_literal_find_of_the_pattern() -> None:
    assert StopRegex.trim_at("count 12 END", "END") == 9
    assert StopRegex.trim_at("count 12", "[0-9]+") == len("count 12")


@pytest.mark.parametrize(("pattern", "why"), [
    ("(a+)+", "repetition inside a repetition"), ("(x*y)*z", "repetition inside"),
    (r"(\d)\1", "backreferences"), ("(", "refused"), ("", "non-empty"),
    ("a" * 300, "at most 256 bytes"),
])
def test_dangerous_or_bad_patterns_are_refused(pattern, why) -> None:
    assert why in (check_patterns([pattern]) or "")


def test_limits() -> None:
    assert check_patterns(["a"] * MAX_STOP_REGEX) is None
    assert "at most" in (check_patterns(["a"] * (MAX_STOP_REGEX + 1)) or "")
    assert check_patterns(["(ab)?c+", "(foo|bar)+"]) is None


# -- in the engine's matcher (tokenizer/stop.py `TokenStopMatcher`) ------------------------

PATTERNS = ["ab", "a+b", "b.c", "c$", "^a", "(ab|ca) ", "[bc]{2}", "a b", "cab", "b c"]


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(ids=st.lists(st.integers(0, len(VOCAB) - 1), max_size=30),
       patterns=st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=2, unique=True))
def test_the_engine_matcher_ends_and_cuts_where_sglang_does(ids: list[int],
                                                             patterns: list[str]) -> None:
    """Reference: SGLang's rule over the texts of every token prefix -- the first prefix
    whose text matches a pattern ends it; the text is cut at the pattern's first literal
    occurrence (else kept whole). Nothing released before the end goes past that cut."""
    texts = [VOCAB[i] for i in ids]

    def text(k: int) -> str:
        return "".join(texts[:k])

    end = next(((k, p) for k in range(1, len(ids) + 1) for p in patterns
                if re.search(p, text(k))), None)
    m = TokenStopMatcher(ToyTokenizer(), [], (), patterns)
    hit = False
    for i in range(len(ids)):
        hit = m.feed(ids[i:i + 1])
        if hit:
            break
        if end is not None:  # what went out is never cut away later
            cut = text(end[0]).find(end[1])
            assert cut == -1 or len(text(m.released)) <= cut
    if not hit:
        hit = m.finish()
    assert hit == (end is not None)
    if end is None:
        assert m.hit is None and m.released == len(ids)
        return
    k, pattern = end
    assert m.hit == pattern
    cut = text(k).find(pattern)
    if cut == -1:
        assert (m.kept, m.trim) == (k, 0)
    else:
        kept = min(j for j in range(len(ids) + 1) if len(text(j)) >= cut)
        assert (m.kept, m.released) == (kept, kept)
        assert text(kept)[: len(text(kept)) - m.trim] == text(k)[:cut]
