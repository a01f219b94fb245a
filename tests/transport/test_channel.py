"""runtime/transport/channel.py: endpoint rules, socket options, framed messages."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import zmq
from radixlm.runtime import protocol
from radixlm.runtime.protocol import Hello, Ok, decode_client
from radixlm.runtime.transport import channel
from radixlm.runtime.transport.channel import EndpointError, check_client_endpoint


@pytest.mark.parametrize(("endpoint", "normalised"), [
    ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
    ("tcp://localhost:5555", "tcp://127.0.0.1:5555"),
    ("tcp://[::1]:5555", "tcp://[::1]:5555"),
])
def test_tcp_endpoints_accepted(endpoint: str, normalised: str) -> None:
    assert check_client_endpoint(endpoint) == normalised


@pytest.mark.parametrize("endpoint", [
    "tcp://*:5555", "tcp://*", "tcp://:5555", "tcp://127.0.0.1", "tcp://127.0.0.1:99999",
    "tcp://host:1/path", "udp://127.0.0.1:1", "127.0.0.1:5555", "ipc://", "ipc:///no/such/dir/s",
    "ipc:///tmp/" + "x" * 200,
])
def test_bad_endpoints_refused(endpoint: str) -> None:
    with pytest.raises(EndpointError):
        check_client_endpoint(endpoint)


def test_runtime_dir_and_ipc_socket_are_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    runtime_dir = channel.make_runtime_dir()
    assert runtime_dir.parent == tmp_path and runtime_dir.stat().st_mode & 0o777 == 0o700
    endpoint = channel.ipc_endpoint(runtime_dir, "client")
    ctx = zmq.Context()
    try:
        sock = channel.open_socket(ctx, zmq.ROUTER, endpoint, bind=True)
        path = channel.ipc_path(endpoint)
        assert path is not None and path.stat().st_mode & 0o777 == 0o600
        assert sock.getsockopt(zmq.LINGER) == 0 and sock.getsockopt(zmq.SNDHWM) == 0
        sock.close()
    finally:
        ctx.term()
    with pytest.raises(EndpointError):
        channel.ipc_endpoint(runtime_dir, "y" * 200)


def test_framed_messages(tmp_path: Path) -> None:
    endpoint = channel.ipc_endpoint(tmp_path, "s")
    ctx = zmq.Context()
    router = channel.open_socket(ctx, zmq.ROUTER, endpoint, bind=True)
    dealer = channel.open_socket(ctx, zmq.DEALER, endpoint, bind=False)
    try:
        channel.send(dealer, Hello(protocol_version=1))
        identity, data = router.recv_multipart()
        assert decode_client(data) == Hello(protocol_version=1)
        channel.send(router, Ok(rid="x"), to=identity)
        assert channel.recv(dealer, msgspec.msgpack.Decoder(protocol.ServerMessage)) == Ok(rid="x")
    finally:
        router.close()
        dealer.close()
        ctx.term()


def test_an_ipc_path_in_use_is_refused(tmp_path: Path) -> None:
    endpoint = channel.ipc_endpoint(tmp_path, "live")
    ctx = zmq.Context()
    live = channel.open_socket(ctx, zmq.ROUTER, endpoint, bind=True)
    try:
        with pytest.raises(EndpointError, match="in use"):
            check_client_endpoint(endpoint)
    finally:
        live.close()
        ctx.term()
    assert check_client_endpoint(endpoint) == endpoint  # a stale file may be bound again
