"""Tenants: who a client is, and the names the engine sees for its namespaces and pins.

A tenant is an authenticated identity. Over a CurveZMQ endpoint (``--auth-dir``) it is
the client's public key, as zmq.auth's authenticator reports it (the message's
``User-Id``); otherwise (ipc, whose socket only its user can open, or loopback TCP) every
client is the one local tenant.

The engine keys its cache by namespace, and pins by name. The frontend puts the tenant in
front of both before a request reaches the engine (`EngineNames`), so cache sharing,
pins, unpinning and session listings never cross tenants: a client can name only its own
tenant's namespaces and pins, whatever strings it sends. On the way back, replies are
put in the client's own terms (`EngineNames.outer_*`, `scrub`) and entries of other
tenants are dropped.

Engine-side names: ``TENANT`` for a request without a namespace, ``TENANT/NAMESPACE``
otherwise, and ``TENANT/NAME`` for pins. A tenant tag never holds a ``/``, so each
engine-side name has exactly one (tenant, namespace) it can come from. A server without
authentication has one tenant only, whose names pass unchanged (`LOCAL`).

Gateways. A trusted gateway -- the HTTP frontend, one connection per API key -- may
declare in its ``hello`` the tenant a connection speaks for (`Gateway`). It proves it is
trusted with the server's gateway credential: a random token the frontend writes at
start into its private runtime directory (``gateway.token``, 0600, in a 0700 directory:
only the server's own user can read it), which `radixlm serve` hands to the HTTP process
it starts. A declared tenant becomes ``gw-NAME``: a tenant like any CurveZMQ key's, on
any server, so keys never share cache, sessions or listings, with each other or with
the server's other clients. An ordinary client cannot declare one (it has no token; a
wrong one is refused with ``forbidden``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path
from typing import Any

import msgspec
from radixlm.runtime.protocol import ErrorCode, Gateway, Pinned, SessionList

__all__ = ["GATEWAY_TOKEN", "LOCAL", "EngineNames", "GatewayRefused", "gateway_names",
           "names_for", "write_gateway_token"]

GATEWAY_TOKEN = "gateway.token"  # in the runtime directory
_TENANT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_RELAYED_TENANT = re.compile(r"^[A-Za-z0-9_-]{1,80}$")  # a server's own tenant names


class GatewayRefused(Exception):
    """A ``hello`` declaring a tenant without the server's gateway credential."""

    code = ErrorCode.FORBIDDEN


def write_gateway_token(directory: Path) -> str:
    """A new gateway credential, written 0600 into the (private) runtime directory."""
    token = secrets.token_urlsafe(32)
    path = directory / GATEWAY_TOKEN
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(token)
    return token


def gateway_names(gateway: Gateway, token: str | None) -> EngineNames:
    """The names of the tenant a gateway declares, if its credential is the server's."""
    if token is None or not hmac.compare_digest(gateway.token.encode(), token.encode()):
        raise GatewayRefused("hello.gateway: not this server's gateway credential")
    if gateway.relayed:  # a router (runtime/router) speaking for a tenant of its own
        if not _RELAYED_TENANT.match(gateway.tenant):
            raise GatewayRefused("hello.gateway.tenant (relayed) must be 1-80 letters, "
                                 "digits, '_' or '-'")
        return EngineNames(gateway.tenant)
    if not _TENANT.match(gateway.tenant):
        raise GatewayRefused("hello.gateway.tenant must be 1-64 letters, digits, '_' or '-'")
    return EngineNames("gw-" + gateway.tenant)


def names_for(frame: Any, *, multi_tenant: bool) -> EngineNames:
    """The engine-side names of the client that sent `frame` (a received ``zmq.Frame``)."""
    if not multi_tenant:
        return LOCAL
    try:
        user_id = frame.get("User-Id")
    except Exception:  # noqa: BLE001 - no such property: an unauthenticated connection
        user_id = None
    if not user_id:
        return EngineNames("anonymous")
    text = user_id if isinstance(user_id, str) else bytes(user_id).decode("utf-8", "replace")
    return EngineNames("key-" + hashlib.sha256(text.encode()).hexdigest()[:24])


class EngineNames:
    """One tenant's namespaces and pin names as the engine knows them, and back."""

    __slots__ = ("tenant", "prefix")

    def __init__(self, tenant: str | None) -> None:
        """`tenant` None: the one tenant of a server without authentication."""
        assert tenant is None or "/" not in tenant
        self.tenant = tenant
        self.prefix = "" if tenant is None else tenant + "/"

    # -- to the engine ---------------------------------------------------------------------

    def namespace(self, namespace: str | None) -> str | None:
        if self.tenant is None:
            return namespace
        return self.tenant if namespace is None else self.prefix + namespace

    def turn_namespace(self, namespace: str | None) -> str | None:
        """A session turn's: none means "the session's own", and stays so."""
        return None if namespace is None else self.prefix + namespace

    def pin(self, name: str | None) -> str | None:
        return None if name is None else self.prefix + name

    # -- from the engine -------------------------------------------------------------------

    def owns(self, engine_namespace: str | None) -> bool:
        return self.tenant is None or engine_namespace == self.tenant or (
            engine_namespace is not None and engine_namespace.startswith(self.prefix))

    def outer_namespace(self, engine_namespace: str | None) -> str | None:
        if engine_namespace is None or engine_namespace == self.tenant:
            return None
        return engine_namespace[len(self.prefix):]

    def scrub(self, text: str) -> str:
        """An engine message in the client's terms (it can only name the client's own
        tenant's namespaces and pins: those are all the client could ask about)."""
        if self.tenant is None:
            return text
        return text.replace(repr(self.tenant), "None").replace(self.prefix, "")

    def sessions(self, reply: SessionList) -> SessionList:
        """Only this tenant's sessions, in its own terms."""
        if self.tenant is None:
            return reply
        return msgspec.structs.replace(reply, sessions=[
            msgspec.structs.replace(s, namespace=self.outer_namespace(s.namespace))
            for s in reply.sessions if self.owns(s.namespace)
        ])

    def pinned(self, reply: Pinned) -> Pinned:
        if self.tenant is None or not reply.name.startswith(self.prefix):
            return reply
        return msgspec.structs.replace(reply, name=reply.name[len(self.prefix):])


LOCAL = EngineNames(None)
