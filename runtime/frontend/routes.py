"""Where the frontend's messages go, and which request is whose.

`Routes` is what the frontend's parts share: the client ROUTER (replies; a vanished
client fails its send and is forgotten), the engine's PUSH pipe, the client registry and
the in-flight Generates by engine key. Main thread only.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from radixlm.runtime import channel
from radixlm.runtime import protocol as wire
from radixlm.runtime.engine_wire import EngineCommand, EngineOpenSession, EnginePin, ToEngine
from radixlm.runtime.frontend.clients import ClientRegistry, ClientState
from radixlm.runtime.frontend.streams import RequestStream

log = logging.getLogger("radixlm.frontend")

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
