"""Client identities are the server's (issue 24): a peer that sets ZMQ_ROUTING_ID to the
ids libzmq would give the next anonymous connections cannot crash the frontend (libzmq
asserted in socket_base.cpp) nor take another client's place; a peer-chosen id of any
other shape is refused with a clear error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Generate,
    Hello,
    Input,
    SamplingParams,
    decode_server,
    encode,
)

from tests.conftest import ServerHandle, start_test_server
from tests.server.test_engine_liveness import role_pid

pytestmark = pytest.mark.timeout(180)

# libzmq starts a ROUTER's ids at libc rand()'s value; unseeded, its first is this one.
UNSEEDED_FIRST_ID = 0x6B8B4567
WINDOW = 64


def _dealer(ctx: zmq.Context, endpoint: str, routing_id: bytes | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(endpoint)
    return sock


def _reply(sock: zmq.Socket, timeout_ms: int = 30_000) -> object:
    assert sock.poll(timeout_ms), "no reply"
    return decode_server(sock.recv())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerHandle]:
    """A server of this module's own (not the session's: these tests try to crash it)."""
    with start_test_server(tmp_path_factory.mktemp("identities"), tiny_model_dir) as handle:
        yield handle


def test_colliding_routing_ids_cannot_crash_or_hijack(server: ServerHandle) -> None:
    frontend = role_pid(server.pid, "frontend")
    ctx = zmq.Context()
    try:
        evil = [_dealer(ctx, server.endpoint,
                        b"\x00" + (UNSEEDED_FIRST_ID + k).to_bytes(4, "big"))
                for k in range(WINDOW)]
        for sock in evil:
            sock.send(encode(Hello(protocol_version=PROTOCOL_VERSION)))
        for sock in evil:
            _reply(sock)  # each is answered (served or refused): the server is up
        victims = [_dealer(ctx, server.endpoint, None) for _ in range(4)]
        for i, sock in enumerate(victims):
            sock.send(encode(Hello(protocol_version=PROTOCOL_VERSION)))
            _reply(sock)
            sock.send(encode(Generate(rid=f"v{i}", input=Input(text="hello"),
                                      sampling=SamplingParams(max_tokens=2))))
        for sock in victims:
            reply = _reply(sock)
            assert type(reply).__name__ == "Done", reply
        for sock in evil:  # none of the victims' replies went to a peer-chosen id
            assert not sock.poll(50)
        assert role_pid(server.pid, "frontend") == frontend  # never restarted or died
    finally:
        ctx.destroy(linger=0)


def test_a_peer_chosen_routing_id_is_refused(server: ServerHandle) -> None:
    ctx = zmq.Context()
    try:
        chosen = _dealer(ctx, server.endpoint, b"alice")
        chosen.send(encode(Hello(protocol_version=PROTOCOL_VERSION)))
        reply = _reply(chosen)
        assert isinstance(reply, Error) and reply.code == ErrorCode.FORBIDDEN, reply
        assert "ZMQ_ROUTING_ID" in reply.message
        chosen.send(encode(Generate(rid="g", input=Input(text="hello"),
                                    sampling=SamplingParams(max_tokens=2))))
        reply = _reply(chosen)
        assert isinstance(reply, Error) and reply.code == ErrorCode.FORBIDDEN, reply
        with server.client(timeout_s=30) as ok:  # an ordinary client is served
            assert ok.generate("hello", max_tokens=2).finish_reason == "length"
    finally:
        ctx.destroy(linger=0)
