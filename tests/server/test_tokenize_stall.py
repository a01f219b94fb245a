"""A huge prompt's tokenization must not stall other clients' streams.

One client streams a generation while another sends a 200k-character prompt, far more
text than the tiny model's context can hold whatever its tokens: the frontend refuses it
with `too_long` before tokenizing it at all (its byte bound), so the refusal comes in a
fraction of the time tokenizing it takes here, and the stream keeps flowing. (Prompts
under the bound are tokenized in worker threads: test_frontend_* covers those.)
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
    Done,
    Error,
    ErrorCode,
    Generate,
    Hello,
    Input,
    SamplingParams,
    Welcome,
    decode_server,
    encode,
)
from radixlm.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("pool_integrity")

HUGE = ("The quick brown fox jumps over the lazy dog. Hello world! 1234567890. " * 3000)[:200_000]


def _connect(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(encode(Hello(protocol_version=PROTOCOL_VERSION)))
    assert sock.poll(30_000) and isinstance(decode_server(sock.recv()), Welcome)
    return sock


def test_long_prompt_tokenization_does_not_stall_streams(server: Any, tiny_model_dir: Path) -> None:
    tok = Tokenizer.load(tiny_model_dir)
    t0 = time.perf_counter()
    tok.encode(HUGE)
    tokenize_s = time.perf_counter() - t0

    streamer, sender = _connect(server.endpoint), _connect(server.endpoint)
    try:
        streamer.send(encode(Generate(
            rid="stream", input=Input(text="Once upon a time"), stream=True,
            sampling=SamplingParams(max_tokens=240, temperature=0, ignore_eos=True))))
        assert streamer.poll(30_000)
        first = decode_server(streamer.recv())
        assert isinstance(first, Chunk)

        sent_at = time.perf_counter()
        sender.send(encode(Generate(rid="huge", input=Input(text=HUGE),
                                    sampling=SamplingParams(max_tokens=8))))
        arrivals = [sent_at]
        refused_at = None
        poller = zmq.Poller()
        poller.register(streamer, zmq.POLLIN)
        poller.register(sender, zmq.POLLIN)
        stream_done = False
        while refused_at is None or not stream_done:
            events = dict(poller.poll(30_000))
            assert events, "no reply within 30 s"
            now = time.perf_counter()
            if sender in events:
                reply = decode_server(sender.recv())
                assert isinstance(reply, Error) and reply.code == ErrorCode.TOO_LONG, reply
                refused_at = now
            if streamer in events:
                msg = decode_server(streamer.recv())
                if refused_at is None:
                    arrivals.append(now)
                stream_done = isinstance(msg, Done)
        assert refused_at is not None
        arrivals.append(refused_at)
        window = refused_at - sent_at  # from the prompt's arrival to its refusal
        assert window < tokenize_s, (window, tokenize_s)  # refused without tokenizing
        assert stream_done
    finally:
        streamer.close(linger=0)
        sender.close(linger=0)
