"""The frontend's output assembly (runtime/frontend/streams.py), without processes.

Token outputs are fed as the engine would send them; the references are independent:
`tokenizers`' own decode of the whole output and ``str.find`` for stop strings. Text
includes multi-byte characters, which the tiny byte-level BPE splits across tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixlm.runtime.engine.messages import TokenOutput
from radixlm.runtime.frontend.streams import RequestStream
from radixlm.runtime.protocol import Chunk, Done, SamplingParams, Usage
from radixlm.tokenizer import Tokenizer

TEXT = "Hello world! The quick brown fox — naïve café ✓ 日本語 jumps; tools are called with JSON.\n\nEnd."


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


def reference_text(tok: Tokenizer, ids: list[int]) -> str:
    return tok.backend.decode(ids, skip_special_tokens=True)


def make_stream(tok: Tokenizer, *, stream: bool = True, n: int = 1, **sampling: object) -> RequestStream:
    s = RequestStream(7, b"client", "r1", stream=stream, n=n,
                      sampling=SamplingParams(**sampling), session=None,  # type: ignore[arg-type]
                      tokenizer=tok)
    s.prepared(tok.encode("prompt"))
    return s


def feed(s: RequestStream, ids: list[int], cuts: list[int], reason: str = "length",
         index: int = 0) -> tuple[list[Chunk], list[object], Done | None]:
    """Feed `ids` split at `cuts`; the last piece carries the finish. Returns (chunks,
    finish_ats, done)."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    chunks, finish_ats, done = [], [], None
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        last = i == len(bounds) - 2
        out = TokenOutput(key=7, token_ids=ids[a:b], index=index,
                          finish_reason=reason if last else None,
                          usage=Usage(prompt_tokens=1, cached_tokens=0, completion_tokens=len(ids))
                          if last else None)
        chunk, finish_at, d = s.on_output(out)
        if chunk is not None:
            chunks.append(chunk)
        if finish_at is not None:
            finish_ats.append(finish_at)
        if d is not None:
            done = d
    return chunks, finish_ats, done


def shortest_cover(tok: Tokenizer, ids: list[int], text: str) -> int:
    """Fewest leading tokens whose text starts with `text` (a character split over
    several tokens counts once all of them are in)."""
    return next(k for k in range(len(ids) + 1) if reference_text(tok, ids[:k]).startswith(text))


SETTINGS = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@SETTINGS
@given(cuts=st.lists(st.integers(0, 80), max_size=12))
def test_chunks_concatenate_to_done_and_match_decode(tok: Tokenizer, cuts: list[int]) -> None:
    ids = tok.encode(TEXT) + [2]  # ends with EOS, which the text leaves out
    s = make_stream(tok)
    chunks, finish_ats, done = feed(s, ids, cuts, reason="stop")
    assert done is not None and not finish_ats
    assert done.text == reference_text(tok, ids)
    assert done.token_ids == ids
    assert "".join(c.text for c in chunks) == done.text
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    assert done.finish_reason == "stop" and done.usage.completion_tokens == len(ids)
    assert "\ufffd" not in "".join(c.text for c in chunks)  # no broken UTF-8 on the way


@SETTINGS
@given(data=st.data())
def test_stop_string_across_chunks_is_never_emitted(tok: Tokenizer, data: st.DataObject) -> None:
    ids = tok.encode(TEXT)
    full = reference_text(tok, ids)
    start = data.draw(st.integers(0, len(full) - 2), label="stop starts at")
    length = data.draw(st.integers(1, min(6, len(full) - start)), label="stop length")
    stop = full[start:start + length]
    pos = full.find(stop)  # the earliest occurrence is the one that must stop the stream
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=10), label="cuts")

    s = make_stream(tok, stop=[stop])
    chunks, finish_ats, done = feed(s, ids, cuts)
    streamed = "".join(c.text for c in chunks)
    keep = shortest_cover(tok, ids, full[:pos])

    assert done is not None
    assert done.finish_reason == "stop" and done.matched_stop == stop
    assert done.text == full[:pos] == streamed
    assert stop not in streamed
    assert done.token_ids == ids[:keep] == [t for c in chunks for t in c.token_ids]
    assert done.usage.completion_tokens == keep
    # The engine is told once, with the same cut, unless the match came with the finish.
    assert [f.keep_tokens for f in finish_ats] in ([keep], [])
    assert all(f.matched_stop == stop and f.key == 7 for f in finish_ats)


def test_tokens_after_the_stop_are_dropped(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta STOP gamma delta")
    s = make_stream(tok, stop=["STOP"])
    texts, finish_ats = [], []
    for t in ids:  # one token per step, never finishing: the engine learns of the stop late
        chunk, finish_at, done = s.on_output(TokenOutput(key=7, token_ids=[t]))
        assert done is None
        texts.append(chunk.text if chunk else "")
        if finish_at is not None:
            finish_ats.append(finish_at)
    assert len(finish_ats) == 1
    # The engine's last output (after the EngineFinishAt) turns into the stop's Done.
    _, again, done = s.on_output(TokenOutput(key=7, token_ids=[], finish_reason="stop",
                                             matched_stop="STOP"))
    assert again is None and done is not None
    assert "".join(texts) == done.text == "alpha beta "
    assert done.token_ids == ids[:finish_ats[0].keep_tokens]
    assert reference_text(tok, done.token_ids).startswith("alpha beta ")


def test_earliest_completed_stop_wins(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four")
    s = make_stream(tok, stop=["three four", "two"])
    _, _, done = feed(s, ids, list(range(len(ids))))
    assert done is not None and done.matched_stop == "two" and done.text == "one "


def test_branches_are_independent(tok: Tokenizer) -> None:
    a, b = tok.encode("first branch text"), tok.encode("second one, longer than the first")
    s = make_stream(tok, n=2, stop=["one"])
    _, _, done_b = feed(s, b, [3, 5], index=1)
    _, _, done_a = feed(s, a, [1, 2], index=0)
    assert s.remaining == 0
    assert done_a is not None and done_b is not None
    assert (done_a.index, done_a.text, done_a.finish_reason) == (0, "first branch text", "length")
    assert (done_b.index, done_b.text, done_b.finish_reason) == (1, "second ", "stop")


def test_logprobs_follow_the_kept_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta STOP gamma")
    s = make_stream(tok, stop=["STOP"], logprobs=True)
    done = None
    for i, t in enumerate(ids):
        _, _, done = s.on_output(TokenOutput(key=7, token_ids=[t], logprobs=[-float(i)],
                                             finish_reason="length" if i == len(ids) - 1 else None))
    assert done is not None and done.logprobs is not None
    assert done.logprobs == [-float(i) for i in range(len(done.token_ids))]


def test_no_stream_sends_no_chunks(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    s = make_stream(tok, stream=False, stop=["fox"])
    chunks, _, done = feed(s, ids, [2, 9])
    assert chunks == [] and done is not None and done.text == TEXT[:TEXT.find("fox")]
