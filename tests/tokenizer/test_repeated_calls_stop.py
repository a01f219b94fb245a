"""Parallel tool calls end at the first repeat: `TokenStopMatcher` with a `CallParser`
over the call grammar's frame (as the engine builds it) against a reference built from the calls themselves.

Each example writes a list of calls (from a small set, so repeats happen) joined by the
separator, cuts the text into random tokens (so tokens straddle calls and separators,
as BPE merges do), and feeds them. The reference: the first call equal to an earlier
one starts at a known offset; the branch must end when the token completing it arrives,
keep exactly the tokens whose text ends at or before that offset, and never release one
past it. Without a repeat nothing is held back once the stream ends, and stop strings
the request gave still work beside the watch.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixlm.tokenizer import TokenStopMatcher
from radixlm.tokenizer.call_parser import CallParser
from radixlm.tokenizer.tools import call_frame, framed_format

SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))
CALLS = [json.dumps({"name": n, "arguments": a}, separators=(", ", ": "))
         for n in ("get_weather", "get_time")
         for a in ({"city": "Paris"}, {"city": "Par"}, {"city": "Oslo"}, {})]


class PieceTokenizer:
    """Token i is `pieces[i]`: decoding is concatenation."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)


def _tokens(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % len(text) for c in cuts} - {0})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@SETTINGS
@given(picks=st.lists(st.integers(0, len(CALLS) - 1), min_size=1, max_size=6),
       cuts=st.lists(st.integers(1, 10_000), max_size=60),
       fmt=st.sampled_from(["generic", "hermes"]))
def test_the_branch_ends_before_the_first_repeated_call(picks: list[int], cuts: list[int],
                                                        fmt: str) -> None:
    begin, end = call_frame(fmt)  # type: ignore[arg-type]
    calls = [begin + CALLS[i] + end for i in picks]
    text = "\n".join(calls)
    pieces = _tokens(text, cuts)
    ends = [sum(len(p) for p in pieces[: i + 1]) for i in range(len(pieces))]
    repeat = next((j for j in range(len(calls)) if calls[j] in calls[:j]), None)
    m = TokenStopMatcher(PieceTokenizer(pieces), [], (), calls=CallParser(framed_format(begin, end), None))
    if repeat is None:
        assert not any(m.feed([i]) for i in range(len(pieces)))
        assert not m.finish()
        assert m.released == len(pieces) and m.hit is None
        return
    start = len("\n".join(calls[:repeat])) + 1  # where the repeated call begins
    completed = next(i for i, e in enumerate(ends) if e >= start + len(calls[repeat]))
    for i in range(len(pieces)):
        hit = m.feed([i])
        assert hit == (i == completed), (i, completed)
        if hit:
            break
        assert m.released == 0 or ends[m.released - 1] <= start  # nothing of the repeat
    kept = sum(1 for e in ends if e <= start)
    assert (m.repeated, m.matched, m.kept, m.released, m.trim) == (True, None, kept, kept, 0)


def test_stop_strings_still_match_beside_the_watch() -> None:
    text = CALLS[0] + "\n" + CALLS[2] + "\nEND"
    pieces = list(text)
    m = TokenStopMatcher(PieceTokenizer(pieces), ["Oslo"], (), calls=CallParser(framed_format("", ""), None))
    assert any(m.feed([i]) for i in range(len(pieces)))
    assert (m.repeated, m.matched, m.hit) == (False, "Oslo", "Oslo")
    assert "".join(pieces[: m.kept]) == text[: text.index("Oslo")]
