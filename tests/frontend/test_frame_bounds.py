"""Bounded input: frames over --max-message-bytes are dropped by libzmq before they are
buffered (the client sees its connection closed; other clients are unaffected), the SDK
refuses such a request itself with a clear error, and text that cannot fit the context
is refused as too_long before it is tokenized."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import radixlm as rl
import zmq
from radixlm.runtime.frontend.prepare import TextModel, max_token_bytes
from radixlm.runtime.protocol import ErrorCode, Generate, Hello, Input, Message, encode
from radixlm.runtime.rules import RequestError, check_input_size
from radixlm.tokenizer import Tokenizer
from zmq.utils.monitor import recv_monitor_message

from tests.conftest import ServerHandle, start_test_server

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def small_frames_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):  # noqa: ANN201
    with start_test_server(tmp_path_factory.mktemp("frames"), tiny_model_dir,
                           "--max-message-bytes", str(LIMIT)) as handle:
        yield handle


def test_welcome_states_the_limit(small_frames_server: ServerHandle) -> None:
    assert small_frames_server.welcome.max_message_bytes == LIMIT


def test_an_oversized_frame_closes_only_its_connection(small_frames_server: ServerHandle) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(small_frames_server.endpoint)
        sock.send(encode(Hello(protocol_version=1)))
        assert sock.poll(30_000)
        sock.recv()  # the Welcome
        big = encode(Generate(rid="big", input=Input(text="x" * (LIMIT * 2))))
        started = time.monotonic()
        sock.send(big)
        assert monitor.poll(10_000), "the server kept a connection that sent an oversized frame"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert time.monotonic() - started < 5
        assert not sock.poll(200)  # and it never answered it
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
        ctx.term()
    with small_frames_server.client() as other:  # everyone else is served as before
        done = other.generate(Input(text="hi"), max_tokens=2, temperature=0.0)
        assert done.finish_reason == "length"


def test_sdk_refuses_an_oversized_request_itself(small_frames_server: ServerHandle) -> None:
    with rl.connect(small_frames_server.endpoint) as client:
        with pytest.raises(rl.TooLongError, match="max-message-bytes"):
            client.generate("x" * (LIMIT * 2), max_tokens=1)
        assert client.generate("hi", max_tokens=2, temperature=0).text is not None  # still usable


def test_text_too_long_for_any_tokenization_is_refused_at_once(
        small_frames_server: ServerHandle) -> None:
    context = small_frames_server.welcome.context_length
    with small_frames_server.client() as client:
        with pytest.raises(rl.TooLongError) as refused:  # the engine's error, typed
            client.generate(Input(text="ab" * 30_000), max_tokens=1)  # 60 kB < LIMIT
        assert refused.value.code == ErrorCode.TOO_LONG
        assert str(context) in refused.value.message


def test_the_bound_never_refuses_a_text_that_fits(tiny_model_dir: Path) -> None:
    """Reference: the tokenizer itself. Texts made of random vocabulary entries, around the
    bound in size: every text check_input_size refuses must tokenize to more tokens than
    the context holds."""
    tokenizer = Tokenizer.load(tiny_model_dir)
    context = 8
    model = TextModel.load(tokenizer, context, tokenizer.vocab_size)
    assert model.max_input_bytes >= context * max_token_bytes(tokenizer)
    vocab = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    rng = random.Random(0)
    refused = 0
    for _ in range(300):
        text = ""
        target = rng.randrange(model.max_input_bytes // 2, model.max_input_bytes * 2)
        while len(text.encode("utf-8", "surrogatepass")) < target:
            text += rng.choice(vocab)
        try:
            check_input_size(Input(text=text), model.max_input_bytes, context)
        except RequestError as e:
            assert e.code == ErrorCode.TOO_LONG
            assert len(tokenizer.encode(text, add_special_tokens=True)) > context, text
            refused += 1
    assert refused > 50
    with pytest.raises(RequestError):  # messages count too; ids beyond the context as well
        check_input_size(Input(messages=[Message(role="user", content="x" * 10**6)]),
                         model.max_input_bytes, context)
    with pytest.raises(RequestError):
        check_input_size(Input(input_ids=[1] * (context + 1)), model.max_input_bytes, context)
