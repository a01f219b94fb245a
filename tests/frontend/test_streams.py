"""The frontend's output assembly (runtime/frontend/streams.py), without processes.

Token outputs are fed as the engine would send them; the reference is independent:
`tokenizers`' own decode of the whole output. Text includes multi-byte characters, which
the tiny byte-level BPE splits across tokens. Stop strings are the engine's (their tests
are tokenizer/test_stop_matcher.py): here only the last output's `text_trim` is applied.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixlm.runtime.engine.wire import TokenOutput
from radixlm.runtime.frontend.streams import RequestStream
from radixlm.runtime.frontend.structured import CallReader
from radixlm.runtime.protocol import Chunk, Done, SamplingParams, Tool, Usage
from radixlm.tokenizer import Tokenizer

TEXT = "Hello world! The quick brown fox — naïve café ✓ 日本語 jumps; tools are called with JSON.\n\nEnd."


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


def reference_text(tok: Tokenizer, ids: list[int]) -> str:
    return tok.backend.decode(ids, skip_special_tokens=True)


def make_stream(tok: Tokenizer, *, stream: bool = True, n: int = 1, calls=None,  # noqa: ANN001
                **sampling: object) -> RequestStream:
    s = RequestStream(7, b"client", "r1", stream=stream, n=n,
                      sampling=SamplingParams(**sampling), session=None,  # type: ignore[arg-type]
                      tokenizer=tok, calls=calls)
    s.prepared(tok.encode("prompt"))
    return s


def feed(s: RequestStream, ids: list[int], cuts: list[int], reason: str = "length",
         index: int = 0, **last: object) -> tuple[list[Chunk], Done | None]:
    """Feed `ids` split at `cuts`; the last piece carries the finish (and `last`'s
    fields). Returns (chunks, done)."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    chunks, done = [], None
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        final = i == len(bounds) - 2
        out = TokenOutput(key=7, token_ids=ids[a:b], index=index,
                          finish_reason=reason if final else None,
                          usage=Usage(prompt_tokens=1, cached_tokens=0, completion_tokens=len(ids))
                          if final else None, **(last if final else {}))  # type: ignore[arg-type]
        chunk, d = s.on_output(out)
        if chunk is not None:
            chunks.append(chunk)
        if d is not None:
            done = d
    return chunks, done


SETTINGS = settings(max_examples=40, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@SETTINGS
@given(cuts=st.lists(st.integers(0, 80), max_size=12))
def test_chunks_concatenate_to_done_and_match_decode(tok: Tokenizer, cuts: list[int]) -> None:
    ids = tok.encode(TEXT) + [2]  # ends with EOS, which the text leaves out
    s = make_stream(tok)
    chunks, done = feed(s, ids, cuts, reason="stop")
    assert done is not None
    assert done.text == reference_text(tok, ids)
    assert done.token_ids == ids
    assert "".join(c.text for c in chunks) == done.text
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    assert done.finish_reason == "stop" and done.usage.completion_tokens == len(ids)
    assert "\ufffd" not in "".join(c.text for c in chunks)  # no broken UTF-8 on the way


@SETTINGS
@given(data=st.data())
def test_the_stop_strings_start_is_trimmed_off_the_last_output(tok: Tokenizer,
                                                               data: st.DataObject) -> None:
    """The engine ends a branch on a stop string keeping the tokens up to the one it
    starts in; the last output's `text_trim` drops the stop's start from the text."""
    ids = tok.encode(TEXT)
    full = reference_text(tok, ids)
    whole = [k for k in range(1, len(ids) + 1) if full.startswith(reference_text(tok, ids[:k]))]
    kept = data.draw(st.sampled_from(whole), label="kept tokens (never inside a character)")
    text = reference_text(tok, ids[:kept])
    trim = data.draw(st.integers(0, max(0, len(text) - len(reference_text(tok, ids[:kept - 1])))),
                     label="trim")
    cuts = data.draw(st.lists(st.integers(0, kept), max_size=6), label="cuts")
    s = make_stream(tok)
    chunks, done = feed(s, ids[:kept], cuts, reason="stop", text_trim=trim, matched_stop="x")
    assert done is not None and done.finish_reason == "stop" and done.matched_stop == "x"
    assert done.text == text[: len(text) - trim] == "".join(c.text for c in chunks)
    assert full.startswith(done.text)
    assert done.token_ids == ids[:kept] == [t for c in chunks for t in c.token_ids]


def test_branches_are_independent(tok: Tokenizer) -> None:
    a, b = tok.encode("first branch text"), tok.encode("second one, longer than the first")
    s = make_stream(tok, n=2)
    _, done_b = feed(s, b, [3, 5], index=1, session="s1", session_length=40)
    _, done_a = feed(s, a, [1, 2], index=0, session="s0", session_length=30)
    assert s.remaining == 0
    assert done_a is not None and done_b is not None
    assert (done_a.index, done_a.text, done_a.session, done_a.session_length) == (
        0, "first branch text", "s0", 30)  # the engine's figures, as they are
    assert (done_b.index, done_b.text, done_b.session, done_b.session_length) == (
        1, "second one, longer than the first", "s1", 40)


def test_logprobs_follow_the_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma")
    s = make_stream(tok, logprobs=True)
    done = None
    for i, t in enumerate(ids):
        _, done = s.on_output(TokenOutput(key=7, token_ids=[t], logprobs=[-float(i)],
                                          finish_reason="length" if i == len(ids) - 1 else None))
    assert done is not None and done.logprobs is not None
    assert done.logprobs == [-float(i) for i in range(len(done.token_ids))]


def test_no_stream_sends_no_chunks(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    s = make_stream(tok, stream=False)
    chunks, done = feed(s, ids, [2, 9])
    assert chunks == [] and done is not None and done.text == TEXT


CALLS_TEXT = ('Checking — ✓ <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "ü"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>\nthen naïve text')


@SETTINGS
@given(cuts=st.lists(st.integers(0, 120), max_size=12), stream=st.booleans())
def test_calls_are_read_as_the_text_streams(tok: Tokenizer, cuts: list[int], stream: bool) -> None:
    """With a call reader, chunks carry the text outside calls and the calls' pieces; the
    Done lists the complete calls with the ids the pieces gave them. Reference: the calls
    written in CALLS_TEXT."""
    ids = tok.encode(CALLS_TEXT)
    s = make_stream(tok, stream=stream, calls=lambda: CallReader("hermes", [Tool(name="add")], True))
    chunks, done = feed(s, ids, cuts, reason="stop")
    assert done is not None and done.text == CALLS_TEXT  # the raw output, as ever
    assert done.tool_calls is not None
    assert [(c.name, c.arguments) for c in done.tool_calls] == [
        ("add", '{"a": 1, "b": "ü"}'), ("add", '{"a": 2}')]
    if not stream:
        assert chunks == []
        return
    assert "".join(c.text for c in chunks) == CALLS_TEXT
    assert all(c.content is not None for c in chunks)
    assert "".join(c.content or "" for c in chunks) == "Checking — ✓ then naïve text"
    pieces = [p for c in chunks for p in c.tool_calls or []]
    assert [p.id for p in pieces if p.id] == [c.id for c in done.tool_calls]
    for i, call in enumerate(done.tool_calls):
        assert "".join(p.arguments for p in pieces if p.index == i) == call.arguments
