"""`StopRegex` and `check_patterns` against a brute-force reference: ``re.search`` over
the whole text after every token (SGLang's rule: the output ends after the first token
at which its text matches), and SGLang's trim (``str.find`` of the pattern)."""

from __future__ import annotations

import random
import re

import pytest
from radixlm.tokenizer.stop_regex import MAX_STOP_REGEX, StopRegex, check_patterns


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
