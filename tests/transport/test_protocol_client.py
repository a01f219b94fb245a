"""The one protocol-client core (runtime/transport/client.py, exchange.py, endpoints.py):
one endpoint parser for every reader, one set of request rules for the async and the
blocking clients, heartbeats on every libzmq client socket, and the HTTP process's link
being the same client as the SDK's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import radixlm as rl
import zmq
from radixlm.runtime.http.engine_link import EngineLink
from radixlm.runtime.protocol import (
    Chunk,
    CloseSession,
    Done,
    Error,
    ErrorCode,
    Generate,
    Input,
    Ok,
    SamplingParams,
    Tokenize,
    Tokens,
    Usage,
)
from radixlm.runtime.router.config import parse_replica
from radixlm.runtime.transport import errors
from radixlm.runtime.transport.channel import check_client_endpoint
from radixlm.runtime.transport.client import ProtocolClient
from radixlm.runtime.transport.endpoints import EndpointError, parse_endpoint
from radixlm.runtime.transport.exchange import Replies, Rids
from radixlm.runtime.transport.probe import probe_endpoint
from radixlm.runtime.transport.raw_client import RawClient
from radixlm.testing import StubServer
from toy_stub import chars, toy_generate

# What each text is, written out by hand from the syntax (docs/protocol.md: ipc://PATH,
# tcp://HOST:PORT): (scheme, path, host, port), or None for no endpoint.
SYNTAX: list[tuple[str, tuple[str, str, str, int] | None]] = [
    ("ipc:///run/x.sock", ("ipc", "/run/x.sock", "", 0)),
    ("ipc://@abstract", ("ipc", "@abstract", "", 0)),
    ("tcp://127.0.0.1:5555", ("tcp", "", "127.0.0.1", 5555)),
    ("tcp://[::1]:0", ("tcp", "", "::1", 0)),
    ("tcp://example.com:65535", ("tcp", "", "example.com", 65535)),
    ("localhost:5555", None),
    ("http://localhost:8000", None),
    ("ipc://", None),
    ("tcp://::1:5555", None),
    ("tcp://127.0.0.1", None),
    ("tcp://:5555", None),
    ("tcp://127.0.0.1:65536", None),
    ("tcp://user@127.0.0.1:5555", None),
    ("tcp://127.0.0.1:5555/path", None),
    ("udp://127.0.0.1:5555", None),
]


@pytest.mark.parametrize(("text", "expected"), SYNTAX)
def test_one_parser_reads_every_endpoint(text: str, expected: Any) -> None:
    if expected is None:
        with pytest.raises(EndpointError):
            parse_endpoint(text)
        return
    parsed = parse_endpoint(text)
    assert (parsed.scheme, parsed.path, parsed.host, parsed.port) == expected
    assert parse_endpoint(parsed.address) == parsed  # written back, read the same


@pytest.mark.parametrize("text", [t for t, e in SYNTAX if e is None])
def test_every_reader_refuses_what_is_no_endpoint(text: str) -> None:
    """The SDK, the blocking client, a server's bind rules and the router's replica list
    all refuse it before any socket exists; the probe leaves it to them."""
    with pytest.raises(ValueError, match="cannot connect"):
        rl.AsyncClient(text)
    with pytest.raises(EndpointError, match="cannot connect"):
        RawClient(text)
    with pytest.raises(EndpointError):
        check_client_endpoint(text, insecure=True)
    with pytest.raises(ValueError, match="replica"):
        parse_replica(text)
    probe_endpoint(text)  # not probed: nothing is said about a server


def test_the_hint_names_the_endpoint_meant() -> None:
    with pytest.raises(EndpointError, match="did you mean 'tcp://localhost:30000'"):
        parse_endpoint("localhost:30000")
    with pytest.raises(EndpointError, match="ZeroMQ, not HTTP"):
        parse_endpoint("https://localhost:30000")
    with pytest.raises(EndpointError, match=r"tcp://\[::1\]:5555"):
        parse_endpoint("tcp://::1:5555")


def test_native_targets() -> None:
    assert parse_endpoint("ipc://@abstract").native == ("unix", "\0abstract")
    assert parse_endpoint("tcp://[::1]:7").native == ("tcp", ("::1", 7))
    assert parse_endpoint("inproc://x").native is None  # libzmq's own
    assert parse_endpoint("tcp://*:7").native is None


def _done(index: int) -> Done:
    return Done(rid="g", index=index, text="", token_ids=[], finish_reason="stop",
                usage=Usage(prompt_tokens=1, completion_tokens=0, cached_tokens=0))


def test_a_generate_ends_with_its_n_dones_by_index() -> None:
    replies = Replies("g", branches=3)
    for reply in (Chunk(rid="g", text="a", token_ids=[1], index=2), _done(2), _done(0)):
        assert replies.take(reply) is reply and not replies.finished
    replies.take(_done(1))
    assert replies.finished
    assert [d.index for d in replies.sorted_dones()] == [0, 1, 2]


def test_an_error_ends_a_request_as_its_typed_exception() -> None:
    replies = Replies("g", branches=4)
    replies.take(_done(0))
    with pytest.raises(errors.BusyError, match="try later"):
        replies.take(Error(rid="g", code=ErrorCode.BUSY, message="try later"))
    assert replies.finished


def test_one_answer_ends_any_other_request() -> None:
    replies = Replies("t")
    replies.take(Tokens(rid="t", input_ids=[1]))
    assert replies.finished
    refused = Replies("g", branches=0)  # n < 1: the engine's refusal ends it
    assert not refused.finished


def test_request_ids_are_unused() -> None:
    rids = Rids("h{")  # a prefix is taken as it is, braces too
    made = [rids.new() for _ in range(1000)] + [rids.with_prefix("x") for _ in range(1000)]
    assert len(set(made)) == 2000
    assert made[0] == "h{0" and made[17] == "h{11" and made[1000] == "x3e8"


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    with StubServer() as server:
        yield server


def test_the_blocking_client_heartbeats_like_every_socket(stub: StubServer) -> None:
    with RawClient(stub.endpoint) as raw:
        assert raw._sock.getsockopt(zmq.HEARTBEAT_IVL) > 0
        assert raw._sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) > 0

    async def main() -> None:
        client = rl.AsyncClient(stub.endpoint)
        client._conn.native = False  # the libzmq link
        async with client:
            sock = client._conn._zmq._sock  # type: ignore[union-attr]
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) > 0
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) > 0

    anyio.run(main)


def test_the_async_and_blocking_clients_answer_alike(stub: StubServer) -> None:
    """The same requests through the core and through the blocking wrapper: the same
    answers, the same typed errors, the same check of the answer's type."""
    ask = Tokenize(rid="t1", input=Input(text="hello"))
    unknown = CloseSession(rid="c1", session="0" * 32)
    want = chars("hello")

    with RawClient(stub.endpoint) as raw:
        assert raw.call(ask, Tokens).input_ids == want
        with pytest.raises(errors.NotFoundError):
            raw.call(unknown, Ok)
        with pytest.raises(errors.InternalError, match="unexpected Tokens"):
            raw.call(Tokenize(rid="t2", input=Input(text="x")), Ok)
        dones = raw.generate_n("abc", n=3, max_tokens=4, ignore_eos=True)
    assert [d.index for d in dones] == [0, 1, 2]

    async def main() -> None:
        core = ProtocolClient(stub.endpoint, client_name="test")
        async with anyio.create_task_group() as tg:
            await core.open(tg, 10)
            assert await core.tokenize(Input(text="hello")) == want
            with pytest.raises(errors.NotFoundError):
                await core.close_session("0" * 32)
            with pytest.raises(errors.InternalError, match="unexpected Tokens"):
                await core.call(Tokenize(rid=core.new_rid(), input=Input(text="x")), Ok)
            msg = Generate(rid=core.new_rid(), input=Input(text="abc"), n=3,
                           sampling=SamplingParams(max_tokens=4, ignore_eos=True))
            got = await core.run_generate(msg)
            assert [d.index for d in got] == [0, 1, 2]
            assert got[0].token_ids == toy_generate(chars("abc"), 4, ignore_eos=True)
            tg.cancel_scope.cancel()
        core.close()

    anyio.run(main)


