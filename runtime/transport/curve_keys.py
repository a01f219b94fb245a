"""CurveZMQ keys for an authenticated client endpoint (``radixlm serve --auth-dir DIR``).

Authentication and encryption are libzmq's own CURVE mechanism; the keys are files in
pyzmq's ``zmq.auth`` certificate format, and the server checks clients with
``zmq.auth``'s ZAP authenticator. Nothing here does cryptography itself.

The auth directory (``radixlm keys DIR`` makes it):

    DIR/server.key                       the server's public key: give it to clients
    DIR/server.key_secret                the server's secret key (never leaves DIR)
    DIR/authorized_clients/NAME.key      public keys of the clients the server accepts
    DIR/clients/NAME.key, NAME.key_secret  key pairs made for clients: hand NAME.key_secret
                                         (it holds both halves) to that client only

A client key allowed in is its tenant's identity: the frontend reads it from the
authenticator's User-Id. This module is the server's side; clients read their keys with
`radixlm.runtime.transport.curve`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from radixlm.runtime.transport.channel import EndpointError
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["AUTHORIZED", "CLIENTS", "AuthDirError", "check_auth_dir", "create_keys",
           "server_socket_options", "start_authenticator"]

SERVER = "server"
AUTHORIZED = "authorized_clients"
CLIENTS = "clients"


class AuthDirError(EndpointError):
    """An auth directory the server cannot use, with what is wrong."""


def create_keys(directory: Path, clients: list[str]) -> list[Path]:
    """Make the server key pair (unless there is one) and a key pair for each client
    name, authorizing each; returns the client secret-key files made."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    if not (directory / f"{SERVER}.key_secret").exists():
        zmq.auth.create_certificates(directory, SERVER)
    for sub in (AUTHORIZED, CLIENTS):
        (directory / sub).mkdir(mode=0o700, exist_ok=True)
    made = []
    for name in clients:
        if not name or "/" in name or name.startswith("."):
            raise AuthDirError(f"bad client name {name!r}")
        public, secret = zmq.auth.create_certificates(directory / CLIENTS, name)
        shutil.copy(public, directory / AUTHORIZED / f"{name}.key")
        made.append(Path(secret))
    for path in (directory / CLIENTS).iterdir():
        if path.name.endswith(".key_secret"):
            path.chmod(0o600)
    (directory / f"{SERVER}.key_secret").chmod(0o600)
    return made


def _server_keys(directory: Path) -> tuple[bytes, bytes]:
    secret_file = directory / f"{SERVER}.key_secret"
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as e:
        raise AuthDirError(f"--auth-dir {directory}: cannot read the server key "
                           f"{secret_file} ({e}); make one with 'radixlm keys {directory}'") from None
    if not secret:
        raise AuthDirError(f"{secret_file} holds no secret key")
    return public, secret


def check_auth_dir(directory: Path) -> None:
    """Raise `AuthDirError` unless the directory has a server key and authorized clients."""
    _server_keys(directory)
    authorized = directory / AUTHORIZED
    if not authorized.is_dir() or not any(p.suffix == ".key" for p in authorized.iterdir()):
        raise AuthDirError(f"--auth-dir {directory}: no client keys in {authorized}; add one "
                           f"with 'radixlm keys {directory} --client NAME'")


def server_socket_options(directory: Path) -> dict[int, int | bytes]:
    """Socket options that make a socket a CURVE server with the directory's key."""
    public, secret = _server_keys(directory)
    return {zmq.CURVE_SERVER: 1, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}


GATEWAY = "gateway"  # the runtime directory's own key pair, for the HTTP frontend


def make_gateway_keys(runtime_dir: Path, directory: Path) -> Path:
    """A key pair for this server's trusted gateway (the HTTP frontend) in the private
    runtime directory, and the keys the server accepts: DIR/authorized_clients and it
    (RUNTIME/authorized, a copy made at start). Returns that directory."""
    check_auth_dir(directory)
    zmq.auth.create_certificates(runtime_dir, GATEWAY)
    (runtime_dir / f"{GATEWAY}.key_secret").chmod(0o600)
    accepted = runtime_dir / "authorized"
    accepted.mkdir(mode=0o700, exist_ok=True)
    for key in (directory / AUTHORIZED).glob("*.key"):
        shutil.copy(key, accepted / key.name)
    shutil.copy(runtime_dir / f"{GATEWAY}.key", accepted / f"{GATEWAY}.radixlm-gateway.key")
    return accepted


def start_authenticator(ctx: zmq.Context[Any], directory: Path,
                        accepted: Path | None = None) -> ThreadAuthenticator:
    """zmq.auth's ZAP handler for `ctx`, accepting the keys in DIR/authorized_clients, or
    those in `accepted` (`make_gateway_keys`) (read once, at start)."""
    check_auth_dir(directory)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=os.fspath(accepted or directory / AUTHORIZED))
    return auth
