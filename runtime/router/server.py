"""The router's loop: one ROUTER socket for clients (the protocol of docs/protocol.md,
unchanged), a DEALER per (client, replica) it uses, a control DEALER per replica.

The router holds its parts, each with one concern, and is their `host.Host`:

- `replicas.ReplicaLinks`: the replicas' control connections and health, and the
  clients' links to them;
- `requests.Requests`: a client's requests to the replicas and the replies back, routed
  by `routing.Routing` (new work) or the `sessions.SessionTable` (a session's messages);
- `pins.PinPlacement`: which replicas hold each pin, and placing pins;
- `fanout.FanOut`: requests sent to several replicas, their replies merged (merge.py);
- `failover.Failover`: a replica that dies or stops answering is taken out, its
  requests retried or failed, its sessions rebuilt elsewhere from their logs.

This module is the clients' side (connections, hellos, tenants, departures), the loop,
and the replies to the router's own requests handed to the part that made them.

Single-threaded (a zmq poller): the router does no tokenizing and no model work, so a
decision costs microseconds (BENCHMARKS.md, routing cost).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import zmq
from radixlm.runtime import protocol as wire
from radixlm.runtime.frontend.frames import FrameError, decode_frame
from radixlm.runtime.frontend.tenants import GatewayRefused, gateway_names, names_for
from radixlm.runtime.router.config import RouterConfig
from radixlm.runtime.router.failover import Failover, Rehome
from radixlm.runtime.router.fanout import FanOut, Gather
from radixlm.runtime.router.host import INTERNAL, Job
from radixlm.runtime.router.pins import PinPlacement
from radixlm.runtime.router.records import Client, Placement
from radixlm.runtime.router.replicas import NoCredential, ReplicaLinks, ReplicaState
from radixlm.runtime.router.requests import Requests
from radixlm.runtime.router.routing import Routing
from radixlm.runtime.router.sessions import SessionTable
from radixlm.runtime.transport.exchange import Rids
from zmq.utils.monitor import parse_monitor_message

__all__ = ["Client", "Router"]

log = logging.getLogger("radixlm.router")


class Router:
    def __init__(self, config: RouterConfig, ctx: zmq.Context[Any], clients: zmq.Socket[Any],
                 monitor: zmq.Socket[Any], gateway_token: str | None) -> None:
        self.config = config
        self.sock = clients
        self.client_monitor = monitor
        self.token = gateway_token
        self.multi_tenant = bool(config.auth_dir)
        self.clients: dict[bytes, Client] = {}
        self.by_fd: dict[int, bytes] = {}
        self.jobs: dict[str, Job] = {}  # the router's own requests, by rid
        self._rids = Rids(INTERNAL)
        self.poller = zmq.Poller()
        self.poller.register(clients, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)
        self.welcome: wire.Welcome | None = None
        self.stopping = False
        self.routing = Routing(config.balance, len(config.replicas))
        self.replicas = ReplicaLinks(config, ctx, self.poller, self.routing,
                                     on_up=self._replica_up, on_down=self._replica_down,
                                     on_reply=self._on_reply)
        self.sessions = SessionTable(self.routing, len(config.replicas))
        self.pins = PinPlacement(self, self.sessions)
        self.fanout = FanOut(self, self.sessions.view)
        self.failover = Failover(self, self.sessions, self.pins, self.fanout)
        self.requests = Requests(self, self.sessions, self.pins, self.fanout)

    # -- the loop ---------------------------------------------------------------------------

    def start_replicas(self) -> None:
        self.replicas.start()

    def wait_first(self, timeout_s: float, settle_s: float = 0.0) -> wire.Welcome:
        """Serve nothing until one replica is up, then until every replica is or
        `settle_s` more have passed (so that a router whose replicas all serve does not
        report ready with half of them: its first stats would say half the capacity)."""
        deadline = time.monotonic() + timeout_s
        while self.welcome is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica answered in {timeout_s:g} s: "
                                   + ", ".join(r.spec.endpoint for r in self.replicas.replicas))
            self.step(0.1, serve_clients=False)
        settled = min(deadline, time.monotonic() + settle_s)
        while (not all(r.up for r in self.replicas.replicas)
               and time.monotonic() < settled):
            self.step(0.05, serve_clients=False)
        return self.welcome

    def serve(self) -> None:
        while not self.stopping:
            self.step(0.1)

    def step(self, timeout_s: float, serve_clients: bool = True) -> None:
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        now = time.monotonic()
        self.replicas.handle(ready, now)
        if serve_clients:
            if self.client_monitor in ready:
                self._drain_client_monitor()
            if self.sock in ready:
                self._drain_clients()
        self.fanout.expire(now)
        self.replicas.watch(now)

    # -- replicas -------------------------------------------------------------------------------

    def live(self) -> list[int]:
        return self.replicas.live()

    def internal_rid(self) -> str:
        return self._rids.new()

    def _replica_up(self, r: ReplicaState) -> None:
        if self.welcome is None:
            assert r.welcome is not None
            self.welcome = msgspec.structs.replace(
                r.welcome, max_message_bytes=self.config.max_message_bytes)

    def _replica_down(self, r: ReplicaState) -> None:
        self.failover.replica_down(r.index)

    def send(self, client: Client, replica: int, msg: wire.Struct | bytes) -> None:
        sock = client.links.get(replica)
        if sock is None:
            sock = self.replicas.link(client, replica)
        sock.send(msg if isinstance(msg, bytes) else wire.encode(msg))

    def _on_reply(self, client: Client, replica: int, msg: wire.ServerMessage,
                  data: bytes) -> None:
        rid = getattr(msg, "rid", None)
        if isinstance(msg, wire.Welcome):
            return
        if rid is None or not rid.startswith(INTERNAL):
            self.requests.reply(client, replica, msg, data)
            return
        job = self.jobs.get(rid)
        if isinstance(job, Gather):
            self.fanout.reply(job, replica, rid, msg)
        elif isinstance(job, Rehome):
            self.failover.reply(job, msg)
        elif isinstance(job, Placement):
            del self.jobs[rid]
            self.pins.placement_reply(job, replica, msg)

    # -- clients -------------------------------------------------------------------------------

    def _drain_clients(self) -> None:
        for _ in range(256):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            client = self.clients.get(ident) or self._register(ident, frames)
            if len(frames) != 2:
                self.error(client, None, wire.ErrorCode.BAD_MESSAGE,
                           "a message is exactly one frame")
                continue
            self._dispatch_guarded(client, frames[1].bytes)

    def _dispatch_guarded(self, client: Client, data: bytes) -> None:
        """A bug handling one message fails that request, never the router."""
        try:
            self.dispatch(client, data)
        except Exception as e:  # noqa: BLE001 - reported to the client and logged
            log.exception("handling a client message failed")
            msg = decode_frame(data)
            rid = None if isinstance(msg, FrameError) else getattr(msg, "rid", None)
            self.error(client, rid, wire.ErrorCode.INTERNAL, f"router: {type(e).__name__}: {e}")

    def _register(self, ident: bytes, frames: list[zmq.Frame]) -> Client:
        try:
            fd = frames[0].get(zmq.SRCFD)
        except zmq.ZMQError:
            fd = -1
        if fd >= 0 and fd in self.by_fd:
            self._drain_client_monitor()
            stale = self.by_fd.get(fd)
            if stale is not None:
                self._client_gone(stale)
        tenant = names_for(frames[-1], multi_tenant=self.multi_tenant).tenant
        client = Client(ident, fd, tenant)
        self.clients[ident] = client
        if fd >= 0:
            self.by_fd[fd] = ident
        return client

    def _drain_client_monitor(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self.client_monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                ident = self.by_fd.get(event["value"])
                if ident is not None:
                    self._client_gone(ident)

    def _client_gone(self, ident: bytes) -> None:
        """Its links close, so each replica ends its requests and closes its sessions."""
        client = self.clients.pop(ident, None)
        if client is None:
            return
        if self.by_fd.get(client.fd) == ident:
            del self.by_fd[client.fd]
        self.replicas.close_links(client)
        for r_index in {p.replica for p in client.pending.values()}:
            self.routing.unload(r_index, sum(
                p.load for p in client.pending.values() if p.replica == r_index))
        self.sessions.forget_owner(ident)
        self.fanout.client_gone(client)
        self.failover.client_gone(ident)
        self.pins.client_gone(ident)

    def reply(self, client: Client, msg: wire.Struct | bytes) -> None:
        data = msg if isinstance(msg, bytes) else wire.encode(msg)
        try:
            self.sock.send_multipart((client.ident, data), zmq.NOBLOCK)
        except zmq.ZMQError:  # gone (ROUTER_MANDATORY)
            self._client_gone(client.ident)

    def error(self, client: Client, rid: str | None, code: str, message: str) -> None:
        self.reply(client, wire.Error(rid=rid, code=code, message=message))

    def dispatch(self, client: Client, data: bytes) -> None:
        """One frame from a client: its hello, or a request routed to the replicas."""
        msg = decode_frame(data)
        if isinstance(msg, FrameError):
            self.error(client, msg.rid, msg.code, msg.message)
            return
        if isinstance(msg, wire.Hello):
            self._hello(client, msg)
            return
        if not client.welcomed:
            self.error(client, msg.rid, wire.ErrorCode.HANDSHAKE_REQUIRED, "send hello first")
            return
        live = self.replicas.live()
        if not live:
            self.error(client, msg.rid, wire.ErrorCode.ENGINE_UNAVAILABLE, "no replica is up")
            return
        try:
            self.requests.route(client, msg, data, live)
        except NoCredential as e:
            self.error(client, msg.rid, wire.ErrorCode.FORBIDDEN, str(e))

    def _hello(self, client: Client, msg: wire.Hello) -> None:
        if msg.protocol_version != wire.PROTOCOL_VERSION:
            self.error(client, None, wire.ErrorCode.UNSUPPORTED_VERSION,
                       f"this router speaks protocol {wire.PROTOCOL_VERSION}, "
                       f"not {msg.protocol_version}")
            return
        if msg.gateway is not None:
            try:
                tenant = gateway_names(msg.gateway, self.token).tenant
            except GatewayRefused as e:
                self.error(client, None, e.code, str(e))
                return
            if client.welcomed and tenant != client.tenant:
                self.error(client, None, wire.ErrorCode.FORBIDDEN,
                           "a connection's tenant is declared once, in its first hello")
                return
            client.tenant = tenant
        client.welcomed = True
        assert self.welcome is not None
        self.reply(client, self.welcome)

    def close(self) -> None:
        self.replicas.close()