def test_the_http_link_is_the_protocol_client(stub: StubServer) -> None:
    """`EngineLink` keeps and closes sessions as the SDK's client does; once the engine is
    gone, closing what it held sends nothing and raises nothing."""
    async def main() -> None:
        link = EngineLink(stub.endpoint)
        async with anyio.create_task_group() as tg:
            await link.open(tg, 10)
            assert link.new_rid().startswith("h")
            opened = await link.open_session(retention="soft")
            forked = (await link.fork_session(opened.session, 2)).sessions
            assert len(forked) == 2
            assert (await link.stats()).sessions == 3
            link.close_sessions_unawaited([opened.session, *forked])
            assert (await link.stats()).sessions == 0  # in order: the closes went first
            tg.cancel_scope.cancel()
        link.close()
        assert not link.alive
        link.close_sessions_unawaited(["whatever"])

    anyio.run(main)


def test_an_endpoint_file_is_not_a_directory(tmp_path: Path) -> None:
    """A client of an ipc path that does not exist is told so at once (the probe reads
    the path with the same parser)."""
    with pytest.raises(rl.NoServerError, match="does not exist"):
        probe_endpoint(f"ipc://{tmp_path}/none.sock")


def test_a_request_from_another_thread_is_refused(stub: StubServer) -> None:
    """A connection belongs to the loop that opened it: the SDK says so as a
    `ProgramError`, the core as a RuntimeError."""
    async def main() -> None:
        async with rl.AsyncClient(stub.endpoint) as client:
            with pytest.raises(rl.ProgramError, match="another event loop"):
                await anyio.to_thread.run_sync(
                    lambda: client.request(Tokenize(rid="x", input=Input(text="a"))))
            assert await client.tokenize("a") == chars("a")  # the client goes on
        core = ProtocolClient(stub.endpoint, client_name="test")
        with pytest.raises(RuntimeError, match="not open"):
            core.request(Tokenize(rid="y", input=Input(text="a")))

    anyio.run(main)
