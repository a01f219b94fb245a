"""CurveZMQ client keys for a server started with ``radixlm serve --auth-dir DIR``: read
here once, for every client (the SDK, the ``radixlm generate``/``sessions``/``top``/``chat``
commands, whose ``--server-key``/``--client-key`` flags `add_key_arguments` adds).

The server's public key (DIR/server.key) and this client's key pair (a
``NAME.key_secret`` certificate from ``radixlm keys DIR --client NAME``) are read with
pyzmq's ``zmq.auth``; libzmq's CURVE does the authentication and encryption, so a client
with keys always uses the libzmq transport (`radixlm.runtime.transport.zmq_dealer`), never
the native one. The server's side (its key, the authenticator) is
`radixlm.runtime.transport.curve_keys`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, NamedTuple

import zmq.auth

__all__ = ["CurveKeys", "add_key_arguments", "load_curve_keys"]


class CurveKeys(NamedTuple):
    server_public: bytes
    public: bytes
    secret: bytes

    def socket_options(self) -> dict[int, Any]:
        """DEALER options that make the socket a CURVE client of that server."""
        return {zmq.CURVE_SERVERKEY: self.server_public, zmq.CURVE_PUBLICKEY: self.public,
                zmq.CURVE_SECRETKEY: self.secret}


def load_curve_keys(server_key: str | os.PathLike[str] | None,
                    client_key: str | os.PathLike[str] | None, *,
                    names: tuple[str, str] = ("server_key", "client_key")) -> CurveKeys | None:
    """The keys from their certificate files; None when neither is given. Raises
    ValueError saying what is wrong; `names` are how the caller's user spells the two
    arguments (``("--server-key", "--client-key")`` on a command line)."""
    if server_key is None and client_key is None:
        return None
    server_name, client_name = names
    if server_key is None or client_key is None:
        raise ValueError(f"a CurveZMQ client needs both {server_name} (the server's "
                         f"server.key) and {client_name} (this client's NAME.key_secret)")
    try:
        server_public, _ = zmq.auth.load_certificate(server_key)
        public, secret = zmq.auth.load_certificate(client_key)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CurveZMQ keys: {e}") from None
    if not secret:
        raise ValueError(f"{client_name} {os.fspath(client_key)!r} holds no secret key: give "
                         "the NAME.key_secret file")
    return CurveKeys(server_public, public, secret)


def add_key_arguments(p: argparse.ArgumentParser) -> None:
    """A client command's --server-key / --client-key flags (read with `load_curve_keys`,
    ``names=("--server-key", "--client-key")``)."""
    p.add_argument("--server-key", default=None, metavar="FILE",
                   help="for a server started with --auth-dir: its public certificate "
                        "(DIR/server.key)")
    p.add_argument("--client-key", default=None, metavar="FILE",
                   help="for a server started with --auth-dir: this client's secret "
                        "certificate (DIR/clients/NAME.key_secret)")
