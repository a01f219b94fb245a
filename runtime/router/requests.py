"""Clients' requests to the replicas, and the replies back.

- Messages naming a session go to the replica that holds it (`SessionTable`), by its id
  there; forks and the branches of ``n > 1`` turns are born there and stay there. A
  session being re-homed keeps them until it is home (failover.py).
- New sessions, pins and plain requests go where `routing.Routing` says (the longest
  estimated cached prefix, balanced against load; policy.py); a session opened from a pin
  goes to one of its holders (pins.py).
- Stats, session listings, cache flushes and unpins go to every live replica (or every
  holder), closes of sessions homed on several replicas to each home (fanout.py).

Each request a replica works on is remembered (`records.Pending`, by the client's rid)
until its last reply, so it can be sent again if that replica dies before answering.
"""

from __future__ import annotations

import msgspec
from radixlm.runtime import protocol as wire
from radixlm.runtime.router.fanout import FanOut
from radixlm.runtime.router.host import Host
from radixlm.runtime.router.keys import estimate_tokens, input_key
from radixlm.runtime.router.pins import PinPlacement
from radixlm.runtime.router.records import Client, Pending, PinRecord, SessionRecord
from radixlm.runtime.router.sessions import SessionTable, session_named, with_session

__all__ = ["Requests"]


