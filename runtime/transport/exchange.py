"""One request and its replies as the protocol defines them, with no I/O: written once for
every client (the async `Request` and `ProtocolClient`, the blocking `RawClient`, the
router's links to its replicas).

- `Rids`: request ids unused by one client (a prefix and a counter).
- `hello`: the handshake's first message.
- `Replies`: when a request is finished -- after its ``Error``, its single answer, or the
  ``Done`` of each of a ``Generate``'s ``n`` branches -- with an ``Error`` raised as its
  typed `EngineError`.
- `unexpected`: the error for a one-answer request's reply of another type than expected.

Only the protocol module and the typed errors: no anyio, no zmq.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    Chunk,
    Done,
    Error,
    Gateway,
    Hello,
    ServerMessage,
    Struct,
)
from radixlm.runtime.transport.errors import InternalError, error_from_reply

__all__ = ["Replies", "Rids", "hello", "unexpected"]

class Rids:
    """Request ids unused by one client: `prefix` and a hex counter. `new` makes the
    next one in C (a client makes one for every request); `with_prefix` one that says
    what it is."""

    __slots__ = ("_count", "new", "prefix")

    def __init__(self, prefix: str = "", start: int = 0) -> None:
        self.prefix = prefix
        self._count = itertools.count(start)
        literal = prefix.replace("{", "{{").replace("}", "}}")
        self.new: Callable[[], str] = map(f"{literal}{{:x}}".format, self._count).__next__

    def with_prefix(self, prefix: str) -> str:
        return f"{prefix}{next(self._count):x}"


def hello(client_name: str, gateway: Gateway | None = None, *,
          protocol_version: int = PROTOCOL_VERSION) -> Hello:
    """The first message of a connection (`gateway`: the tenant a trusted gateway speaks
    for; another `protocol_version`: tests of the refusal)."""
    return Hello(protocol_version=protocol_version, client_name=client_name, gateway=gateway)


def unexpected(reply: Any, msg: Struct) -> InternalError:
    """The error for an answer to `msg` of another type than expected (callers check the
    type inline: it is on every call's path)."""
    return InternalError(f"unexpected {type(reply).__name__} in answer to {type(msg).__name__}",
                         rid=getattr(msg, "rid", None))


class Replies:
    """One request's replies, as the protocol ends it: `take` each in order until
    `finished`. Every ``Done`` is kept in `dones` (those drained after an abort too)."""

    __slots__ = ("_dones_left", "dones", "rid")

    def __init__(self, rid: str, branches: int = 1) -> None:
        self.rid = rid
        self._dones_left = max(branches, 1)  # n < 1: wait for the engine's refusal
        self.dones: list[Done] = []

    @property
    def finished(self) -> bool:
        return self._dones_left <= 0

    def take(self, reply: ServerMessage) -> ServerMessage:
        """Count `reply` and return it; an ``Error`` raises its typed `EngineError`."""
        cls = type(reply)
        if cls is Done:
            self._dones_left -= 1
            self.dones.append(reply)  # type: ignore[arg-type]
        elif cls is Chunk:
            pass
        elif cls is Error:
            self._dones_left = 0
            raise error_from_reply(reply)  # type: ignore[arg-type]
        else:
            self._dones_left = 0
        return reply

    def sorted_dones(self) -> list[Done]:
        """The Dones, by branch index."""
        dones = self.dones
        if len(dones) > 1:
            dones.sort(key=lambda d: d.index)
        return dones
