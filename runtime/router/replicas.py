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

`ReplicaLinks` holds both kinds of connection and the replicas' health; what a replica
coming up or going down means for requests and sessions is the router's (server.py,
failover.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from radixlm.runtime import protocol as wire
from radixlm.runtime.protocol import Gateway, Welcome, encode
from radixlm.runtime.router.config import ReplicaSpec, RouterConfig
from radixlm.runtime.router.host import INTERNAL
from radixlm.runtime.router.records import Client
from radixlm.runtime.router.routing import Routing
from radixlm.runtime.transport.channel import open_socket
from radixlm.runtime.transport.curve import load_curve_keys
from radixlm.runtime.transport.exchange import hello
from zmq.utils.monitor import parse_monitor_message

__all__ = ["NoCredential", "ReplicaLinks", "ReplicaState", "dial"]

log = logging.getLogger("radixlm.router")

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
    sock.send(encode(hello(name, gateway)))
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


OnReply = Callable[[Client, int, wire.ServerMessage, bytes], None]


class ReplicaLinks:
    """The replicas' control connections and health, and the clients' links to them, on
    the router's poller. `on_up` / `on_down` are told when a replica comes up or goes
    down (its links closed already); `on_reply` gets each reply on a link."""

    def __init__(self, config: RouterConfig, ctx: zmq.Context[Any], poller: zmq.Poller,
                 routing: Routing, *, on_up: Callable[[ReplicaState], None],
                 on_down: Callable[[ReplicaState], None], on_reply: OnReply) -> None:
        self.config, self.ctx, self.poller, self.routing = config, ctx, poller, routing
        self.on_up, self.on_down, self.on_reply = on_up, on_down, on_reply
        self.replicas = [ReplicaState(i, spec) for i, spec in enumerate(config.replicas)]
        self.links: dict[zmq.Socket[Any], tuple[Client, int]] = {}
        self._live: list[int] | None = None

    def start(self) -> None:
        now = time.monotonic()
        for r in self.replicas:
            self._dial_control(r, now)

    def live(self) -> list[int]:
        """The replicas up now (kept: every request asks)."""
        if self._live is None:
            self._live = [r.index for r in self.replicas if r.up]
            self.routing.alive = frozenset(self._live)
        return self._live

    def handle(self, ready: dict[Any, int], now: float) -> None:
        """Read what the poller found ready on the replicas' sockets."""
        for r in self.replicas:
            if r.monitor is not None and r.monitor in ready:
                self._drain_monitor(r)
            if r.control is not None and r.control in ready:
                self._drain_control(r, now)
        for sock in [s for s in ready if s in self.links]:
            self._drain_link(sock, now)

    # -- control connections and health ------------------------------------------------------

    def _dial_control(self, r: ReplicaState, now: float) -> None:
        for sock in (r.control, r.monitor):
            if sock is not None:
                self.poller.unregister(sock)
        r.open_control(self.ctx, now)
        assert r.control is not None and r.monitor is not None
        self.poller.register(r.control, zmq.POLLIN)
        self.poller.register(r.monitor, zmq.POLLIN)

    def _drain_control(self, r: ReplicaState, now: float) -> None:
        assert r.control is not None
        while True:
            try:
                data = r.control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = wire.decode_server(data)
            except msgspec.DecodeError:
                log.error("undecodable message from replica %d dropped", r.index)
                continue
            r.heard, r.probe_sent = now, None
            if r.up:
                continue
            if isinstance(msg, wire.Welcome):  # its frontend answers: is its engine serving?
                r.welcome = msg
                r.control.send(wire.encode(wire.GetStats(rid=INTERNAL + "rejoin")))
            elif isinstance(msg, wire.StatsReply) and r.welcome is not None:
                self._up(r)

    def _drain_monitor(self, r: ReplicaState) -> None:
        assert r.monitor is not None
        while r.monitor is not None:
            try:
                event = parse_monitor_message(r.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) and r.up:
                self.down(r, "its connection closed")

    def watch(self, now: float) -> None:
        """Probe the quiet replicas, take out the silent ones, dial the down ones afresh."""
        timeout = self.config.replica_timeout_s
        for r in self.replicas:
            if r.control is None:
                continue
            if not r.up:
                # A fresh connection now and then: one whose hello went unanswered may
                # be a dead end (a peer that never accepted it, a session zmq gave up).
                if now - r.dialled > max(self.config.rejoin_interval_s, timeout):
                    self._dial_control(r, now)
                continue
            quiet = now - r.heard
            if quiet > timeout:
                self.down(r, f"silent for {quiet:.1f} s")
            elif quiet > self.config.probe_interval_s and r.probe_sent is None:
                r.control.send(wire.encode(wire.GetStats(rid=INTERNAL + "probe")))
                r.probe_sent = now

    def _up(self, r: ReplicaState) -> None:
        """Its welcome and then a stats reply came: its engine serves (a replica is not
        sent work, nor asked in a fan-out, before)."""
        assert r.welcome is not None
        r.up = True
        r.generation += 1
        self._live = None
        log.info("replica %d up: %s (%s)", r.index, r.spec.endpoint, r.welcome.model)
        self.on_up(r)

    def down(self, r: ReplicaState, why: str) -> None:
        """Take `r` out: its load and cache forgotten, every link to it closed, a fresh
        control connection dialled (its welcome brings it back); then `on_down`."""
        log.warning("replica %d (%s) is down: %s", r.index, r.spec.endpoint, why)
        r.up, r.welcome = False, None
        self.routing.loads[r.index] = 0
        self._live = None
        self.routing.replica_gone(r.index)
        self._dial_control(r, time.monotonic())
        for sock, (client, replica) in list(self.links.items()):
            if replica == r.index:
                del client.links[replica]
                self.close_link(sock)
        self.on_down(r)

    # -- the clients' links -----------------------------------------------------------------

    def link(self, client: Client, replica: int) -> zmq.Socket[Any]:
        sock = client.links.get(replica)
        if sock is None:
            sock = dial(self.ctx, self.replicas[replica].spec, client.tenant,
                        "radixlm-router-link")
            client.links[replica] = sock
            self.links[sock] = (client, replica)
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def close_link(self, sock: zmq.Socket[Any]) -> None:
        self.links.pop(sock, None)
        with contextlib.suppress(KeyError):
            self.poller.unregister(sock)
        sock.close(linger=0)

    def close_links(self, client: Client) -> None:
        """A client left: its links close, so each replica ends its requests and closes
        its sessions."""
        for sock in client.links.values():
            self.close_link(sock)

    def _drain_link(self, sock: zmq.Socket[Any], now: float) -> None:
        while sock in self.links:
            client, replica = self.links[sock]
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.replicas[replica].heard = now
            try:
                msg = wire.decode_server(data)
            except msgspec.DecodeError:
                log.error("undecodable reply from replica %d dropped", replica)
                continue
            try:
                self.on_reply(client, replica, msg, data)
            except Exception:  # noqa: BLE001 - one reply's bug must not stop the router
                log.exception("handling a reply from replica %d failed", replica)

    def close(self) -> None:
        for sock in list(self.links):
            self.close_link(sock)
        for r in self.replicas:
            r.close_control()
