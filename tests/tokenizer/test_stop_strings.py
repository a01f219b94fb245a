"""StopStringMatcher under random chunkings equals a search over the whole text."""

from __future__ import annotations

from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from radixlm.tokenizer import StopStringMatcher


def reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The first stop string to be complete (smallest end; longest on a tie), by brute force."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            hit = max(ending, key=len)
            return text[: end - len(hit)], hit
    return text, None


def run(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    m = StopStringMatcher(stops)
    out, hit = [], None
    for chunk in chunks:
        emit, h = m.feed(chunk)
        out.append(emit)
        if h is not None:
            hit = h
            break
    if hit is None:
        out.append(m.flush())
    return "".join(out), hit


S = TypeVar("S", str, list[int])


def split(seq: S, cuts: list[int]) -> list[S]:
    """`seq` (text or token ids) cut at the positions `cuts` name (modulo its length + 1)."""
    points = sorted({c % (len(seq) + 1) for c in cuts})
    pieces, last = [], 0
    for p in [*points, len(seq)]:
        pieces.append(seq[last:p])
        last = p
    return pieces


_ALPHABET = "abc\n😀é"
_stops = st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=4), max_size=4)


@settings(max_examples=250, deadline=None)
@given(
    text=st.text(alphabet=_ALPHABET, max_size=40),
    stops=_stops,
    cuts=st.lists(st.integers(0, 60), max_size=15),
)
def test_matches_reference_under_any_chunking(text, stops, cuts):
    assert run(stops, split(text, cuts)) == reference(text, stops)


@settings(max_examples=120, deadline=None)
@given(text=st.text(alphabet=_ALPHABET, max_size=30), stops=_stops)
def test_never_emits_text_a_stop_string_could_still_claim(text, stops):
    """Fed one character at a time, everything emitted so far precedes the eventual hit."""
    expected_emit, expected_hit = reference(text, stops)
    m = StopStringMatcher(stops)
    emitted = ""
    for ch in text:
        emit, hit = m.feed(ch)
        emitted += emit
        assert expected_emit.startswith(emitted)
        if hit is not None:
            assert (emitted, hit) == (expected_emit, expected_hit)
            return
    assert expected_hit is None
    assert emitted + m.flush() == text


def test_hit_across_chunks_and_done_state():
    m = StopStringMatcher(["</answer>", "STOP"])
    assert m.feed("The answer is 4</ans") == ("The answer is 4", None)
    assert m.held == "</ans"
    assert m.feed("wer> trailing") == ("", "</answer>")
    assert m.done and m.hit == "</answer>"
    assert m.feed("more") == ("", None)


def test_false_start_is_released():
    m = StopStringMatcher(["\n\nUser:"])
    assert m.feed("line\n\nUs") == ("line", None)
    assert m.feed("ually fine") == ("\n\nUsually fine", None)
    assert m.flush() == ""


def test_no_stops_passes_through_and_bad_stops_rejected():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", None)
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher([""])
