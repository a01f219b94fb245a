"""The engine's stop-string matcher (tokenizer/stop.py `TokenStopMatcher`) against a
brute-force reference.

A toy vocabulary of short strings (some empty, as skipped special tokens are) makes the
reference exact and simple: a token prefix's text is the concatenation of its tokens'.
For random token streams and stop strings, the reference finds the first occurrence by
`str.find` over every stop string (the one complete first, the longest on a tie), and
the tokens a branch keeps are the fewest whose text reaches the stop's start. While no
stop has matched, every token is released except those whose text may still begin one
(the text's longest suffix that is a proper prefix of a stop string) and trailing empty
tokens. Then the real tiny tokenizer (byte-level BPE: characters split across tokens)
and the frontend's stream: what the engine sends concatenates to the Done's text.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixlm.runtime.engine.wire import TokenOutput
from radixlm.runtime.frontend.streams import RequestStream
from radixlm.runtime.protocol import SamplingParams
from radixlm.tokenizer import Tokenizer, TokenStopMatcher

VOCAB = ["a", "b", "c", "ab", "ba", "bc", "abc", "", " ", "ca", "cab"]
SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


class ToyTokenizer:
    """Decode is concatenation: the reference needs no detokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids)


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(start, stop) of the occurrence that is complete first; the longest on a tie."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0], -len(best[2]))):
            best = (i + len(s), i, s)
    return None if best is None else (best[1], best[2])


def held_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    return max((k for k in range(1, len(text) + 1)
                for s in stops if len(s) > k and s.startswith(text[-k:])), default=0)


def text_ends(texts: list[str]) -> list[float]:
    """Where each token's text ends. A token with no text of its own (a skipped special
    token; in a real vocabulary also a piece of a character) ends where the next text
    does, and never while none has followed."""
    ends: list[float] = []
    pos = 0
    for j, t in enumerate(texts):
        nxt = next((k for k in range(j, len(texts)) if texts[k]), None)
        ends.append(float("inf") if nxt is None else pos + len("".join(texts[j:nxt + 1])))
        pos += len(t)
    return ends


tokens = st.lists(st.integers(0, len(VOCAB) - 1), max_size=30)
stop_strings = st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=3)


@SETTINGS
@given(ids=tokens, stops=stop_strings, steps=st.lists(st.integers(1, 4), max_size=30))
def test_matcher_agrees_with_brute_force(ids: list[int], stops: list[str],
                                         steps: list[int]) -> None:
    m = TokenStopMatcher(ToyTokenizer(), stops)
    texts = [VOCAB[i] for i in ids]
    fed, hit = 0, False
    steps = steps or [1]
    while fed < len(ids) and not hit:
        n = min(len(ids), fed + steps[fed % len(steps)])
        hit = m.feed(ids[fed:n])
        fed = n
        text = "".join(texts[:fed])
        ref = first_stop(text, stops)
        if ref is not None:
            break
        assert not hit
        emitted = len(text) - held_suffix(text, stops)
        released = sum(1 for e in text_ends(texts[:fed]) if e <= emitted)
        assert m.released == released, (text, stops)
    full = "".join(texts)
    if not hit:
        hit = m.finish()
    ref = first_stop("".join(texts[:fed]) if hit else full, stops)
    assert hit == (ref is not None)
    if ref is None:
        assert m.released == len(ids) and m.hit is None and m.trim == 0
        return
    start, stop = ref
    kept = min(k for k in range(len(ids) + 1) if len("".join(texts[:k])) >= start)
    assert (m.hit, m.kept, m.released) == (stop, kept, kept)
    assert m.trim == len("".join(texts[:kept])) - start


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


TEXT = "Hello world! naïve café ✓ 日本語, then a stop: ENDE and more text after it."


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_what_the_engine_sends_concatenates_to_the_done(tok: Tokenizer, data: st.DataObject) -> None:
    """Engine side: feed the matcher token by token, send what it releases, the rest at
    the end with `text_trim`. Frontend side: a `RequestStream` turns that into chunks and
    a Done. The chunks concatenate to the Done, which is the text before the stop."""
    context = tok.encode("prompt:")
    ids = tok.encode(TEXT)
    full = tok.backend.decode(context + ids)[len(tok.backend.decode(context)):]
    start = data.draw(st.integers(0, len(full) - 1), label="stop starts at")
    stop = full[start:start + data.draw(st.integers(1, 5), label="stop length")]
    at = full.find(stop)
    m = TokenStopMatcher(tok, [stop], context)
    stream = RequestStream(1, b"c", "r", stream=True, n=1, sampling=SamplingParams(),
                           session=None, tokenizer=tok)
    stream.prepared(context)
    chunks, done, sent = [], None, 0
    for i in range(len(ids)):
        if m.feed(ids[i:i + 1]):
            break
        if m.released > sent:
            chunk, _ = stream.on_output(TokenOutput(key=1, token_ids=ids[sent:m.released]))
            sent = m.released
            chunks += [chunk] if chunk is not None else []
    else:
        m.finish()
    end = m.kept if m.hit is not None else len(ids)
    chunk, done = stream.on_output(TokenOutput(key=1, token_ids=ids[sent:end],
                                               finish_reason="stop", text_trim=m.trim))
    chunks += [chunk] if chunk is not None else []
    assert done is not None and m.hit == stop
    assert done.text == full[:at] == "".join(c.text for c in chunks)
    assert done.token_ids == ids[:end] == [t for c in chunks for t in c.token_ids]
    # The kept tokens are the fewest whose text covers what precedes the stop.
    covers = [k for k in range(len(ids) + 1)
              if tok.backend.decode(context + ids[:k])[len(tok.backend.decode(context)):]
              .startswith(full[:at])]
    assert end == covers[0]
