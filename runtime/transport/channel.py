"""The one ZeroMQ helper every radixlm process uses: endpoints, sockets, framed messages.

- Endpoints: the private runtime directory (0700) that holds the ``ipc://`` sockets, and
  the rules for an endpoint a server binds for its clients (read by
  `endpoints.parse_endpoint`, as every endpoint is): nothing that listens beyond this
  machine (a wildcard such as ``*``, ``0``, ``0.0.0.0``, ``::``, or a non-loopback
  address) unless clients must authenticate or the user said ``--insecure``.
- `open_socket`: any socket type with the same options everywhere (linger 0 so closing
  never hangs, unbounded high-water marks so a send never blocks or drops on a local
  pipe, ZMTP heartbeats so a stopped peer is noticed, ipc socket files created 0600),
  and bind errors as `EndpointError` with the reason. Every libzmq socket of radixlm is
  opened here: the servers', the router's, and the clients' (`ZmqDealer`, `RawClient`);
  the one socket that is not libzmq's is the native ZMTP link of `zmtp.py`.
- `send` / `recv`: one msgspec message per frame, optionally behind a ROUTER identity.

Only pyzmq and msgspec.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import zmq
from radixlm.runtime.transport.endpoints import Endpoint, EndpointError, parse_endpoint

__all__ = [
    "ClientEndpoint",
    "EndpointError",
    "bound_endpoint",
    "check_client_endpoint",
    "ipc_endpoint",
    "ipc_path",
    "make_runtime_dir",
    "open_socket",
    "parse_client_endpoint",
    "recv",
    "send",
]

T = TypeVar("T")

# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS), terminating NUL included.
MAX_IPC_PATH_BYTES = 103
# ZMTP heartbeats: ping every 5 s, drop a peer silent for 30 s.
_HEARTBEAT_IVL_MS = 5_000
_HEARTBEAT_TIMEOUT_MS = 30_000

_encoder = msgspec.msgpack.Encoder()


# -- endpoints ---------------------------------------------------------------------------


def make_runtime_dir(prefix: str = "radixlm-") -> Path:
    """A new private (0700) directory for one server's ipc sockets.

    Under ``$XDG_RUNTIME_DIR`` when it is set and writable (a per-user tmpfs), else in the
    system temp dir. The caller removes it when the server stops.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    parent = base if base and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK) else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    path.chmod(0o700)  # mkdtemp already does; say it explicitly
    return path


def ipc_endpoint(directory: str | os.PathLike[str], name: str) -> str:
    """``ipc://<directory>/<name>``, refusing paths too long for a unix socket."""
    path = os.path.join(os.fspath(directory), name)
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise EndpointError(
            f"ipc socket path {path!r} is longer than {MAX_IPC_PATH_BYTES} bytes (a unix "
            "socket limit); use a shorter directory (e.g. set XDG_RUNTIME_DIR or TMPDIR)"
        )
    return f"ipc://{path}"


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ``ipc://`` endpoint, else None."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


@dataclass(frozen=True)
class ClientEndpoint:
    """A checked client endpoint: `address` is what to bind, `public` whether it listens
    beyond this machine (a wildcard or a non-loopback address), `wildcard` whether on
    every interface."""

    address: str
    public: bool = False
    wildcard: bool = False


# Hosts libzmq takes as "every interface" ("0" is 0.0.0.0 to the resolver).
_WILDCARD_HOSTS = frozenset({"*", "0", "0.0.0.0", "::", "0:0:0:0:0:0:0:0"})


def check_client_endpoint(endpoint: str, *, authenticated: bool = False,
                          insecure: bool = False) -> str:
    """Validate (and normalise) an endpoint a server will bind for its clients.

    ``ipc://PATH``: PATH's directory must exist. ``tcp://HOST:PORT``: parsed as a URL; no
    userinfo, no path, a port in 0..65535 (0: the system picks one). A loopback HOST is
    always allowed; anything else (another address, a host name, a wildcard such as ``*``,
    ``0``, ``0.0.0.0`` or ``::``) listens beyond this machine and is refused unless the
    server authenticates its clients (`authenticated`: ``--auth-dir``) or the user said
    `insecure`.
    """
    return parse_client_endpoint(endpoint, authenticated=authenticated, insecure=insecure).address


def parse_client_endpoint(endpoint: str, *, authenticated: bool = False,
                          insecure: bool = False) -> ClientEndpoint:
    """`check_client_endpoint`, with what it found out about the address."""
    parsed = parse_endpoint(endpoint)
    if parsed.scheme == "ipc":
        return ClientEndpoint(_check_ipc(endpoint))
    if parsed.scheme != "tcp":
        raise EndpointError(f"endpoint must start with ipc:// or tcp://, got {endpoint!r}")
    host = parsed.host.lower()
    if host == "localhost":
        host = "127.0.0.1"
    wildcard = host in _WILDCARD_HOSTS
    if wildcard:
        host = "::" if ":" in host else "0.0.0.0"
    public = wildcard or not _is_loopback(host)
    if public and not (authenticated or insecure):
        where = "every interface" if wildcard else f"{host!r}, which is not a loopback address"
        raise EndpointError(
            f"{endpoint!r} would listen on {where}, without authentication: give --auth-dir "
            "(CurveZMQ keys from 'radixlm keys'), bind tcp://127.0.0.1:PORT, or pass "
            "--insecure to listen publicly without authentication on purpose"
        )
    return ClientEndpoint(Endpoint("tcp", host=host, port=parsed.port).address, public=public,
                          wildcard=wildcard)


