"""The listening sockets of a server, bound by the process that starts it, before any
child process starts or any model loads.

A taken address is then a one-line error within milliseconds, not a surprise after the
model has loaded; port 0 is resolved before anything is printed; and the readiness probe
can only ever reach this server (nobody else can hold the address meanwhile). The bound
socket is handed to the process that serves it: the frontend's ZeroMQ ROUTER adopts it
(libzmq's ``ZMQ_USE_FD``), the HTTP frontend's uvicorn serves it (``sockets=``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from radixlm.runtime.transport.endpoints import EndpointError, parse_endpoint
from radixlm.runtime.transport.probe import NoServerError, probe_endpoint

__all__ = ["Listener", "listen_http", "listen_zmq"]

ZMQ_BACKLOG = 100  # libzmq's own default (ZMQ_BACKLOG)
HTTP_BACKLOG = 2048  # uvicorn's


@dataclass
class Listener:
    """A bound, listening socket. `address` is as bound (with the port the system picked
    for port 0); `path` is an ipc socket file (removed by `close` when `unlink`)."""

    sock: socket.socket
    address: str
    path: Path | None = None

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    @property
    def port(self) -> int:
        if self.sock.family not in (socket.AF_INET, socket.AF_INET6):
            return 0
        return int(self.sock.getsockname()[1])

    def close(self, *, unlink: bool = False) -> None:
        """Close this process's copy (a child keeps its own); with `unlink`, also remove
        the ipc socket file (only while nobody else can have bound the path since)."""
        self.sock.close()
        if unlink and self.path is not None:
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(self.path.lstat().st_mode):
                    self.path.unlink()


def listen_zmq(endpoint: str) -> Listener:
    """Bind a checked client endpoint (``ipc://PATH`` or ``tcp://HOST:PORT``, see
    `channel.check_client_endpoint`) for the frontend's ROUTER. An ipc path where a
    server answers is refused; a dead server's socket file is replaced."""
    parsed = parse_endpoint(endpoint)
    if parsed.scheme == "ipc":
        return _listen_ipc(endpoint, Path(parsed.path))
    sock = _listen_tcp(parsed.host, parsed.port, ZMQ_BACKLOG, endpoint)
    shown = f"[{sock.getsockname()[0]}]" if sock.family == socket.AF_INET6 else sock.getsockname()[0]
    return Listener(sock, f"tcp://{shown}:{sock.getsockname()[1]}")


def listen_http(host: str, port: int) -> Listener:
    """Bind the HTTP API's address (``--host``/``--port``)."""
    sock = _listen_tcp(host, port, HTTP_BACKLOG, f"{host}:{port}", what="HTTP ")
    return Listener(sock, f"{host}:{sock.getsockname()[1]}")


def _listen_tcp(host: str, port: int, backlog: int, shown: str, what: str = "") -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV)
    except socket.gaierror as e:
        raise EndpointError(f"cannot listen on {what}{shown}: cannot resolve {host!r} "
                            f"({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As libzmq and uvicorn do: a port in TIME_WAIT from a server just stopped is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise EndpointError(_bind_error(f"{what}{shown}", e, port, bool(what))) from None
    return sock


def _bind_error(shown: str, e: OSError, port: int, http: bool) -> str:
    if e.errno == errno.EADDRINUSE:
        other = "--port N (or --no-http)" if http else "another endpoint"
        return (f"cannot listen on {shown}: the address is already in use (another server "
                f"runs there; choose {other})")
    if isinstance(e, PermissionError) and 0 < port < 1024:
        return f"cannot listen on {shown}: ports below 1024 need privileges; choose another"
    return f"cannot listen on {shown}: {e.strerror or e}"


def _listen_ipc(endpoint: str, path: Path) -> Listener:
    try:
        probe_endpoint(endpoint)
    except NoServerError:
        pass  # nothing answers there: the path is free (or holds a dead server's socket)
    else:
        raise EndpointError(f"ipc endpoint {endpoint!r} is in use by a running server")
    abstract = str(path).startswith("@")  # Linux's abstract namespace: no file
    if not abstract:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # a dead server's socket file
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o077)  # the socket file is born 0600: no other user may connect
    try:
        sock.bind("\0" + str(path)[1:] if abstract else os.fspath(path))
        sock.listen(ZMQ_BACKLOG)
    except OSError as e:
        sock.close()
        raise EndpointError(f"cannot listen on {endpoint}: {e.strerror or e}") from None
    finally:
        os.umask(old_umask)
    return Listener(sock, endpoint, None if abstract else path)
