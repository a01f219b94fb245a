"""The router's loop: one ROUTER socket for clients (the protocol of docs/protocol.md,
unchanged), a DEALER per (client, replica) it uses, a control DEALER per replica.

- Messages naming a session go to the replica that holds it (`records.SessionRecord`);
  forks and the branches of ``n > 1`` turns are born there and stay there.
- New sessions, pins and plain requests go where `routing.Routing` says (the longest
  estimated cached prefix, balanced against load; policy.py).
- Stats, session listings, cache flushes and unpins go to every live replica and their
  replies are merged (merge.py). A fan-out waits `replica_timeout_s` at most: a replica
  that has not answered by then is left out of a stats or listing reply (an
  ``engine_unavailable`` error for the others), so a fan-out never hangs on a replica
  that went quiet, died unnoticed or is coming back.
- A replica that dies or stops answering is taken out: requests it had that sent nothing
  to the client yet are sent again elsewhere, the rest fail with ``engine_unavailable``;
  each of its sessions is rebuilt on another replica from its log (replay.py), messages
  for it waiting meanwhile, and its next turn reports the recomputed tokens.

Single-threaded (a zmq poller): the router does no tokenizing and no model work, so a
decision costs microseconds (BENCHMARKS.md, routing cost).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from radixlm.runtime import protocol as wire
from radixlm.runtime.frontend.frames import FrameError, decode_frame
from radixlm.runtime.frontend.tenants import GatewayRefused, gateway_names, names_for
from radixlm.runtime.router.config import RouterConfig
from radixlm.runtime.router.durable import DurableSessions
from radixlm.runtime.router.keys import estimate_tokens, input_key
from radixlm.runtime.router.merge import merge_replies
from radixlm.runtime.router.records import (
    DETACHED,
    Appended,
    Cut,
    Opened,
    Pending,
    PinRecord,
    Placement,
    Produced,
    SessionRecord,
)
from radixlm.runtime.router.replay import replay_steps
from radixlm.runtime.router.replicas import NoCredential, ReplicaState, dial
from radixlm.runtime.router.routing import Routing
from zmq.utils.monitor import parse_monitor_message

__all__ = ["Router"]

log = logging.getLogger("radixlm.router")

_INTERNAL = "radixlm-router:"  # rids of the router's own requests
_UNAVAILABLE = wire.ErrorCode.ENGINE_UNAVAILABLE


@dataclass(eq=False)
class Client:
    ident: bytes
    fd: int
    tenant: str | None
    welcomed: bool = False
    links: dict[int, zmq.Socket[Any]] = field(default_factory=dict)
    pending: dict[str, Pending] = field(default_factory=dict)


@dataclass(eq=False)
class Gather:
    """A fanned-out request: one reply per replica, merged for the client."""

    client: Client
    rid: str
    waiting: dict[int, str]  # replica -> internal rid still unanswered
    replies: list[tuple[int, wire.ServerMessage]] = field(default_factory=list)
    on_done: Callable[[wire.ServerMessage], None] | None = None
    started: float = 0.0  # monotonic: a replica silent past the timeout is left out
    reads: bool = True  # stats, listings: a silent replica's part is left out (else: an error)


@dataclass(eq=False)
class Rehome:
    """A session being rebuilt on `target` from its log."""

    record: SessionRecord
    target: int
    steps: list[wire.ClientMessage]
    rid: str = ""
    inner: str = ""
    recomputed: int = 0


class Router:
    def __init__(self, config: RouterConfig, ctx: zmq.Context[Any], clients: zmq.Socket[Any],
                 monitor: zmq.Socket[Any], gateway_token: str | None) -> None:
        self.config = config
        self.ctx = ctx
        self.sock = clients
        self.client_monitor = monitor
        self.token = gateway_token
        self.multi_tenant = bool(config.auth_dir)
        self.replicas = [ReplicaState(i, spec) for i, spec in enumerate(config.replicas)]
        self.routing = Routing(config.balance, len(self.replicas))
        self.homed = [0] * len(self.replicas)  # sessions each replica holds
        self.clients: dict[bytes, Client] = {}
        self.by_fd: dict[int, bytes] = {}
        self.links: dict[zmq.Socket[Any], tuple[Client, int]] = {}
        self.sessions: dict[str, SessionRecord] = {}
        self.inner_to_vid: dict[tuple[int, str], str] = {}
        self.pins: dict[tuple[str | None, str], PinRecord] = {}
        self.internal: dict[str, Gather | Rehome | Placement] = {}
        self.gathers: dict[Gather, None] = {}  # unanswered fan-outs, oldest first
        self.rids = itertools.count()
        self.poller = zmq.Poller()
        self.poller.register(clients, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)
        self.welcome: wire.Welcome | None = None
        self.stopping = False
        self._live: list[int] | None = None
        # (reads back its sessions)
        self.durable = DurableSessions(self, config.state_dir, config.state_name)

    # -- the loop ---------------------------------------------------------------------------

    def start_replicas(self) -> None:
        now = time.monotonic()
        for r in self.replicas:
            self._dial_control(r, now)

    def wait_first(self, timeout_s: float, settle_s: float = 0.0) -> wire.Welcome:
        """Serve nothing until one replica is up, then until every replica is or
        `settle_s` more have passed (so that a router whose replicas all serve does not
        report ready with half of them: its first stats would say half the capacity)."""
        deadline = time.monotonic() + timeout_s
        while self.welcome is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no replica answered in {timeout_s:g} s: "
                                   + ", ".join(r.spec.endpoint for r in self.replicas))
            self.step(0.1, serve_clients=False)
        settled = min(deadline, time.monotonic() + settle_s)
        while not all(r.up for r in self.replicas) and time.monotonic() < settled:
            self.step(0.05, serve_clients=False)
        return self.welcome

    def serve(self) -> None:
        while not self.stopping:
            self.step(0.1)

    def step(self, timeout_s: float, serve_clients: bool = True) -> None:
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        now = time.monotonic()
        for r in self.replicas:
            if r.monitor is not None and r.monitor in ready:
                self._drain_replica_monitor(r)
            if r.control is not None and r.control in ready:
                self._drain_control(r, now)
        for sock in [s for s in ready if s in self.links]:
            self._drain_link(sock, now)
        if serve_clients:
            if self.client_monitor in ready:
                self._drain_client_monitor()
            if self.sock in ready:
                self._drain_clients()
        self._watch(now)

    # -- replicas -----------------------------------------------------------------------------

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
                r.control.send(wire.encode(wire.GetStats(rid=_INTERNAL + "rejoin")))
            elif isinstance(msg, wire.StatsReply) and r.welcome is not None:
                self._replica_up(r, r.welcome)

    def _drain_replica_monitor(self, r: ReplicaState) -> None:
        assert r.monitor is not None
        while r.monitor is not None:
            try:
                event = parse_monitor_message(r.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED) and r.up:
                self._replica_down(r, "its connection closed")

    def _watch(self, now: float) -> None:
        timeout = self.config.replica_timeout_s
        for job in list(self.gathers):  # oldest first
            if now - job.started <= timeout:
                break
            self._gather_expired(job, now)
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
            if quiet > self.config.replica_timeout_s:
                self._replica_down(r, f"silent for {quiet:.1f} s")
            elif quiet > self.config.probe_interval_s and r.probe_sent is None:
                r.control.send(wire.encode(wire.GetStats(rid=_INTERNAL + "probe")))
                r.probe_sent = now

    def _replica_up(self, r: ReplicaState, welcome: wire.Welcome) -> None:
        """Its welcome and then a stats reply came: its engine serves (a replica is not
        sent work, nor asked in a fan-out, before)."""
        if r.up:
            return
        r.up, r.welcome = True, welcome
        r.generation += 1
        self._live = None
        if self.welcome is None:
            self.welcome = msgspec.structs.replace(
                welcome, max_message_bytes=self.config.max_message_bytes)
        log.info("replica %d up: %s (%s)", r.index, r.spec.endpoint, welcome.model)

    def _replica_down(self, r: ReplicaState, why: str) -> None:
        log.warning("replica %d (%s) is down: %s", r.index, r.spec.endpoint, why)
        r.up, r.welcome = False, None
        self.routing.loads[r.index] = 0
        self._live = None
        self.routing.replica_gone(r.index)
        self._dial_control(r, time.monotonic())  # a fresh connection: its welcome brings it back
        retry: list[tuple[Client, str, Pending]] = []
        for client in self.clients.values():
            link = client.links.pop(r.index, None)
            if link is not None:
                self._close_link(link)
            for rid, p in list(client.pending.items()):
                if p.replica == r.index:
                    del client.pending[rid]
                    retry.append((client, rid, p))
        for rid, job in list(self.internal.items()):
            if isinstance(job, Placement) and job.replica == r.index:
                del self.internal[rid]
        for pin in self.pins.values():
            pin.holders.discard(r.index)
            self._placed(pin, r.index, False, None)
        again = [s for s in self.sessions.values() if s.home == r.index and not s.rehoming]
        for rid, job in list(self.internal.items()):
            if isinstance(job, Gather) and job.waiting.get(r.index) == rid:  # its own rid only
                del self.internal[rid]
                del job.waiting[r.index]
                self._gather_check(job)
            elif isinstance(job, Rehome) and job.target == r.index:
                del self.internal[rid]
                again.append(job.record)  # started again below, elsewhere
        for record in again:
            self._start_rehome(record)
        for client, rid, p in retry:
            self._retry(client, rid, p)

    def _retry(self, client: Client, rid: str, p: Pending) -> None:
        """A request its replica died on: sent again if the client saw nothing of it."""
        if p.kind == "open":
            self.homed[p.replica] -= 1
        record = self.sessions.get(p.session) if p.session else None
        if p.streamed or p.dones or p.kind == "abort":
            self._error(client, rid, _UNAVAILABLE, "the replica serving this request stopped "
                        "(the session, if any, is kept: it is being rebuilt elsewhere)")
        elif record is not None and record.rehoming:
            record.waiting.append(p.frame)
        else:
            self._dispatch(client, p.frame)

    def live(self) -> list[int]:
        """The replicas up now (kept: every request asks)."""
        if self._live is None:
            self._live = [r.index for r in self.replicas if r.up]
            self.routing.alive = frozenset(self._live)
        return self._live

    # -- links ---------------------------------------------------------------------------------

    def _link(self, client: Client, replica: int) -> zmq.Socket[Any]:
        sock = client.links.get(replica)
        if sock is None:
            sock = dial(self.ctx, self.replicas[replica].spec, client.tenant,
                        "radixlm-router-link")
            client.links[replica] = sock
            self.links[sock] = (client, replica)
            self.poller.register(sock, zmq.POLLIN)
        return sock

    def _close_link(self, sock: zmq.Socket[Any]) -> None:
        self.links.pop(sock, None)
        with contextlib.suppress(KeyError):
            self.poller.unregister(sock)
        sock.close(linger=0)

    def _send(self, client: Client, replica: int, msg: wire.Struct | bytes) -> None:
        self._link(client, replica).send(msg if isinstance(msg, bytes) else wire.encode(msg))

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
                self._on_reply(client, replica, msg, data)
            except Exception:  # noqa: BLE001 - one reply's bug must not stop the router
                log.exception("handling a reply from replica %d failed", replica)

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
                self._error(client, None, wire.ErrorCode.BAD_MESSAGE,
                            "a message is exactly one frame")
                continue
            self._dispatch_guarded(client, frames[1].bytes)

    def _dispatch_guarded(self, client: Client, data: bytes) -> None:
        """A bug handling one message fails that request, never the router."""
        try:
            self._dispatch(client, data)
        except Exception as e:  # noqa: BLE001 - reported to the client and logged
            log.exception("handling a client message failed")
            msg = decode_frame(data)
            rid = None if isinstance(msg, FrameError) else getattr(msg, "rid", None)
            self._error(client, rid, wire.ErrorCode.INTERNAL, f"router: {type(e).__name__}: {e}")

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
        for sock in client.links.values():
            self._close_link(sock)
        for r_index in {p.replica for p in client.pending.values()}:
            self.routing.unload(r_index, sum(
                p.load for p in client.pending.values() if p.replica == r_index))
        self.durable.client_gone(ident)  # its durable sessions detached, the others forgotten
        for rid, job in list(self.internal.items()):
            if ((isinstance(job, Gather) and job.client is client)
                    or (isinstance(job, Rehome) and job.record.owner == ident)):
                del self.internal[rid]
                if isinstance(job, Gather):
                    self.gathers.pop(job, None)
            elif isinstance(job, Placement) and job.client == ident:
                del self.internal[rid]  # its link is gone: what waited is routed again
                self._placed(job.pin, job.replica, False, None)

    def _reply(self, client: Client, msg: wire.Struct | bytes) -> None:
        data = msg if isinstance(msg, bytes) else wire.encode(msg)
        try:
            self.sock.send_multipart((client.ident, data), zmq.NOBLOCK)
        except zmq.ZMQError:  # gone (ROUTER_MANDATORY)
            self._client_gone(client.ident)

    def _error(self, client: Client, rid: str | None, code: str, message: str) -> None:
        self._reply(client, wire.Error(rid=rid, code=code, message=message))

    # -- client requests --------------------------------------------------------------------------

    def _dispatch(self, client: Client, data: bytes) -> None:
        msg = decode_frame(data)
        if isinstance(msg, FrameError):
            self._error(client, msg.rid, msg.code, msg.message)
            return
        if isinstance(msg, wire.Hello):
            self._hello(client, msg)
            return
        if not client.welcomed:
            self._error(client, msg.rid, wire.ErrorCode.HANDSHAKE_REQUIRED,
                        "send hello first")
            return
        live = self.live()
        if not live:
            self._error(client, msg.rid, _UNAVAILABLE, "no replica is up")
            return
        try:
            self._route(client, msg, data, live)
        except NoCredential as e:
            self._error(client, msg.rid, wire.ErrorCode.FORBIDDEN, str(e))

    def _hello(self, client: Client, msg: wire.Hello) -> None:
        if msg.protocol_version != wire.PROTOCOL_VERSION:
            self._error(client, None, wire.ErrorCode.UNSUPPORTED_VERSION,
                        f"this router speaks protocol {wire.PROTOCOL_VERSION}, "
                        f"not {msg.protocol_version}")
            return
        if msg.gateway is not None:
            try:
                tenant = gateway_names(msg.gateway, self.token).tenant
            except GatewayRefused as e:
                self._error(client, None, e.code, str(e))
                return
            if client.welcomed and tenant != client.tenant:
                self._error(client, None, wire.ErrorCode.FORBIDDEN,
                            "a connection's tenant is declared once, in its first hello")
                return
            client.tenant = tenant
        client.welcomed = True
        assert self.welcome is not None
        self._reply(client, self.welcome)

    def _route(self, client: Client, msg: wire.ClientMessage, data: bytes,
               live: list[int]) -> None:
        sid = _session_named(msg)
        if sid is not None:
            record = self.sessions.get(sid)
            if record is None or record.owner != client.ident:
                self._forward(client, live[0], msg.rid, data, Pending("plain", live[0], data))
                return  # the replica answers not_found, in its words
            if record.rehoming:
                record.waiting.append(data)
                return
            self._session_request(client, record, msg, data)
        elif isinstance(msg, wire.Generate):
            key = self.routing.key(client.tenant, msg.namespace, msg.input, msg.tools)
            replica, load = self.routing.place(key, live, msg.input, msg.sampling.max_tokens)
            self._forward(client, replica, msg.rid, data,
                          Pending("generate", replica, data, load, msg, n=msg.n, input_key=key))
        elif isinstance(msg, wire.OpenSession):
            self._open(client, msg, data, live)
        elif isinstance(msg, wire.Pin):
            self._pin(client, msg, data, live)
        elif isinstance(msg, wire.ResumeSession):
            self.durable.resume(client, msg, data, live)
        elif isinstance(msg, wire.CloseSession):
            self._close(client, msg, live)
        elif isinstance(msg, wire.Abort):
            p = client.pending.get(msg.rid)
            replica = p.replica if p is not None else live[0]
            self._send(client, replica, data)
        elif isinstance(msg, (wire.GetStats, wire.ListSessions, wire.FlushCache)):
            if isinstance(msg, wire.FlushCache):
                self.routing.flush(client.tenant)
            self._fan_out(client, msg, live)
        elif isinstance(msg, wire.Unpin):
            pin = self.pins.get((client.tenant, msg.name))
            holders = sorted(pin.holders & set(live)) if pin is not None else []
            if not holders:
                self._forward(client, live[0], msg.rid, data, Pending("plain", live[0], data))
                return
            assert pin is not None
            del self.pins[(client.tenant, msg.name)]
            self.durable.unpinned(client.tenant, msg.name)
            self._fan_out(client, msg, holders)
        else:  # tokenize, detokenize: any replica
            replica = min(live, key=lambda i: self.routing.loads[i])
            self._forward(client, replica, msg.rid, data, Pending("plain", replica, data))

    def _forward(self, client: Client, replica: int, rid: str, sent: bytes, p: Pending) -> None:
        """Send `sent` (the client's frame, or it in the replica's terms) and remember the
        request (`p.frame` is the client's own, to route again on failover)."""
        client.pending[rid] = p
        self.routing.loads[replica] += p.load
        self._send(client, replica, sent)

    def _session_request(self, client: Client, record: SessionRecord,
                         msg: wire.ClientMessage, data: bytes) -> None:
        """A turn, fork, truncate or close of one session: to its home, by its inner id."""
        if isinstance(msg, wire.CloseSession):
            self._close(client, msg, self.live())
            return
        sent = data if record.inner == record.vid else wire.encode(
            _with_session(msg, record.inner))
        if isinstance(msg, wire.Generate):
            key = input_key(msg.input, msg.tools)
            load = estimate_tokens(msg.input, key) + (msg.sampling.max_tokens or 0)
            self._forward(client, record.home, msg.rid, sent, Pending(
                "generate", record.home, data, load, msg, session=record.vid, n=msg.n,
                input_key=key))
        elif isinstance(msg, wire.TruncateSession):
            self._forward(client, record.home, msg.rid, sent, Pending(
                "truncate", record.home, data, session=record.vid, length=msg.length))
        else:
            self._forward(client, record.home, msg.rid, sent,
                          Pending("fork", record.home, data, session=record.vid))

    def _open(self, client: Client, msg: wire.OpenSession, data: bytes, live: list[int]) -> None:
        """A new session: counted as its replica's at once (`homed`), so a burst of
        opens spreads before their replies come back."""
        load = 0
        if msg.pinned is not None:
            pin = self.pins.get((client.tenant, msg.pinned))
            if pin is not None:
                replica = self._pin_home(client, pin, live)
                self.homed[replica] += 1
                self._after_pin(client, pin, replica, msg, data)
                return
            replica = live[0]  # unknown here: the replica says so
        else:
            key = self.routing.key(client.tenant, msg.namespace, msg.input, None)
            replica, load = self.routing.place(key, live, msg.input, 0)
        self.homed[replica] += 1
        self._forward(client, replica, msg.rid, data, Pending("open", replica, data, load, msg))

    def _pin(self, client: Client, msg: wire.Pin, data: bytes, live: list[int]) -> None:
        known = self.pins.get((client.tenant, msg.name))
        if known is not None and known.holders & set(live):  # the holder says duplicate_id
            replica = min(known.holders & set(live))
        else:
            key = self.routing.key(client.tenant, msg.namespace, msg.input, None)
            replica, _ = self.routing.place(key, live, msg.input, 0)
        self._forward(client, replica, msg.rid, data, Pending("pin", replica, data))

    def _pin_home(self, client: Client, pin: PinRecord, live: list[int]) -> int:
        """Where a session opened from `pin` goes: of its live holders and the replicas it
        is being placed on, the one homing fewest sessions (then the least loaded; an
        open on a replica still placing it waits for the placement's answer:
        `PinRecord.waiters`); with none, one where routing places it again (its input is
        kept). A pin used `hot_pin_uses` times is
        placed on every live replica; a replica holds it once it has said so."""
        pin.uses += 1
        if pin.uses >= self.config.hot_pin_uses:
            pin.everywhere = True
        alive = set(live)
        if pin.everywhere:
            for replica in live:
                if replica not in pin.holders and replica not in pin.placing:
                    self._place_pin(client, pin, replica)
        # A replica it is being placed on counts as one (an open there waits for the
        # placement's answer): a burst of opens right after the pin went hot spreads,
        # instead of all going to the first holder while the others' placements run.
        candidates = (pin.holders | pin.placing) & alive
        if candidates:
            # sessions homed first: a session's load comes later (its turns), and one
            # waiting for a placement has none yet, so load first sent a burst of opens
            # all to the replica still placing the pin
            return min(candidates, key=lambda i: (self.homed[i], self.routing.loads[i], i))
        replica = self.routing.place(pin.key, live, pin.msg_input, 0)[0]
        self._place_pin(client, pin, replica)
        return replica

    def _place_pin(self, client: Client, pin: PinRecord, replica: int) -> None:
        rid = self._internal_rid()
        self.internal[rid] = Placement(pin, replica, client.ident)
        pin.placing.add(replica)
        self._send(client, replica, wire.Pin(rid=rid, name=pin.name, input=pin.msg_input,
                                             namespace=pin.namespace))
        self.routing.tree.insert(pin.key, replica)

    def _placed(self, pin: PinRecord, replica: int, held: bool,
                error: wire.Error | None) -> None:
        """A placement answered (or cut off): run what waited for it."""
        pin.placing.discard(replica)
        if held:
            pin.holders.add(replica)
        for waiter in pin.waiters.pop(replica, []):
            waiter(held, error)

    def _after_pin(self, client: Client, pin: PinRecord, replica: int, msg: wire.OpenSession,
                   data: bytes) -> None:
        """Open from `pin` on `replica` once it holds it."""
        def go(held: bool, error: wire.Error | None) -> None:
            if client.ident not in self.clients:
                return
            if held:
                self._forward(client, replica, msg.rid, data, Pending("open", replica, data,
                                                                      msg=msg))
                return
            self.homed[replica] -= 1
            if error is not None:
                self._reply(client, msgspec.structs.replace(error, rid=msg.rid))
            else:
                self._dispatch(client, data)  # routed again

        if replica in pin.holders:
            go(True, None)
        else:
            pin.waiters.setdefault(replica, []).append(go)

    def _close(self, client: Client, msg: wire.CloseSession, live: list[int]) -> None:
        records = []
        for vid in msg.ids():
            record = self.sessions.get(vid)
            if record is None or record.owner != client.ident:
                data = wire.encode(msg)
                self._forward(client, live[0], msg.rid, data, Pending("plain", live[0], data))
                return  # the replica names the unknown one
            records.append(record)
        by_home: dict[int, list[str]] = {}
        for record in records:
            if record.rehoming:  # nothing of it lives anywhere yet: forget it now
                self._forget(record.vid)
            else:
                by_home.setdefault(record.home, []).append(record.inner)
        vids = [r.vid for r in records]
        if not by_home:
            self._reply(client, wire.Ok(rid=msg.rid))
            return
        gather = Gather(client, msg.rid, {},
                        on_done=lambda reply: [self._forget(v) for v in vids
                                               if not isinstance(reply, wire.Error)],
                        started=time.monotonic(), reads=False)
        self.gathers[gather] = None
        for replica, inners in by_home.items():
            rid = self._internal_rid()
            gather.waiting[replica] = rid
            self.internal[rid] = gather
            self._send(client, replica, wire.CloseSession(rid=rid, sessions=inners))

    def _fan_out(self, client: Client, msg: wire.ClientMessage, replicas: list[int]) -> None:
        gather = Gather(client, msg.rid, {}, started=time.monotonic(),
                        reads=isinstance(msg, (wire.GetStats, wire.ListSessions)))
        self.gathers[gather] = None
        for replica in replicas:
            rid = self._internal_rid()
            gather.waiting[replica] = rid
            self.internal[rid] = gather
            self._send(client, replica, msgspec.structs.replace(msg, rid=rid))

    def _internal_rid(self) -> str:
        return f"{_INTERNAL}{next(self.rids)}"

    # -- replies -----------------------------------------------------------------------------------

    def _on_reply(self, client: Client, replica: int, msg: wire.ServerMessage, data: bytes) -> None:
        rid = getattr(msg, "rid", None)
        if isinstance(msg, wire.Welcome):
            return
        if rid is not None and rid.startswith(_INTERNAL):
            job = self.internal.get(rid)
            if isinstance(job, Gather):
                self._gather_reply(job, replica, rid, msg)
            elif isinstance(job, Rehome):
                self._rehome_reply(job, msg)
            elif isinstance(job, Placement):
                del self.internal[rid]
                error = msg if isinstance(msg, wire.Error) else None
                held = error is None or error.code == wire.ErrorCode.DUPLICATE_ID  # (already)
                if not held:
                    log.warning("placing a pin on replica %d failed: %s", replica, msg)
                self._placed(job.pin, replica, held, None if held else error)
            return
        p = client.pending.get(rid) if rid is not None else None
        if p is None:
            self._reply(client, data)  # an abort's ok, an error without a request
            return
        if isinstance(msg, wire.Chunk):
            p.streamed = True
            self._reply(client, data)
            return
        if isinstance(msg, wire.Ok) and p.kind == "generate":
            self._reply(client, data)  # the reply to an abort of this generation
            return
        if p.kind == "resume":
            del client.pending[rid]
            answer = self.durable.resumed(client, replica, p, msg)
            if answer is not None:
                self._reply(client, answer)
            return
        finished = True
        if isinstance(msg, wire.Done):
            p.dones += 1
            finished = p.dones >= p.n
            msg = self._done(client, replica, p, msg)
        elif isinstance(msg, wire.SessionOpened):
            msg = self._opened(client, replica, p, msg)
        elif isinstance(msg, wire.SessionsForked):
            msg = self._forked(client, replica, p, msg)
        elif isinstance(msg, wire.Pinned):
            self._pinned(client, replica, p, msg)
        elif isinstance(msg, wire.Ok) and p.kind == "truncate" and p.session in self.sessions:
            record = self.sessions[p.session]
            record.length = p.length
            record.log.append(Cut(p.length))
        if isinstance(msg, wire.Error) and p.kind == "open":
            self.homed[replica] -= 1  # no session after all
        if finished:
            del client.pending[rid]
            self.routing.unload(replica, p.load)
        self.durable.after_reply(p, msg)
        self._reply(client, msg)

    def _done(self, client: Client, replica: int, p: Pending, done: wire.Done) -> wire.Done:
        record = self.sessions.get(p.session) if p.session else None
        if record is None and p.session is None and isinstance(p.msg, wire.Generate):
            if p.msg.input.messages is not None and p.n == 1:  # the next turn resends it
                self.routing.tree.insert(p.input_key + "\x1eassistant\x1f" + done.text, replica)
            return done
        if record is None or p.msg is None or not isinstance(p.msg, wire.Generate):
            return done
        turn = p.msg
        if done.finish_reason == "abort" and done.session is None:
            return done
        if turn.n == 1:
            if done.session_length is not None:
                record.log += [Appended(turn.input, turn.tools), Produced(list(done.token_ids))]
                record.length = done.session_length
                record.key += p.input_key + done.text
                self.routing.tree.insert(record.key, replica)
            done = self._report_recomputed(record, done)
            return msgspec.structs.replace(done, session=record.vid) if done.session else done
        # n > 1: the parent grows by the input; each branch is a new session there.
        if p.dones == 1:
            record.log.append(Appended(turn.input, turn.tools))
            record.key += p.input_key
            if done.session_length is not None:
                record.length = done.session_length - len(done.token_ids)
            done = self._report_recomputed(record, done)
        if done.session is None:
            return done
        branch = self._adopt(client, replica, done.session, record.log + [
            Produced(list(done.token_ids))], done.session_length or 0, record.key + done.text)
        return msgspec.structs.replace(done, session=branch.vid)

    def _report_recomputed(self, record: SessionRecord, done: wire.Done) -> wire.Done:
        if not record.recomputed:
            return done
        extra, record.recomputed = record.recomputed, 0
        usage = msgspec.structs.replace(
            done.usage, recomputed_tokens=done.usage.recomputed_tokens + extra,
            cached_tokens=max(0, done.usage.cached_tokens - extra))
        return msgspec.structs.replace(done, usage=usage)

    def _adopt(self, client: Client, replica: int, inner: str, log_: list[Any], length: int,
               key: str, counted: bool = False) -> SessionRecord:
        """A session a replica made (opened, forked, branched): the client sees `inner`,
        unless that id is already another session's here (ids are random per replica)."""
        vid = inner
        while vid in self.sessions:
            vid = secrets.token_hex(16)
        record = SessionRecord(vid, client.ident, client.tenant, replica, inner, length, key,
                               log_)
        self.sessions[vid] = record
        if not counted:  # (an open was counted when it was routed)
            self.homed[replica] += 1
        self.inner_to_vid[(replica, inner)] = vid
        return record

    def _opened(self, client: Client, replica: int, p: Pending,
                opened: wire.SessionOpened) -> wire.SessionOpened:
        msg = p.msg
        assert isinstance(msg, wire.OpenSession)
        if msg.pinned is not None:
            pin = self.pins.get((client.tenant, msg.pinned))
            key = pin.key if pin is not None else ""
        else:
            key = self.routing.key(client.tenant, msg.namespace, msg.input, None)
        record = self._adopt(client, replica, opened.session, [Opened(msg)], opened.length, key,
                             counted=True)
        if key:
            self.routing.tree.insert(key, replica)
        return msgspec.structs.replace(opened, session=record.vid)

    def _forked(self, client: Client, replica: int, p: Pending,
                forked: wire.SessionsForked) -> wire.SessionsForked:
        parent = self.sessions.get(p.session or "")
        if parent is None:
            return forked
        vids = [self._adopt(client, replica, inner, list(parent.log), parent.length,
                            parent.key).vid for inner in forked.sessions]
        return msgspec.structs.replace(forked, sessions=vids)

    def _pinned(self, client: Client, replica: int, p: Pending, pinned: wire.Pinned) -> None:
        msg = wire.decode_client(p.frame)
        assert isinstance(msg, wire.Pin)
        key = self.routing.key(client.tenant, msg.namespace, msg.input, None)
        pin = self.pins.get((client.tenant, msg.name))
        if pin is None:
            pin = PinRecord(msg.name, client.tenant, msg.input, msg.namespace, key, pinned.length)
            self.pins[(client.tenant, msg.name)] = pin
        pin.holders.add(replica)
        self.routing.tree.insert(key, replica)
        self.durable.pinned(pin)

    def _forget(self, vid: str) -> None:
        record = self.sessions.pop(vid, None)
        if record is not None:
            self.inner_to_vid.pop((record.home, record.inner), None)
            self.homed[record.home] -= 1
            self.durable.forgotten(record)

    # -- fan-outs -----------------------------------------------------------------------------------

    def _gather_reply(self, job: Gather, replica: int, rid: str, msg: wire.ServerMessage) -> None:
        del self.internal[rid]
        job.waiting.pop(replica, None)
        job.replies.append((replica, msg))
        self._gather_check(job)

    def _gather_expired(self, job: Gather, now: float) -> None:
        """Replicas that have not answered a fan-out in `replica_timeout_s` are left out
        of it: a stats call never hangs on a replica that went quiet, restarted or is
        rejoining (one silent that long is taken out anyway, by its control probes)."""
        for replica, rid in job.waiting.items():
            self.internal.pop(rid, None)
            quiet = now - job.started
            log.warning("replica %d did not answer a fan-out in %.1f s: left out of it",
                        replica, quiet)
            if not job.reads:
                job.replies.append((replica, wire.Error(
                    rid=job.rid, code=_UNAVAILABLE,
                    message=f"replica {replica} did not answer in {quiet:.1f} s")))
        job.waiting.clear()
        self._gather_check(job)

    def _gather_check(self, job: Gather) -> None:
        if job.waiting:
            return
        self.gathers.pop(job, None)
        merged = merge_replies(job.rid, [m for _, m in job.replies], self._session_view,
                               [i for i, _ in job.replies])
        if job.on_done is not None:
            job.on_done(merged)
        if job.client.ident in self.clients:
            self._reply(job.client, merged)

    def _session_view(self, replica: int, info: wire.SessionInfo) -> wire.SessionInfo | None:
        vid = self.inner_to_vid.get((replica, info.session))
        if vid is None:  # another client's (an 8-hex prefix with `all`) or not ours
            return info
        return info if vid == info.session else msgspec.structs.replace(info, session=vid)

    # -- failover: re-homing ------------------------------------------------------------------------

    def _start_rehome(self, record: SessionRecord) -> None:
        if record.owner == DETACHED:
            return  # rebuilt when a client resumes it
        live = self.live()
        client = self.clients.get(record.owner)
        if not live or client is None:
            self._lose(record, "no replica is up to rebuild it on")
            return
        self.inner_to_vid.pop((record.home, record.inner), None)
        target, _ = self.routing.place(record.key, live, None, 0)
        opening, steps = replay_steps(record.log)
        record.rehoming = True
        job = Rehome(record, target, steps)
        log.info("re-homing session %s (%d tokens) on replica %d", record.vid[:8],
                 record.length, target)
        try:
            self._rehome_open(client, job, opening)
        except NoCredential as e:
            self._lose(record, str(e))

    def _rehome_open(self, client: Client, job: Rehome, opening: wire.OpenSession) -> None:
        target, record = job.target, job.record
        if opening.pinned is not None:
            pin = self.pins.get((record.tenant, opening.pinned))
            if pin is not None and target not in pin.holders:
                if target not in pin.placing:
                    self._place_pin(client, pin, target)

                def go(held: bool, error: wire.Error | None) -> None:
                    if record.vid not in self.sessions:
                        return
                    if held:
                        self._rehome_send(client, job, msgspec.structs.replace(opening, rid=""))
                    elif error is None:
                        self._start_rehome(record)  # its target died: another one
                    else:
                        self._lose(record, f"placing its pin failed: {error.message}")

                pin.waiters.setdefault(target, []).append(go)
                return
        self._rehome_send(client, job, msgspec.structs.replace(opening, rid=""))

    def _rehome_send(self, client: Client, job: Rehome, msg: wire.ClientMessage) -> None:
        job.rid = self._internal_rid()
        self.internal[job.rid] = job
        if not isinstance(msg, wire.OpenSession):
            msg = _with_session(msg, job.inner)
        self._send(client, job.target, msgspec.structs.replace(msg, rid=job.rid))

    def _rehome_reply(self, job: Rehome, msg: wire.ServerMessage) -> None:
        if isinstance(msg, wire.Chunk):
            return
        del self.internal[job.rid]
        record = job.record
        client = self.clients.get(record.owner)
        if client is None:
            return
        if isinstance(msg, wire.Error):
            self._lose(record, f"rebuilding it failed: {msg.code}: {msg.message}")
            return
        if isinstance(msg, wire.SessionOpened):
            job.inner = msg.session
            job.recomputed += msg.length - msg.cached_tokens
        elif isinstance(msg, wire.Done):
            job.recomputed += msg.usage.prompt_tokens - msg.usage.cached_tokens
        if job.steps:
            self._rehome_send(client, job, job.steps.pop(0))
            return
        self.homed[record.home] -= 1
        self.homed[job.target] += 1
        record.home, record.inner = job.target, job.inner
        record.recomputed += job.recomputed
        record.rehoming = False
        self.inner_to_vid[(job.target, job.inner)] = record.vid
        self.routing.tree.insert(record.key, job.target)
        self.durable.save(record)
        log.info("session %s re-homed on replica %d: %d tokens recomputed", record.vid[:8],
                 job.target, job.recomputed)
        while record.waiting and not record.rehoming and record.vid in self.sessions:
            self._dispatch(client, record.waiting.popleft())

    def _lose(self, record: SessionRecord, why: str) -> None:
        log.error("session %s lost: %s", record.vid[:8], why)
        client = self.clients.get(record.owner)
        self._forget(record.vid)
        while record.waiting and client is not None:
            msg = decode_frame(record.waiting.popleft())
            if not isinstance(msg, FrameError):
                self._error(client, msg.rid, _UNAVAILABLE, f"session {record.vid!r} {why}")

    def close(self) -> None:
        self.durable.close()
        for client in list(self.clients.values()):
            for sock in client.links.values():
                self._close_link(sock)
        for r in self.replicas:
            r.close_control()


def _session_named(msg: wire.ClientMessage) -> str | None:
    if isinstance(msg, wire.Generate):
        return msg.session
    if isinstance(msg, (wire.ForkSession, wire.TruncateSession)):
        return msg.session
    if isinstance(msg, wire.CloseSession):
        ids = msg.ids()
        return ids[0] if len(ids) == 1 else None
    return None


def _with_session(msg: Any, inner: str) -> Any:
    if isinstance(msg, wire.CloseSession):
        return msgspec.structs.replace(msg, session=inner, sessions=None)
    return msgspec.structs.replace(msg, session=inner)
