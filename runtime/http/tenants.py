"""HTTP tenants: each API key is a tenant, as each CurveZMQ key is on the protocol.

A tenant has its own engine connection (`EngineLink`) and its own store of responses,
chat sessions and conversations: the engine's sessions belong to the connection that
opened them (another connection's session ids are unknown to it), and the store is only
ever reached through the tenant the request's key names. The connection declares its
tenant to the frontend as a trusted gateway (its hello's `Gateway`), so the frontend
scopes its cache, namespaces and listings exactly as for a CurveZMQ key
(`radixlm.runtime.frontend.tenants`): nothing crosses keys, not even by the timing or
the ``cached_tokens`` of a shared prefix.

Without API keys there is one tenant, the server's local one: the HTTP API then shares
the cache with the local ipc clients, as every client on loopback does.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from radixlm.runtime.http.engine_link import EngineLink
from radixlm.runtime.http.store import ConversationStore


@dataclass
class Tenant:
    name: str  # "local", or "k" + a hash of the key (never the key itself)
    link: EngineLink
    store: ConversationStore


def tenant_name(key: str) -> str:
    """A stable name for a key that reveals nothing of it (no '/': the frontend's rule)."""
    return "k" + hashlib.sha256(b"radixlm-http-tenant\0" + key.encode()).hexdigest()[:24]


class Tenants:
    """API key -> tenant. `control` is the server's local tenant: it answers every request
    when there are no keys, and reads the engine's stats for /health and /metrics (a
    tenant's own connection sees no server-wide activity)."""

    def __init__(self, keys: tuple[str, ...], make: Callable[[str | None], Tenant]) -> None:
        self.control = make(None)
        self._by_key = {k.encode(): make(k) for k in dict.fromkeys(keys)}

    def __iter__(self) -> Iterator[Tenant]:
        yield self.control
        yield from self._by_key.values()

    @property
    def keyed(self) -> bool:
        return bool(self._by_key)

    def of(self, authorization: str) -> Tenant | None:
        """The tenant of an ``Authorization`` header's bearer key (None: not a key here).
        Every key is compared in constant time, so timing tells nothing of which matched."""
        if not self._by_key:
            return self.control
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        found = None
        for key, tenant in self._by_key.items():
            if hmac.compare_digest(given, key):
                found = tenant
        return found