class Requests:
    def __init__(self, host: Host, sessions: SessionTable, pins: PinPlacement,
                 fanout: FanOut) -> None:
        self.host = host
        self.routing = host.routing
        self.sessions = sessions
        self.pins = pins
        self.fanout = fanout

    def route(self, client: Client, msg: wire.ClientMessage, data: bytes,
              live: list[int]) -> None:
        """Send a welcomed client's request (`data`, decoded as `msg`) where it goes."""
        sid = session_named(msg)
        if sid is not None:
            record = self.sessions.records.get(sid)
            if record is None or record.owner != client.ident:
                self.forward(client, live[0], msg.rid, data, Pending("plain", live[0], data))
                return  # the replica answers not_found, in its words
            if record.rehoming:
                record.waiting.append(data)
                return
            self._session_request(client, record, msg, data)
        elif isinstance(msg, wire.Generate):
            key = self.routing.key(client.tenant, msg.namespace, msg.input, msg.tools)
            replica, load = self.routing.place(key, live, msg.input, msg.sampling.max_tokens)
            self.forward(client, replica, msg.rid, data,
                         Pending("generate", replica, data, load, msg, n=msg.n, input_key=key))
        elif isinstance(msg, wire.OpenSession):
            self._open(client, msg, data, live)
        elif isinstance(msg, wire.Pin):
            self._pin(client, msg, data, live)
        elif isinstance(msg, wire.CloseSession):
            self._close(client, msg, live)
        elif isinstance(msg, wire.Abort):
            p = client.pending.get(msg.rid)
            self.host.send(client, p.replica if p is not None else live[0], data)
        elif isinstance(msg, (wire.GetStats, wire.ListSessions, wire.FlushCache)):
            if isinstance(msg, wire.FlushCache):
                self.routing.flush(client.tenant)
            self.fanout.start(client, msg.rid, dict.fromkeys(live, msg),
                              reads=not isinstance(msg, wire.FlushCache))
        elif isinstance(msg, wire.Unpin):
            self._unpin(client, msg, data, live)
        else:  # tokenize, detokenize: any replica
            replica = min(live, key=lambda i: self.routing.loads[i])
            self.forward(client, replica, msg.rid, data, Pending("plain", replica, data))

    def forward(self, client: Client, replica: int, rid: str, sent: bytes, p: Pending) -> None:
        """Send `sent` (the client's frame, or it in the replica's terms) and remember the
        request (`p.frame` is the client's own, to route again on failover)."""
        client.pending[rid] = p
        self.routing.loads[replica] += p.load
        self.host.send(client, replica, sent)

    def _session_request(self, client: Client, record: SessionRecord,
                         msg: wire.ClientMessage, data: bytes) -> None:
        """A turn, fork, truncate or close of one session: to its home, by its inner id."""
        if isinstance(msg, wire.CloseSession):
            self._close(client, msg, self.host.live())
            return
        sent = data if record.inner == record.vid else wire.encode(
            with_session(msg, record.inner))
        if isinstance(msg, wire.Generate):
            key = input_key(msg.input, msg.tools)
            load = estimate_tokens(msg.input, key) + (msg.sampling.max_tokens or 0)
            self.forward(client, record.home, msg.rid, sent, Pending(
                "generate", record.home, data, load, msg, session=record.vid, n=msg.n,
                input_key=key))
        elif isinstance(msg, wire.TruncateSession):
            self.forward(client, record.home, msg.rid, sent, Pending(
                "truncate", record.home, data, session=record.vid, length=msg.length))
        else:
            self.forward(client, record.home, msg.rid, sent,
                         Pending("fork", record.home, data, session=record.vid))

    def _open(self, client: Client, msg: wire.OpenSession, data: bytes, live: list[int]) -> None:
        """A new session: counted as its replica's at once (`homed`), so a burst of
        opens spreads before their replies come back."""
        load = 0
        if msg.pinned is not None:
            pin = self.pins.get(client.tenant, msg.pinned)
            if pin is not None:
                replica = self.pins.home(client, pin, live)
                self.sessions.homed[replica] += 1
                self._open_from_pin(client, pin, replica, msg, data)
                return
            replica = live[0]  # unknown here: the replica says so
        else:
            key = self.routing.key(client.tenant, msg.namespace, msg.input, None)
            replica, load = self.routing.place(key, live, msg.input, 0)
        self.sessions.homed[replica] += 1
        self.forward(client, replica, msg.rid, data, Pending("open", replica, data, load, msg))

    def _open_from_pin(self, client: Client, pin: PinRecord, replica: int,
                       msg: wire.OpenSession, data: bytes) -> None:
        """Open from `pin` on `replica` once it holds it."""
        def go(held: bool, error: wire.Error | None) -> None:
            if client.ident not in self.host.clients:
                return
            if held:
                self.forward(client, replica, msg.rid, data, Pending("open", replica, data,
                                                                     msg=msg))
                return
            self.sessions.homed[replica] -= 1
            if error is not None:
                self.host.reply(client, msgspec.structs.replace(error, rid=msg.rid))
            else:
                self.host.dispatch(client, data)  # routed again

        self.pins.when_held(pin, replica, go)

    def _pin(self, client: Client, msg: wire.Pin, data: bytes, live: list[int]) -> None:
        known = self.pins.get(client.tenant, msg.name)
        if known is not None and known.holders & set(live):  # the holder says duplicate_id
            replica = min(known.holders & set(live))
        else:
            key = self.routing.key(client.tenant, msg.namespace, msg.input, None)
            replica, _ = self.routing.place(key, live, msg.input, 0)
        self.forward(client, replica, msg.rid, data, Pending("pin", replica, data))

    def _unpin(self, client: Client, msg: wire.Unpin, data: bytes, live: list[int]) -> None:
        pin = self.pins.get(client.tenant, msg.name)
        holders = sorted(pin.holders & set(live)) if pin is not None else []
        if not holders:
            self.forward(client, live[0], msg.rid, data, Pending("plain", live[0], data))
            return
        del self.pins.pins[(client.tenant, msg.name)]
        self.fanout.start(client, msg.rid, dict.fromkeys(holders, msg), reads=False)

    def _close(self, client: Client, msg: wire.CloseSession, live: list[int]) -> None:
        records = []
        for vid in msg.ids():
            record = self.sessions.records.get(vid)
            if record is None or record.owner != client.ident:
                data = wire.encode(msg)
                self.forward(client, live[0], msg.rid, data, Pending("plain", live[0], data))
                return  # the replica names the unknown one
            records.append(record)
        by_home: dict[int, list[str]] = {}
        for record in records:
            if record.rehoming:  # nothing of it lives anywhere yet: forget it now
                self.sessions.forget(record.vid)
            else:
                by_home.setdefault(record.home, []).append(record.inner)
        if not by_home:
            self.host.reply(client, wire.Ok(rid=msg.rid))
            return
        vids = [r.vid for r in records]

        def closed(reply: wire.ServerMessage) -> None:
            if not isinstance(reply, wire.Error):
                for vid in vids:
                    self.sessions.forget(vid)

        self.fanout.start(client, msg.rid, {
            home: wire.CloseSession(rid="", sessions=inners) for home, inners in by_home.items()
        }, reads=False, on_done=closed)

    # -- replies ----------------------------------------------------------------------------

    def reply(self, client: Client, replica: int, msg: wire.ServerMessage, data: bytes) -> None:
        """A replica's reply to one of the client's requests, passed on in its terms."""
        rid = getattr(msg, "rid", None)
        p = client.pending.get(rid) if rid is not None else None
        if p is None:
            self.host.reply(client, data)  # an abort's error, an error without a request
            return
        if isinstance(msg, wire.Chunk):
            p.streamed = True
            self.host.reply(client, data)
            return
        if isinstance(msg, wire.Ok) and p.kind == "generate":
            self.host.reply(client, data)  # the reply to an abort of this generation
            return
        finished = True
        if isinstance(msg, wire.Done):
            p.dones += 1
            finished = p.dones >= p.n
            msg = self.sessions.done(client, replica, p, msg)
        elif isinstance(msg, wire.SessionOpened):
            msg = self.sessions.opened(client, replica, p, msg, self._open_key(client, p))
        elif isinstance(msg, wire.SessionsForked):
            msg = self.sessions.forked(client, replica, p, msg)
        elif isinstance(msg, wire.Pinned):
            self.pins.pinned(client, replica, p, msg)
        elif isinstance(msg, wire.Ok) and p.kind == "truncate":
            self.sessions.truncated(p)
        if isinstance(msg, wire.Error) and p.kind == "open":
            self.sessions.homed[replica] -= 1  # no session after all
        if finished:
            del client.pending[rid]  # type: ignore[arg-type]
            self.routing.unload(replica, p.load)
        self.host.reply(client, msg)

    def _open_key(self, client: Client, p: Pending) -> str:
        """The routing key of a session just opened: its pin's, or its input's."""
        msg = p.msg
        assert isinstance(msg, wire.OpenSession)
        if msg.pinned is not None:
            pin = self.pins.get(client.tenant, msg.pinned)
            return pin.key if pin is not None else ""
        return self.routing.key(client.tenant, msg.namespace, msg.input, None)
