"""The frontend's view of its clients: handshake state, in-flight requests, and the
ordered queue of work waiting to reach the engine.

A client is known by its ROUTER identity. Its messages reach the engine in the order it
sent them even when one of them is tokenized in a worker thread: every message becomes a
`Pending` item at the back of the client's queue, and items leave from the front only
once their preparation has finished. Different clients never wait for each other.

Disconnects. A ROUTER does not say which peer left, so the frontend remembers the file
descriptor each client's first frame came in on (``ZMQ_SRCFD``) and watches the socket's
monitor for ``EVENT_DISCONNECTED`` of that descriptor. A descriptor can be reused by a new
connection only after the old one's disconnect event was queued, so seeing a new client
on a descriptor still mapped to another one means the monitor has news to read first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from radixlm.runtime.frontend.tenants import EngineNames


class Pending:
    """Prepared (or being prepared) work; `then` runs on the main thread with the result."""

    __slots__ = ("future", "then")

    def __init__(self, future: Future[Any], then: Callable[[Any], None]) -> None:
        self.future = future
        self.then = then


class ClientState:
    __slots__ = ("identity", "fd", "welcomed", "inflight", "pending", "touched_engine",
                 "awaiting", "abandoned", "names")

    def __init__(self, identity: bytes, fd: int, names: EngineNames) -> None:
        self.identity = identity
        self.names = names  # its tenant's namespaces and pins as the engine knows them
        self.fd = fd
        self.welcomed = False
        self.inflight: dict[str, int] = {}  # rid -> key of this client's Generates
        self.pending: deque[Pending] = deque()
        self.touched_engine = False  # the engine may hold state for it (requests, sessions)
        self.awaiting: set[str] = set()  # rids of its commands the engine has yet to answer
        self.abandoned: set[str] = set()  # rids failed while the engine was unavailable


class ClientRegistry:
    def __init__(self) -> None:
        self._by_identity: dict[bytes, ClientState] = {}
        self._by_fd: dict[int, bytes] = {}

    def get(self, identity: bytes) -> ClientState | None:
        return self._by_identity.get(identity)

    def on_fd(self, fd: int) -> bytes | None:
        """The client whose connection used descriptor `fd`."""
        return self._by_fd.get(fd)

    def add(self, identity: bytes, fd: int, names: EngineNames) -> ClientState:
        client = ClientState(identity, fd, names)
        self._by_identity[identity] = client
        if fd >= 0:
            self._by_fd[fd] = identity
        return client

    def remove(self, identity: bytes) -> ClientState | None:
        client = self._by_identity.pop(identity, None)
        if client is not None and self._by_fd.get(client.fd) == identity:
            del self._by_fd[client.fd]
        return client

    def __iter__(self) -> Iterator[ClientState]:
        return iter(list(self._by_identity.values()))

    def __len__(self) -> int:
        return len(self._by_identity)
