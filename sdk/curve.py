"""CurveZMQ client keys for a server started with ``radixlm serve --auth-dir DIR``.

The server's public key (DIR/server.key) and this client's key pair (a
``NAME.key_secret`` certificate from ``radixlm keys DIR --client NAME``) are read with
pyzmq's ``zmq.auth``; libzmq's CURVE does the authentication and encryption, so a client
with keys always uses the libzmq transport (`radixlm.sdk.zmq_dealer`), never the native one.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import zmq.auth

__all__ = ["CurveKeys", "load_curve_keys"]


class CurveKeys(NamedTuple):
    server_public: bytes
    public: bytes
    secret: bytes

    def socket_options(self) -> dict[int, Any]:
        return {zmq.CURVE_SERVERKEY: self.server_public, zmq.CURVE_PUBLICKEY: self.public,
                zmq.CURVE_SECRETKEY: self.secret}


def load_curve_keys(server_key: str | os.PathLike[str] | None,
                    client_key: str | os.PathLike[str] | None) -> CurveKeys | None:
    """The keys from their certificate files; None when neither is given."""
    if server_key is None and client_key is None:
        return None
    if server_key is None or client_key is None:
        raise ValueError("CurveZMQ needs both server_key (the server's server.key) and "
                         "client_key (this client's NAME.key_secret)")
    try:
        server_public, _ = zmq.auth.load_certificate(server_key)
        public, secret = zmq.auth.load_certificate(client_key)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CurveZMQ keys: {e}") from None
    if not secret:
        raise ValueError(f"client_key {os.fspath(client_key)!r} holds no secret key: give the "
                         "NAME.key_secret file")
    return CurveKeys(server_public, public, secret)
