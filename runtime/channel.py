"""The one ZeroMQ helper every radixlm process uses: endpoints, sockets, framed messages.

- Endpoints: the private runtime directory (0700) that holds the ``ipc://`` sockets, and
  the checks on a user-given client endpoint (``tcp://*`` is refused: a TCP endpoint binds
  to loopback unless the user names an address, ``tcp://0.0.0.0:PORT`` included).
- `open_socket`: any socket type with the same options everywhere (linger 0 so closing
  never hangs, unbounded high-water marks so a send never blocks or drops on a local
  pipe, heartbeats on TCP so a dead peer is noticed, 0600 on ipc socket files).
- `send` / `recv`: one msgspec message per frame, optionally behind a ROUTER identity.

Only pyzmq and msgspec. (The SDK imports nothing of the runtime but the protocol, so it
keeps its own asyncio/anyio socket code.)
"""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec
import zmq

__all__ = [
    "EndpointError",
    "check_client_endpoint",
    "ipc_endpoint",
    "ipc_path",
    "make_runtime_dir",
    "open_socket",
    "recv",
    "send",
]

T = TypeVar("T")

# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS), terminating NUL included.
MAX_IPC_PATH_BYTES = 103
# ZMTP heartbeats on TCP: ping every 5 s, drop a peer silent for 30 s.
_TCP_HEARTBEAT_IVL_MS = 5_000
_TCP_HEARTBEAT_TIMEOUT_MS = 30_000

_encoder = msgspec.msgpack.Encoder()


class EndpointError(ValueError):
    """An endpoint radixlm will not use, with the reason."""


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


def check_client_endpoint(endpoint: str) -> str:
    """Validate (and normalise) an endpoint a server will bind for its clients.

    ``ipc://PATH``: PATH's directory must exist. ``tcp://HOST:PORT``: HOST must be named
    (``localhost``, an address, ``0.0.0.0`` to listen on every interface, said explicitly);
    ``tcp://*:PORT`` is refused so that nothing listens publicly by accident.
    """
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path:
            raise EndpointError("ipc endpoint needs a path: ipc:///path/to/socket")
        if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
            raise EndpointError(f"ipc socket path {path!r} is longer than {MAX_IPC_PATH_BYTES} bytes")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise EndpointError(f"ipc endpoint directory {parent!r} does not exist")
        if _ipc_in_use(path):  # binding would silently take the path from a live server
            raise EndpointError(f"ipc endpoint {endpoint!r} is in use by a running server")
        return f"ipc://{path}"
    if endpoint.startswith("tcp://"):
        parts = urlsplit(endpoint)
        host = parts.hostname
        try:
            port = parts.port
        except ValueError as e:
            raise EndpointError(f"bad tcp endpoint {endpoint!r}: {e}") from None
        if parts.netloc.startswith("*"):
            raise EndpointError(
                f"{endpoint!r} would listen on every interface; name the address "
                "(tcp://127.0.0.1:PORT, or tcp://0.0.0.0:PORT to listen publicly on purpose)"
            )
        if not host or port is None or parts.path not in ("", "/"):
            raise EndpointError(f"tcp endpoint must be tcp://HOST:PORT, got {endpoint!r}")
        if host == "localhost":
            host = "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{port}"
    raise EndpointError(f"endpoint must start with ipc:// or tcp://, got {endpoint!r}")


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
        if endpoint.startswith("tcp://"):
            sock.setsockopt(zmq.HEARTBEAT_IVL, _TCP_HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _TCP_HEARTBEAT_TIMEOUT_MS)
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        if bind:
            sock.bind(endpoint)
            path = ipc_path(endpoint)
            if path is not None and path.exists():
                path.chmod(stat.S_IRUSR | stat.S_IWUSR)
        else:
            sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


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