def _is_loopback(host: str) -> bool:
    """Whether `host` (an address; names other than localhost count as public) is a
    loopback address. inet_aton also reads the short IPv4 forms the resolver takes
    ("127.1")."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host)).is_loopback
    except OSError:
        return False


def _check_ipc(endpoint: str) -> str:
    path = endpoint[len("ipc://"):]
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise EndpointError(f"ipc socket path {path!r} is longer than {MAX_IPC_PATH_BYTES} bytes")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise EndpointError(f"ipc endpoint directory {parent!r} does not exist")
    if _ipc_in_use(path):  # binding would silently take the path from a live server
        raise EndpointError(f"ipc endpoint {endpoint!r} is in use by a running server")
    return f"ipc://{path}"


def _ipc_in_use(path: str) -> bool:
    """Whether a process accepts connections on the unix socket at `path` (a stale file
    left by a dead server is not in use)."""
    if not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


# -- sockets -----------------------------------------------------------------------------


def open_socket(
    ctx: zmq.Context[Any],
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    hwm: int = 0,
    options: dict[int, int | bytes] | None = None,
) -> zmq.Socket[Any]:
    """Create a socket of `kind` (zmq.ROUTER, zmq.PUSH, ...), set radixlm's options, then
    bind or connect it to `endpoint`.

    `hwm` is the send and receive high-water mark (0 = unbounded: local pipes never block
    the sender or drop). `options` are extra ``setsockopt`` pairs applied before binding
    (e.g. ``{zmq.ROUTER_MANDATORY: 1}``). Works with ``zmq.asyncio.Context`` too. A bound
    ipc socket file is made 0600.
    """
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        # ZMTP heartbeats on every transport: a peer that stopped (SIGSTOP, a frozen
        # machine) is dropped even on ipc, where the kernel never says so.
        sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        if bind:
            _bind(sock, endpoint)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _bind(sock: zmq.Socket[Any], endpoint: str) -> None:
    """Bind; an ipc socket file is created 0600 (the umask is set around the bind, which
    libzmq does on this thread), so no other user can connect, not even for a moment."""
    path = ipc_path(endpoint)
    old_umask = os.umask(0o077) if path is not None else None
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise EndpointError(f"cannot bind {endpoint}: {e.strerror}") from None
    finally:
        if old_umask is not None:
            os.umask(old_umask)
    if path is not None and path.exists():
        path.chmod(stat.S_IRUSR | stat.S_IWUSR)  # (already so; says it for readers)


def bound_endpoint(sock: zmq.Socket[Any]) -> str:
    """The endpoint a socket is bound to, with the port the system picked for port 0."""
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)


# -- framed messages ---------------------------------------------------------------------


def send(sock: zmq.Socket[Any], msg: msgspec.Struct | bytes, *, to: bytes | None = None,
         flags: int = 0) -> None:
    """Send one message (a Struct, msgpack-encoded here, or bytes already encoded); `to` is
    the peer identity on a ROUTER."""
    data = msg if isinstance(msg, bytes) else _encoder.encode(msg)
    if to is None:
        sock.send(data, flags)
    else:
        sock.send_multipart((to, data), flags)


def recv(sock: zmq.Socket[Any], decoder: msgspec.msgpack.Decoder[T], flags: int = 0) -> T:
    """Receive one frame and decode it (raises ``msgspec.DecodeError``/``ValidationError``)."""
    return decoder.decode(sock.recv(flags))


def drain(sock: zmq.Socket[Any], decoder: msgspec.msgpack.Decoder[T], limit: int | None = None,
          log: logging.Logger | None = None) -> Iterator[T]:
    """The messages already waiting on `sock` (at most `limit`), decoded, never blocking.
    One that does not decode is logged and dropped: the peer is our own process, so it
    is a bug there, not a reason to stop serving."""
    n = 0
    while limit is None or n < limit:
        # After the first message, ask whether another is waiting: the zmq.Again a recv of
        # nothing raises costs ~10 us to build (a fifth of the frontend's time a token).
        if n and not sock.get(zmq.EVENTS) & zmq.POLLIN:
            return
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        n += 1
        try:
            yield decoder.decode(data)
        except msgspec.MsgspecError as e:
            (log or logging.getLogger(__name__)).error("undecodable message dropped: %s", e)
