"""HTTP tenants: each API key is a tenant, as each CurveZMQ key is on the protocol.

A tenant has its own engine connection (`EngineLink`) and its own store of responses,
chat sessions and conversations: the engine's sessions belong to the connection that
opened them (another connection's session ids are unknown to it), and the store is only
ever reached through the tenant the request's key names. The connection declares its
tenant to the frontend as a trusted gateway (`EngineLink.gateway`), so the frontend
scopes its cache, namespaces and listings exactly as for a CurveZMQ key
(`radixlm.runtime.frontend.tenants`): nothing crosses keys, not even by the timing or
the ``cached_tokens`` of a shared prefix.

Without API keys there is one tenant, the server's local one (`LOCAL`): the HTTP API
then shares the cache with the local ipc clients, as every client on loopback does.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from radixlm.runtime.http.engine_link import EngineLink
from radixlm.runtime.http.store import ConversationStore

LOCAL = "local"


@dataclass
class Tenant:
    name: str  # "local", or "k" + a hash of the key (never the key itself)
    link: EngineLink
    store: ConversationStore


def tenant_name(key: str) -> str:
    """A stable name for a key that reveals nothing of it (no '/': the frontend's rule)."""
    return "k" + hashlib.sha256(b"radixlm-http-tenant\0" + key.encode()).hexdigest()[:24]


class Tenants:
    """API key -> tenant; with no keys, the one local tenant answers every request."""

    def __init__(self, keys: tuple[str, ...], make: Callable[[str | None], Tenant]) -> None:
        self._by_key = {k.encode(): make(k) for k in dict.fromkeys(keys)}
        self._local = None if keys else make(None)

    def __iter__(self) -> Iterator[Tenant]:
        if self._local is not None:
            yield self._local
        yield from self._by_key.values()

    @property
    def first(self) -> Tenant:
        return next(iter(self))

    @property
    def keyed(self) -> bool:
        return self._local is None

    def of(self, authorization: str) -> Tenant | None:
        """The tenant of an ``Authorization`` header's bearer key (None: not a key here).
        Every key is compared in constant time, so timing tells nothing of which matched."""
        if self._local is not None:
            return self._local
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        found = None
        for key, tenant in self._by_key.items():
            if hmac.compare_digest(given, key):
                found = tenant
        return found
