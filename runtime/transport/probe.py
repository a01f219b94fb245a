"""Is anything listening at an endpoint? Answered at once, before a client waits.

ZeroMQ connects in the background and retries for ever: a client of an ``ipc://`` path
that does not exist, or of a port nobody listens on, would wait out its whole timeout in
silence. `probe_endpoint` asks the kernel instead (one ``connect``, closed at once: a
server sees a connection that ends before its handshake, and ignores it) and raises
`NoServerError` saying what it found, with a hint. The SDK and the CLI call it before
they connect (through `radixlm.runtime.transport.discovery.find_server`).
"""

from __future__ import annotations

import errno
import os
import socket

from radixlm.runtime.transport.endpoints import EndpointError, parse_endpoint
from radixlm.runtime.transport.errors import NoServerError

__all__ = ["NoServerError", "probe_endpoint"]

HINT = ("start one with `radixlm serve`, or give the endpoint it printed "
        "(--endpoint, or $RADIXLM_ENDPOINT)")


def probe_endpoint(endpoint: str, *, timeout_s: float = 3.0, hint: str = HINT) -> None:
    """Return if something accepts connections at `endpoint` (``ipc://PATH`` or
    ``tcp://HOST:PORT``; other transports, and what is no endpoint, are left to the
    connection, which says what is wrong); else raise `NoServerError`.
    A refused or missing endpoint is reported at once; a TCP host that drops packets
    after `timeout_s`."""
    try:
        parsed = parse_endpoint(endpoint)
    except EndpointError:
        return
    if parsed.scheme == "ipc":
        _probe_ipc(endpoint, parsed.path, parsed.unix_address, hint)
    elif parsed.scheme == "tcp":
        _probe_tcp(endpoint, parsed.host, parsed.port, timeout_s, hint)


def _probe_ipc(endpoint: str, path: str, address: str, hint: str) -> None:
    if not path.startswith("@") and not os.path.exists(path):
        raise NoServerError(f"no radixlm server at {endpoint}: {path} does not exist; {hint}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except (ConnectionRefusedError, FileNotFoundError):
        raise NoServerError(f"no radixlm server at {endpoint}: nothing listens there (a "
                            f"socket left by a server that was killed?); {hint}") from None
    except PermissionError:
        raise NoServerError(f"cannot connect to {endpoint}: permission denied (another "
                            "user's server?)") from None
    except OSError as e:
        raise NoServerError(f"cannot connect to {endpoint}: {e.strerror}; {hint}") from None
    finally:
        sock.close()


def _probe_tcp(endpoint: str, host: str, port: int, timeout_s: float, hint: str) -> None:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        raise NoServerError(f"no radixlm server at {endpoint}: nothing listens on "
                            f"{host}:{port} (connection refused); {hint}") from None
    except socket.gaierror as e:
        raise NoServerError(f"cannot connect to {endpoint}: cannot resolve {host!r} "
                            f"({e.strerror})") from None
    except TimeoutError:
        raise NoServerError(f"no answer from {endpoint} within {timeout_s:g} s (the host is "
                            "down, or a firewall drops the connection)") from None
    except OSError as e:
        reason = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
        raise NoServerError(f"cannot connect to {endpoint}: {reason}; {hint}") from None
