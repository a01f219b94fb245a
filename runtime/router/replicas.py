"""The router's connections to its replicas.

Each replica has a **control** connection, the router's own: it is how the router learns
a replica's `Welcome`, and watches it (a `stats` probe when it has been quiet for
`probe_interval_s`; silent for `replica_timeout_s`, or its connection closed, and it is
down). A replica is up once it has welcomed the control connection *and* answered a
`stats` there (its frontend welcomes alone; the stats reply says its engine serves), so
no request and no fan-out goes to one still starting or rejoining. A replica not up is
dialled again on a fresh connection when its last one has gone unanswered for
``max(rejoin_interval_s, replica_timeout_s)`` (zmq reconnects by itself, but a connection
stuck in a dead listener's backlog, or a session zmq gave up on, would never answer); its
welcome and stats bring it back, empty (its engine restarted: nothing of before is cached).

Each client of the router gets, lazily, one **link** per replica it uses: its own
connection, whose hello declares the client's tenant (`Gateway` ``relayed``, with the
replica's gateway credential), so the replica scopes and schedules that client exactly
as if it had connected directly: its sessions, in-flight limits, fairness, and its
sessions closing when it disconnects (the router closes its links then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq
from radixlm.runtime.protocol import PROTOCOL_VERSION, Gateway, Hello, Welcome, encode
from radixlm.runtime.router.config import ReplicaSpec
from radixlm.runtime.transport.channel import open_socket
from radixlm.runtime.transport.curve import load_curve_keys

__all__ = ["ReplicaState", "dial"]

_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


class NoCredential(Exception):
    """The router cannot speak for this tenant on that replica (no gateway token)."""


def dial(ctx: zmq.Context[Any], spec: ReplicaSpec, tenant: str | None,
         name: str) -> zmq.Socket[Any]:
    """A DEALER connected to `spec`, its hello (declaring `tenant`) already queued."""
    if tenant is not None and spec.gateway_token is None:
        raise NoCredential(f"the router has no gateway credential for replica {spec.endpoint} "
                           "(gateway_token=PATH): it cannot speak for an authenticated tenant")
    keys = load_curve_keys(spec.server_key, spec.client_key)
    options: dict[int, Any] = keys.socket_options() if keys is not None else {}
    sock = open_socket(ctx, zmq.DEALER, spec.endpoint, bind=False, options=options)
    gateway = (None if tenant is None else
               Gateway(tenant=tenant, token=spec.gateway_token or "", relayed=True))
    sock.send(encode(Hello(protocol_version=PROTOCOL_VERSION, client_name=name,
                           gateway=gateway)))
    return sock


@dataclass(eq=False)
class ReplicaState:
    index: int
    spec: ReplicaSpec
    control: zmq.Socket[Any] | None = None
    monitor: zmq.Socket[Any] | None = None
    welcome: Welcome | None = None
    up: bool = False
    heard: float = 0.0  # when the replica last said anything (monotonic)
    probe_sent: float | None = None
    dialled: float = 0.0  # when its control connection was opened (monotonic)
    generation: int = 0  # times it came up: a link from an older one is stale

    def open_control(self, ctx: zmq.Context[Any], now: float) -> None:
        self.close_control()
        self.control = dial(ctx, self.spec, None, "radixlm-router")
        self.monitor = self.control.get_monitor_socket(_EVENTS)
        self.heard, self.probe_sent, self.dialled = now, None, now

    def close_control(self) -> None:
        if self.control is not None:
            self.control.disable_monitor()
            if self.monitor is not None:
                self.monitor.close(linger=0)
            self.control.close(linger=0)
        self.control = self.monitor = None
