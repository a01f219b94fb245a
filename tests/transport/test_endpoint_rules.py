"""Client endpoint rules at the trust boundary: URL parsing, userinfo, wildcards, public
addresses (refused without authentication unless --insecure), port 0, bind errors, and
ipc socket files that are never open to other users."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq
from radixlm.runtime.transport import channel
from radixlm.runtime.transport.channel import (
    EndpointError,
    check_client_endpoint,
    parse_client_endpoint,
)


@pytest.mark.parametrize("endpoint", [
    "tcp://x@*:5555", "tcp://x@127.0.0.1:5555", "tcp://user:pw@localhost:5555",
])
def test_userinfo_is_refused(endpoint: str) -> None:
    for flags in ({}, {"insecure": True}, {"authenticated": True}):
        with pytest.raises(EndpointError, match="user part"):
            check_client_endpoint(endpoint, **flags)


@pytest.mark.parametrize(("endpoint", "bound"), [
    ("tcp://*:5555", "tcp://0.0.0.0:5555"),
    ("tcp://0:5555", "tcp://0.0.0.0:5555"),
    ("tcp://0.0.0.0:5555", "tcp://0.0.0.0:5555"),
    ("tcp://[::]:5555", "tcp://[::]:5555"),
])
def test_wildcards_need_auth_or_insecure(endpoint: str, bound: str) -> None:
    with pytest.raises(EndpointError, match="every interface"):
        check_client_endpoint(endpoint)
    for flags in ({"insecure": True}, {"authenticated": True}):
        checked = parse_client_endpoint(endpoint, **flags)
        assert checked.address == bound and checked.wildcard and checked.public


@pytest.mark.parametrize("endpoint", ["tcp://10.1.2.3:5555", "tcp://example.com:5555",
                                      "tcp://[2001:db8::1]:5555"])
def test_a_public_address_needs_auth_or_insecure(endpoint: str) -> None:
    with pytest.raises(EndpointError, match="not a loopback address"):
        check_client_endpoint(endpoint)
    checked = parse_client_endpoint(endpoint, authenticated=True)
    assert checked.public and not checked.wildcard


@pytest.mark.parametrize(("endpoint", "bound"), [
    ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"),
    ("tcp://127.1:5555", "tcp://127.1:5555"),  # the resolver's short form of 127.0.0.1
    ("tcp://LOCALHOST:5555", "tcp://127.0.0.1:5555"),
])
def test_loopback_needs_nothing(endpoint: str, bound: str) -> None:
    checked = parse_client_endpoint(endpoint)
    assert checked.address == bound and not checked.public


@pytest.mark.parametrize("endpoint", ["tcp://::1:5555", "tcp://127.0.0.1:-1",
                                      "tcp://127.0.0.1:65536", "tcp://127.0.0.1:5555?x=1",
                                      "tcp://[::1:5555"])
def test_malformed_tcp_endpoints(endpoint: str) -> None:
    with pytest.raises(EndpointError):
        check_client_endpoint(endpoint)


def test_bind_errors_are_endpoint_errors() -> None:
    ctx = zmq.Context()
    try:
        first = channel.open_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:0", bind=True)
        taken = channel.bound_endpoint(first)
        assert taken.rsplit(":", 1)[1] != "0"  # port 0: the bound port is reported
        with pytest.raises(EndpointError, match="cannot bind"):
            channel.open_socket(ctx, zmq.ROUTER, taken, bind=True)
        first.close()
    finally:
        ctx.term()


def test_ipc_socket_is_private_from_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With umask 000 and no chmod after the bind, the file must still be 0600: nobody
    else can connect between the bind and a later chmod."""
    monkeypatch.setattr(Path, "chmod", lambda self, mode: None)
    old = os.umask(0)
    ctx = zmq.Context()
    try:
        sock = channel.open_socket(ctx, zmq.ROUTER, f"ipc://{tmp_path}/s", bind=True)
        mode = stat.S_IMODE((tmp_path / "s").stat().st_mode)
        sock.close()
    finally:
        os.umask(old)
        ctx.term()
    assert mode & 0o077 == 0, oct(mode)
    assert os.umask(old) == old  # the umask is put back


def test_zmtp_heartbeats_on_ipc_too(tmp_path: Path) -> None:
    """A stopped peer is dropped on ipc as on tcp (the kernel never reports it)."""
    ctx = zmq.Context()
    try:
        for endpoint in (f"ipc://{tmp_path}/hb", "tcp://127.0.0.1:0"):
            sock = channel.open_socket(ctx, zmq.ROUTER, endpoint, bind=True)
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) > 0, endpoint
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) > 0, endpoint
            sock.close()
    finally:
        ctx.term()
