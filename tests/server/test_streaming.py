"""Streaming through the real frontend and engine (tiny model, CPU).

References: `tokenizers`' own decode of the returned ids for text, the non-streamed
result of the same greedy request for streams, and ``str.find`` on that text for stop
strings.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    Chunk,
    CloseSession,
    Done,
    Generate,
    Hello,
    Input,
    OpenSession,
    SamplingParams,
    SessionOpened,
    Welcome,
    decode_server,
    encode,
)
from radixlm.runtime.transport.raw_client import RawClient
from radixlm.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("pool_integrity")

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_model_dir)


def streamed(client: RawClient, prompt: str, **sampling: Any) -> tuple[list[Chunk], Done]:
    chunks: list[Chunk] = []
    done = client.generate(prompt, stream=True, on_chunk=chunks.append, **sampling)
    return chunks, done


def test_streamed_equals_non_streamed(raw_client: RawClient, tok: Tokenizer) -> None:
    whole = raw_client.generate(PROMPT, max_tokens=24, **GREEDY)
    chunks, done = streamed(raw_client, PROMPT, max_tokens=24, **GREEDY)
    assert done.token_ids == whole.token_ids and done.text == whole.text
    assert len(done.token_ids) == 24 and done.finish_reason == "length"
    assert whole.text == tok.backend.decode(whole.token_ids, skip_special_tokens=True)
    assert "".join(c.text for c in chunks) == done.text
    assert [t for c in chunks for t in c.token_ids] == done.token_ids
    assert len(chunks) > 1 and done.usage.completion_tokens == 24


def test_stop_string_across_chunks(raw_client: RawClient, tok: Tokenizer) -> None:
    reference = raw_client.generate(PROMPT, max_tokens=40, **GREEDY)
    ids, text = reference.token_ids, reference.text
    # A stop string that straddles two tokens (so two chunks), first occurring there.
    pieces = [tok.backend.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    candidates = [
        (pieces[k + 1][len(pieces[k]) - left: len(pieces[k]) + right], len(pieces[k]) - left)
        for left, right in ((2, 2), (1, 2), (2, 1), (1, 1))
        for k in range(2, len(ids) - 1)
        if len(pieces[k]) >= left and pieces[k + 1].startswith(pieces[k])
        and len(pieces[k + 1]) >= len(pieces[k]) + right
    ]
    stop, pos = next(((c, p) for c, p in candidates
                      if "\ufffd" not in c and text.find(c) == p), (None, -1))
    assert stop is not None, f"no stop string candidate in {text!r}"

    chunks, done = streamed(raw_client, PROMPT, max_tokens=40, stop=[stop], **GREEDY)
    emitted = "".join(c.text for c in chunks)
    assert done.finish_reason == "stop" and done.matched_stop == stop
    assert done.text == text[:pos] == emitted
    assert stop not in emitted
    # Kept tokens: the shortest prefix of the reference output that holds the text.
    keep = next(k for k in range(len(ids) + 1) if pieces[k].startswith(text[:pos]))
    assert done.token_ids == ids[:keep] == [t for c in chunks for t in c.token_ids]
    assert done.usage.completion_tokens == keep


def test_session_history_ends_where_a_late_stop_string_cut_it(raw_client: RawClient,
                                                              tok: Tokenizer) -> None:
    """A stop string that only shows in the turn's last token: the engine has finished
    the turn (all tokens in the history) before the frontend sees the match. The history
    must still end where the Done says, token-exactly."""
    c = raw_client

    def turn(max_tokens: int, **sampling: Any) -> tuple[str, Done]:
        opened = c.call(OpenSession(rid=c.new_rid("open")))
        assert isinstance(opened, SessionOpened)
        done = c.generate(PROMPT, session=opened.session, max_tokens=max_tokens, **GREEDY,
                          **sampling)
        return opened.session, done

    first, reference = turn(16)
    c.call(CloseSession(rid="close-ref", session=first))
    ids = reference.token_ids
    pieces = [tok.backend.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    # A length n whose last token starts a stop string seen nowhere before it.
    usable = [(n, pieces[n][len(pieces[n - 1]):][:3]) for n in range(4, len(ids) + 1)]
    usable = [(n, stop) for n, stop in usable if stop and "\ufffd" not in stop
              and pieces[n - 1] == pieces[n][:len(pieces[n - 1])]
              and pieces[n].find(stop) == len(pieces[n - 1])]
    assert usable, f"no usable stop string in {reference.text!r}"
    n, stop = usable[0]

    session, done = turn(n, stop=[stop])
    assert done.finish_reason == "stop" and done.token_ids == ids[:n - 1]
    assert done.session_length == done.usage.prompt_tokens + n - 1
    lengths = {s.session: s.length for s in c.list_sessions()}
    assert lengths[session] == done.session_length
    # The next turn finds exactly that history, all of it cached.
    nxt = c.generate(Input(input_ids=[5]), session=session, max_tokens=1, **GREEDY)
    assert nxt.usage.prompt_tokens == done.session_length + 1
    assert nxt.usage.cached_tokens == done.session_length
    c.call(CloseSession(rid="close", session=session))


def test_concurrent_streams_interleave_and_stay_whole(server: Any) -> None:
    """Five streaming requests from two clients at once: every stream arrives whole and
    in order, and the streams interleave (they run together, not one after another)."""
    ctx = zmq.Context.instance()
    socks = []
    try:
        for _ in range(2):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(server.endpoint)
            s.send(encode(Hello(protocol_version=PROTOCOL_VERSION)))
            socks.append(s)
        for s in socks:
            assert s.poll(30_000) and isinstance(decode_server(s.recv()), Welcome)
        jobs = {(0, "a"): 12, (0, "b"): 16, (0, "c"): 20, (1, "d"): 14, (1, "e"): 18}
        for (i, rid), n in jobs.items():
            socks[i].send(encode(Generate(rid=rid, input=Input(text=f"{PROMPT} {rid}"),
                                          sampling=SamplingParams(max_tokens=n, **GREEDY),
                                          stream=True)))
        arrivals: list[str] = []
        chunks: dict[str, list[Chunk]] = {rid: [] for _, rid in jobs}
        dones: dict[str, Done] = {}
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + 60
        while len(dones) < len(jobs):
            assert time.monotonic() < deadline, f"streams incomplete: {sorted(dones)}"
            for s, _ in poller.poll(1000):
                msg = decode_server(s.recv())
                if isinstance(msg, Chunk):
                    chunks[msg.rid].append(msg)
                    arrivals.append(msg.rid)
                else:
                    assert isinstance(msg, Done), msg
                    dones[msg.rid] = msg
        for (_, rid), n in jobs.items():
            done = dones[rid]
            assert len(done.token_ids) == n
            assert [t for c in chunks[rid] for t in c.token_ids] == done.token_ids
            assert "".join(c.text for c in chunks[rid]) == done.text
        switches = sum(a != b for a, b in zip(arrivals, arrivals[1:], strict=False))
        assert switches >= len(jobs), f"streams did not interleave: {arrivals}"
    finally:
        for s in socks:
            s.close(linger=0)
