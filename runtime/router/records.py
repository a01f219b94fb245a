"""What the router remembers: each client and its links, each session's home and how to
rebuild it, each pin's holders, each request in flight.

A session's **log** is how its history was made, in protocol terms: how it was opened
(`Opened`), the inputs appended (`Appended`, rendered by the replica's frontend exactly as
they were the first time: same history, same flags, same template), the tokens the model
produced (`Produced`), and cuts (`Cut`). Replaying the log on another replica rebuilds the
same token history (replay.py), which is how a dead replica's sessions are re-homed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

import zmq
from radixlm.runtime.protocol import Error, Generate, Input, OpenSession, Tool

__all__ = ["Appended", "Client", "Cut", "LogEntry", "Opened", "Pending", "PinRecord", "Placement",
           "Produced", "SessionRecord"]


class Opened(NamedTuple):
    msg: OpenSession  # as the client sent it (its rid is replaced on replay)


class Appended(NamedTuple):
    input: Input
    tools: list[Tool] | None


class Produced(NamedTuple):
    token_ids: list[int]


class Cut(NamedTuple):
    length: int


LogEntry = Union[Opened, Appended, Produced, Cut]


@dataclass(eq=False)
class SessionRecord:
    """One session as the client knows it (`vid`), and where it lives now."""

    vid: str  # the id the client uses
    owner: bytes  # the client connection it belongs to
    tenant: str | None
    home: int  # replica index
    inner: str  # its id on that replica (== vid until it is re-homed)
    length: int  # history tokens, as the replica last said
    key: str  # routing key of its history (approximate)
    log: list[LogEntry]
    rehoming: bool = False
    # Messages that arrived while it was being re-homed: dispatched once it is home.
    waiting: deque[bytes] = field(default_factory=deque)
    recomputed: int = 0  # tokens recomputed to re-home it, reported by its next turn


@dataclass(eq=False)
class PinRecord:
    name: str  # as the client named it
    tenant: str | None
    msg_input: Input
    namespace: str | None
    key: str
    length: int
    holders: set[int] = field(default_factory=set)  # replicas holding it (said `Pinned`)
    placing: set[int] = field(default_factory=set)  # replicas it is being placed on
    # What waits for a placement to be answered (the engine registers a pin once its
    # prefill is done, so an open must not reach it before): called with (True, None)
    # once the replica holds it, (False, error) if it refused, (False, None) if the
    # placement was cut off (its replica died, or the client whose link carried it left).
    waiters: dict[int, list[Callable[[bool, Error | None], None]]] = field(
        default_factory=dict)
    uses: int = 0  # sessions opened from it
    everywhere: bool = False  # hot: placed on every live replica


@dataclass(eq=False)
class Placement:
    """A pin being placed on `replica` over `client`'s link (an internal request)."""

    pin: PinRecord
    replica: int
    client: bytes


@dataclass(eq=False)
class Pending:
    """A client request a replica is working on (by the client's rid)."""

    kind: str  # "generate", "open", "fork", "truncate", "pin", "plain", "abort"
    replica: int
    frame: bytes  # the client's frame, to send again on failover
    load: int = 0  # tokens it adds to the replica's load
    msg: Generate | OpenSession | None = None
    session: str | None = None  # the vid it names
    streamed: bool = False  # a chunk reached the client: it cannot be sent again
    dones: int = 0
    n: int = 1
    length: int = 0  # a truncate's
    input_key: str = ""  # a turn's input's key; a plain generate's whole key


@dataclass(eq=False)
class Client:
    """A client connection of the router: its links to the replicas it uses (one DEALER
    each, declaring its tenant) and its requests in flight, by its rids."""

    ident: bytes
    fd: int
    tenant: str | None
    welcomed: bool = False
    links: dict[int, zmq.Socket[Any]] = field(default_factory=dict)
    pending: dict[str, Pending] = field(default_factory=dict)
