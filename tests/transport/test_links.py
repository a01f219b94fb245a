"""The SDK's links to the engine: the native ZMTP DEALER (framing, heartbeats, tcp, big
messages, a vanished engine), the libzmq fallback, the loop thread sync calls go through,
and deferred session closes."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import pytest
import radixlm as rl
import zmq
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    ClientMessage,
    Hello,
    Tokenize,
    Tokens,
    Welcome,
)
from radixlm.runtime.transport.endpoints import parse_endpoint
from radixlm.runtime.transport.zmq_dealer import ZmqDealer
from radixlm.runtime.transport.zmtp import ZmtpDealer
from radixlm.sdk.loop_thread import LoopThread
from radixlm.testing import StubServer
from toy_stub import chars, text_of, toy_generate

PEER_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def command(name: bytes, body: bytes = b"") -> bytes:
    payload = bytes((len(name),)) + name + body
    return bytes((0x04, len(payload))) + payload


def frame(data: bytes, more: bool = False) -> bytes:
    flags = 0x01 if more else 0x00
    if len(data) < 256:
        return bytes((flags, len(data))) + data
    return bytes((flags | 0x02,)) + len(data).to_bytes(8, "big") + data


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


def feed(dealer: ZmtpDealer, stream: bytes, sizes: Iterator[int]) -> None:
    pos = 0
    while pos < len(stream):
        buf = dealer.get_buffer(-1)
        n = min(next(sizes), len(buf), len(stream) - pos)
        buf[:n] = stream[pos:pos + n]
        dealer.buffer_updated(n)
        pos += n


@pytest.mark.parametrize("chunk", [1, 3, 64, 1000, 0])
def test_zmtp_frames_survive_any_split(chunk: int) -> None:
    frames: list[bytes] = []
    dealer = ZmtpDealer(frames.append, lambda why: pytest.fail(why))
    transport = FakeTransport()
    dealer.connection_made(transport)
    assert transport.written[0][:11] == PEER_GREETING[:11]  # our greeting, then READY
    big = bytes(range(256)) * 300  # a long frame, bigger than the receive buffer
    stream = (PEER_GREETING + command(b"READY", b"\x0bSocket-Type\x00\x00\x00\x06ROUTER")
              + frame(b"short") + frame(big) + command(b"PING", b"\x00\x0actx")
              + frame(b"part1", more=True) + frame(b"part2") + frame(b""))
    rng = random.Random(chunk)
    sizes = iter(lambda: rng.randint(1, 5000) if chunk == 0 else chunk, None)
    feed(dealer, stream, sizes)
    assert frames == [b"short", big, b"part1", b"part2", b""]
    assert command(b"PONG", b"ctx") in transport.written  # the heartbeat answered
    dealer.send(b"x" * 300)
    assert transport.written[-1] == frame(b"x" * 300)


def test_zmtp_refuses_a_peer_that_is_not_zmtp3() -> None:
    lost: list[str] = []
    dealer = ZmtpDealer(lambda f: None, lost.append)
    dealer.connection_made(FakeTransport())
    feed(dealer, b"HTTP/1.1 400 Bad Request\r\n" + b" " * 64, iter(lambda: 100, None))
    assert lost and "ZMTP" in lost[0]


def native_endpoint(endpoint: str) -> Any:
    return parse_endpoint(endpoint).native


def test_native_endpoints() -> None:
    assert native_endpoint("ipc:///tmp/x.sock") == ("unix", "/tmp/x.sock")
    assert native_endpoint("ipc://@abstract") == ("unix", "\0abstract")
    assert native_endpoint("tcp://127.0.0.1:5555") == ("tcp", ("127.0.0.1", 5555))
    assert native_endpoint("tcp://[::1]:5555") == ("tcp", ("::1", 5555))
    assert native_endpoint("inproc://x") is None and native_endpoint("tcp://*:5") is None
    assert native_endpoint("tcp://10.0.0.1;10.0.0.2:5") is None  # libzmq's SOURCE;HOST


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    with StubServer() as server:
        yield server


def test_big_messages_both_ways(stub: StubServer) -> None:
    prompt = "".join(chr(97 + i % 26) for i in range(7800))  # ~8 KB out, ~70 KB back

    async def main() -> None:
        async with rl.AsyncClient(stub.endpoint) as client:
            assert isinstance(client._conn._link, ZmtpDealer)
            result = await client.generate(prompt, max_tokens=300, ignore_eos=True,
                                           prompt_logprobs_start=0, logprobs=True)
            assert result.token_ids == toy_generate(chars(prompt), 300, ignore_eos=True)
            assert len(result.prompt_logprobs) == len(prompt) - 1
            assert len(result.logprobs) == 300

    anyio.run(main)


def test_libzmq_fallback_link(stub: StubServer) -> None:
    async def main() -> None:
        client = rl.AsyncClient(stub.endpoint)
        client._conn.native = False
        async with client:
            assert isinstance(client._conn._link, ZmqDealer)
            result = await client.generate("Hello", max_tokens=5, ignore_eos=True)
            assert result.text == text_of(toy_generate(chars("Hello"), 5, ignore_eos=True))
            async with client.stream("abc", max_tokens=6, ignore_eos=True) as s:
                pieces = [d.text async for d in s]
            assert "".join(pieces) == s.result.text
            async with client.session() as chat:
                await chat.send("hi", max_tokens=2)
            assert (await client.stats())["sessions"] == 0

    anyio.run(main)


def test_a_vanished_engine_fails_calls_at_once() -> None:
    stub = StubServer().start()
    with rl.connect(stub.endpoint, heartbeat_timeout=30) as client:
        client.generate("ok", max_tokens=1)
        stub.stop()  # its socket closes: the connection drops
        start = time.monotonic()
        with pytest.raises(rl.EngineDeadError):
            for _ in range(100):  # the drop may land a moment after the close
                client.generate("hello?", max_tokens=1)
                time.sleep(0.01)
        assert time.monotonic() - start < 2


def _heartbeating_router(endpoint: str, stop: threading.Event) -> None:
    """A ROUTER that pings its peers every 50 ms and drops one silent for 200 ms: what
    the engine does on tcp (slower). Answers Hello and Tokenize."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 50)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 200)
    sock.bind(endpoint)
    decoder = msgspec.msgpack.Decoder(ClientMessage)
    encode = msgspec.msgpack.Encoder().encode
    try:
        while not stop.is_set():
            if not sock.poll(20):
                continue
            peer, data = sock.recv_multipart()
            msg: Any = decoder.decode(data)
            if isinstance(msg, Hello):
                reply: Any = Welcome(protocol_version=PROTOCOL_VERSION, server_version="hb",
                                     model="none", context_length=1, page_size=1, kv_capacity=1)
            else:
                assert isinstance(msg, Tokenize)
                reply = Tokens(rid=msg.rid, input_ids=[len(msg.input.text or "")])
            sock.send_multipart([peer, encode(reply)])
    finally:
        sock.close(linger=0)
        ctx.term()


