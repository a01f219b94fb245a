"""One engine connection of the HTTP process, one per tenant (API key): the protocol
client every client process shares (`radixlm.runtime.transport.client.ProtocolClient`),
opened in the tenant's name.

Every HTTP request is one or more protocol requests on its tenant's connection; stored
responses and chat sessions are engine sessions owned by it, so they live as long as the
HTTP process stays connected.
"""

from __future__ import annotations

from radixlm.runtime import protocol as p
from radixlm.runtime.http.config import DEFAULT_LINK_TIMEOUT_S
from radixlm.runtime.transport.client import ProtocolClient
from radixlm.runtime.transport.curve import CurveKeys

__all__ = ["EngineLink"]


class EngineLink(ProtocolClient):
    """`tenant` with `gateway_token`: the connection is that tenant's (the frontend
    trusts the gateway credential); without a token it is the server's local one."""

    def __init__(self, endpoint: str, *, heartbeat_timeout: float = DEFAULT_LINK_TIMEOUT_S,
                 tenant: str | None = None, gateway_token: str | None = None,
                 curve: CurveKeys | None = None) -> None:
        gateway = None
        if tenant is not None and gateway_token is not None:
            gateway = p.Gateway(tenant=tenant, token=gateway_token)
        super().__init__(endpoint, client_name="radixlm-http", rid_prefix="h",
                         heartbeat_timeout=heartbeat_timeout, gateway=gateway, curve=curve)
