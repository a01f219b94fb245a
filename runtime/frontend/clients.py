"""The frontend's view of its clients: handshake state, in-flight requests, the ordered
queue of work waiting to reach the engine, and how to reach them (`Routes`: the client
ROUTER, the engine's PUSH pipe, the registry and the in-flight Generates, which the
frontend's parts share; main thread only).

A client is known by its ROUTER identity. Its messages reach the engine in the order it
sent them even when one of them is tokenized in a worker thread: every message becomes a
`QueuedWork` item at the back of the client's queue, and items leave from the front only
once their preparation has finished. Different clients never wait for each other.

Disconnects. A ROUTER does not say which peer left, so the frontend remembers the file
descriptor each client's first frame came in on (``ZMQ_SRCFD``) and watches the socket's
monitor for ``EVENT_DISCONNECTED`` of that descriptor. A descriptor can be reused by a new
connection only after the old one's disconnect event was queued, so seeing a new client
on a descriptor still mapped to another one means the monitor has news to read first.
"""

from __future__ import annotations

import errno
import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq
from radixlm.runtime import protocol as wire
from radixlm.runtime.engine.wire import EngineCommand, EngineOpenSession, EnginePin, ToEngine
from radixlm.runtime.frontend.streams import RequestStream
from radixlm.runtime.frontend.tenants import EngineNames
from radixlm.runtime.transport import channel

log = logging.getLogger("radixlm.frontend")


class QueuedWork:
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
        self.pending: deque[QueuedWork] = deque()
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


_SEND_MORE = zmq.SNDMORE | zmq.NOBLOCK


def _command_rid(msg: ToEngine) -> str | None:
    """The rid of a message the engine answers with one reply (not a Generate's)."""
    if isinstance(msg, EngineCommand):
        return msg.msg.rid
    if isinstance(msg, (EngineOpenSession, EnginePin)):
        return msg.rid
    return None


class Routes:
    """The sockets, the clients and the in-flight requests (see the module doc)."""

    def __init__(self, clients_sock: zmq.Socket[Any], engine_sock: zmq.Socket[Any],
                 on_gone: Callable[[bytes, str], None]) -> None:
        self.clients = ClientRegistry()
        self.streams: dict[int, RequestStream] = {}  # in-flight Generates by engine key
        self._sock = clients_sock
        self._engine_sock = engine_sock
        self._on_gone = on_gone  # a client turned out to be gone (its send failed)
        self.encode_reply = msgspec.msgpack.Encoder().encode  # the chunk path's own encoder

    def send(self, identity: bytes, data: bytes) -> bool:
        """Send an encoded reply; False (and the client is forgotten) if it is gone.

        Two `send` calls rather than `send_multipart` (channel.send): this runs once per
        streamed chunk, and pyzmq's send_multipart costs several microseconds more in
        Python. A vanished client fails on the identity frame, before anything is queued.
        """
        sock = self._sock
        try:
            sock.send(identity, _SEND_MORE)
            sock.send(data, zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self._on_gone(identity, "unreachable")
            return False

    def reply(self, client: ClientState, msg: msgspec.Struct) -> bool:
        return self.send(client.identity, wire.encode(msg))

    def error(self, client: ClientState, rid: str | None, code: str, message: str) -> None:
        log.debug("error %s for %r: %s", code, rid, message)
        self.reply(client, wire.Error(rid=rid, code=code, message=message))

    def to_engine(self, client: ClientState | None, msg: ToEngine) -> None:
        """Send `msg` to the engine (`client`: whose request it is, now owed a reply)."""
        if client is not None:
            client.touched_engine = True
            rid = _command_rid(msg)
            if rid is not None:
                client.awaiting.add(rid)
        channel.send(self._engine_sock, msg)

    def end_request(self, stream: RequestStream) -> None:
        """A Generate is over: forget it (its rid is free again)."""
        self.streams.pop(stream.key, None)
        client = self.clients.get(stream.client)
        if client is not None and client.inflight.get(stream.rid) == stream.key:
            del client.inflight[stream.rid]