def test_tcp_link_answers_heartbeats() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    stop = threading.Event()
    server = threading.Thread(target=_heartbeating_router, args=(endpoint, stop), daemon=True)
    server.start()
    try:
        async def main() -> None:
            async with rl.AsyncClient(endpoint, connect_timeout=5) as client:
                assert isinstance(client._conn._link, ZmtpDealer)
                await anyio.sleep(0.8)  # many pings later, still connected
                assert client.alive
                assert await client.tokenize("four") == [4]

        anyio.run(main)
    finally:
        stop.set()
        server.join(timeout=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loop_thread_calls_and_cancellation() -> None:
    loop = LoopThread("test-loop")
    try:
        async def double(x: int) -> int:
            await anyio.sleep(0)
            return 2 * x

        assert loop.call(double, 21) == 42
        started, cancelled = threading.Event(), threading.Event()

        async def forever() -> None:
            started.set()
            try:
                await anyio.sleep(30)
            except anyio.get_cancelled_exc_class():
                cancelled.set()
                raise

        future = loop.spawn(forever)
        assert started.wait(5)
        future.cancel()
        assert cancelled.wait(5)

        async def fails() -> None:
            raise KeyError("inside")

        with pytest.raises(KeyError):
            loop.call(fails)
    finally:
        loop.close()


def test_an_async_iterators_items_reach_another_thread_in_order() -> None:
    """`LoopThread.iterate`: the items in order, then the end; what the source raises is
    raised in the taking thread; closing while the source waits cancels it there (its
    cleanup runs before `close` returns)."""
    loop = LoopThread("test-loop")
    try:
        async def count(n: int, fail: bool = False):
            for i in range(n):
                await anyio.sleep(0)
                yield i
            if fail:
                raise KeyError("source")

        pump = loop.iterate(count(50))
        got = []
        while True:
            more, item = pump.take()
            if not more:
                break
            got.append(item)
        assert got == list(range(50))
        pump = loop.iterate(count(2, fail=True))
        assert pump.take() == (True, 0) and pump.take() == (True, 1)
        with pytest.raises(KeyError, match="source"):
            pump.take()
        cleaned = threading.Event()

        async def stalls():
            try:
                yield "first"
                await anyio.sleep(30)
                yield "never"
            finally:
                cleaned.set()

        pump = loop.iterate(stalls())
        assert pump.take() == (True, "first")
        pump.close()
        assert cleaned.is_set()
        # Closed from another thread while one waits in `take`: that one sees the end.
        cleaned.clear()
        pump = loop.iterate(stalls())
        assert pump.take() == (True, "first")
        taken: list[tuple[bool, object]] = []
        waiter = threading.Thread(target=lambda: taken.append(pump.take()), daemon=True)
        waiter.start()
        time.sleep(0.2)
        pump.close()
        waiter.join(5)
        assert taken == [(False, None)] and cleaned.is_set()
    finally:
        loop.close()


def test_closes_leave_on_their_own_when_nothing_else_is_sent(stub: StubServer) -> None:
    @rl.function
    def short(s):
        s += "Hi" + rl.gen("x", max_tokens=2, ignore_eos=True)

    with rl.connect(stub.endpoint) as client:
        before = stub.sessions
        short.run(backend=client)
        deadline = time.monotonic() + 2
        while stub.sessions > before and time.monotonic() < deadline:
            time.sleep(0.01)  # no request from us meanwhile: the close leaves on a timer
        assert stub.sessions == before
