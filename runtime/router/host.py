"""What the router's parts need of the router (server.py), which holds them all.

The parts: `requests.Requests` (clients' requests to the replicas and their replies back),
`sessions.SessionTable`, `pins.PinPlacement`, `fanout.FanOut`, `failover.Failover`, and
`replicas.ReplicaLinks`. Each is given the router as a `Host` and the other parts it uses.
The router's own requests to replicas (a fan-out's parts, a re-homing step, a pin
placement) are `jobs`, by the rid the router gave them (`internal_rid`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Union

from radixlm.runtime.protocol import Struct
from radixlm.runtime.router.config import RouterConfig
from radixlm.runtime.router.records import Client, Placement
from radixlm.runtime.router.routing import Routing

if TYPE_CHECKING:
    from radixlm.runtime.router.failover import Rehome
    from radixlm.runtime.router.fanout import Gather

__all__ = ["INTERNAL", "Host", "Job"]

INTERNAL = "radixlm-router:"  # rids of the router's own requests

Job = Union["Gather", "Rehome", Placement]


class Host(Protocol):
    config: RouterConfig
    routing: Routing
    clients: dict[bytes, Client]
    jobs: dict[str, Job]

    def internal_rid(self) -> str:
        """A new rid for one of the router's own requests."""

    def live(self) -> list[int]:
        """The replicas up now."""

    def send(self, client: Client, replica: int, msg: Struct | bytes) -> None:
        """Send to `replica` over `client`'s link (opened if it has none yet)."""

    def reply(self, client: Client, msg: Struct | bytes) -> None:
        """Send to the client."""

    def error(self, client: Client, rid: str | None, code: str, message: str) -> None:
        """Send the client an ``Error``."""

    def dispatch(self, client: Client, data: bytes) -> None:
        """Handle a client's frame (again: a retried request, a message that waited)."""
