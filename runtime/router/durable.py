"""Durable sessions through the router: they outlive their client's connection and, with a
state directory, the router itself.

- A session its replica opened as durable (``session_opened.durable``; its forks and
  branches too: sessions.py marks them) is *detached* when its client goes, not
  forgotten: the replica keeps it too (its link closed). Any client of the same tenant
  takes it back by id with ``resume_session``: the router asks its home replica to resume
  it over that client's link; if the home is down, has lost it (``not_found``: its engine
  restarted without its state) or holds another history, the router rebuilds it from its
  log on a live replica (failover.py, replay.py) and answers once it is there. Another
  tenant's id is forwarded like any unknown one, and the replica answers ``not_found``.
- With a state directory (``radixlm router --state-dir``, on by default), each durable
  session's record, its log and every pin are rows of ``router.sqlite`` (session_db.py;
  this is the session table's and the pins' `journal`), read back at start: a restarted
  router knows each session's home and how to rebuild it, and its clients resume them as
  after a disconnect.
- A detached session nobody resumes for `DETACHED_EXPIRY_S` is forgotten here (its
  replica closes it after its own ``--durable-session-expiry``).
"""

from __future__ import annotations

import logging
import time

import msgspec
from radixlm.runtime import protocol as wire
from radixlm.runtime.router.failover import Failover, Rehome
from radixlm.runtime.router.host import Host
from radixlm.runtime.router.pins import PinPlacement
from radixlm.runtime.router.records import DETACHED, Client, Pending, PinRecord, SessionRecord
from radixlm.runtime.router.requests import Requests
from radixlm.runtime.router.session_db import (
    RouterDB,
    open_router_db,
    replicas_name,
    router_folder,
)
from radixlm.runtime.router.sessions import SessionTable

__all__ = ["DETACHED_EXPIRY_S", "DurableSessions"]

log = logging.getLogger("radixlm.router")

DETACHED_EXPIRY_S = 30 * 86400.0  # as the engine's --durable-session-expiry default


class DurableSessions:
    def __init__(self, host: Host, sessions: SessionTable, pins: PinPlacement,
                 failover: Failover, requests: Requests) -> None:
        """The router's state directory is ``config.state_dir`` ("": none); its folder
        there ``router/<config.state_name>`` (""): the hash of its replicas' endpoints)."""
        self.host = host
        self.sessions = sessions
        self.pins = pins
        self.failover = failover
        self.requests = requests
        config = host.config
        self._endpoints = [spec.endpoint for spec in config.replicas]
        folder = config.state_dir and router_folder(
            config.state_dir, config.state_name or replicas_name(self._endpoints))
        self.db: RouterDB | None = open_router_db(folder) if folder else None
        if self.db is not None:
            self._restore(self.db)
            sessions.journal = pins.journal = self

    def _restore(self, db: RouterDB) -> None:
        loaded = db.load(self._endpoints)
        now, table = time.time(), self.sessions
        for record in loaded.sessions:
            if now - record.detached_at > DETACHED_EXPIRY_S:
                db.delete(record.vid)
                continue
            table.records[record.vid] = record
            table.by_inner[(record.home, record.inner)] = record.vid
            table.homed[record.home] += 1
            if record.key:
                self.host.routing.tree.insert(record.key, record.home)
        for pin in loaded.pins:
            self.pins.pins[(pin.tenant, pin.name)] = pin
        log.info("router state: %d durable session(s) and %d pin(s) read back from %s",
                 len(table.records), len(loaded.pins), db.folder.path)

    # -- the journal (sessions.py, pins.py) -----------------------------------------------

    def save(self, record: SessionRecord) -> None:
        if self.db is not None:
            self.db.save(record, self._endpoints[record.home])

    def delete(self, record: SessionRecord) -> None:
        if self.db is not None and record.durable:
            self.db.delete(record.vid)

    def save_pin(self, pin: PinRecord) -> None:
        if self.db is not None:
            self.db.save_pin(pin)

    def delete_pin(self, tenant: str | None, name: str) -> None:
        if self.db is not None:
            self.db.delete_pin(tenant, name)

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    # -- clients ----------------------------------------------------------------------------

    def client_gone(self, ident: bytes) -> None:
        """Its links closed: its durable sessions are detached (their replicas keep them),
        the others forgotten (their replicas closed them)."""
        now, jobs = time.time(), self.host.jobs
        for vid, record in list(self.sessions.records.items()):
            if record.owner == ident and record.durable:
                record.owner, record.detached_at = DETACHED, now
                if record.rehoming:  # its rebuilding stops; it starts again on a resume
                    record.rehoming = False
                    record.waiting.clear()
                    for rid, job in list(jobs.items()):
                        if isinstance(job, Rehome) and job.record is record:
                            del jobs[rid]
            elif record.owner == ident or (record.owner == DETACHED
                                           and now - record.detached_at > DETACHED_EXPIRY_S):
                self.sessions.forget(vid)  # (gone with its link, or nobody resumed it in time)

    def resume(self, client: Client, msg: wire.ResumeSession, data: bytes,
               live: list[int]) -> None:
        """Take a durable session back for `client` (module doc)."""
        record = self.sessions.records.get(msg.session)
        if record is None or not record.durable or record.tenant != client.tenant:
            self.requests.forward(client, live[0], msg.rid, data,
                                  Pending("plain", live[0], data))
            return  # the replica answers not_found (or resumes one the router never saw)
        if record.rehoming:
            record.waiting.append(data)  # answered once it is home
            return
        if record.owner == client.ident:  # (after it was rebuilt for this resume)
            self.host.reply(client, wire.SessionOpened(rid=msg.rid, session=record.vid,
                                                       length=record.length, durable=True))
            return
        if record.home not in live:
            self._rebuild(client, record, data)
            return
        sent = wire.encode(wire.ResumeSession(rid=msg.rid, session=record.inner))
        self.requests.forward(client, record.home, msg.rid, sent,
                              Pending("resume", record.home, data, session=record.vid))

    def reply(self, client: Client, replica: int, msg: wire.ServerMessage) -> bool:
        """The home replica's answer to a resume (False: not one): passed on, or, when it
        is being rebuilt, given once it is home."""
        rid = getattr(msg, "rid", None)
        p = client.pending.get(rid) if rid is not None else None
        if p is None or p.kind != "resume":
            return False
        del client.pending[rid]  # type: ignore[arg-type]
        record = self.sessions.records.get(p.session or "")
        if record is None:
            self.host.reply(client, msg)
            return True
        if isinstance(msg, wire.SessionOpened):
            if msg.length == record.length:
                record.owner = client.ident
                self.host.reply(client, msgspec.structs.replace(msg, session=record.vid))
                return True
            log.warning("session %s: replica %d holds %d tokens of it, its log %d: rebuilt "
                        "from the log", record.vid[:8], replica, msg.length, record.length)
            self.host.send(client, replica, wire.CloseSession(rid=self.host.internal_rid(),
                                                              session=record.inner))
        elif not (isinstance(msg, wire.Error) and msg.code == wire.ErrorCode.NOT_FOUND):
            self.host.reply(client, msg)  # busy, ...: the client may try again
            return True
        self._rebuild(client, record, p.frame)
        return True

    def _rebuild(self, client: Client, record: SessionRecord, resume_frame: bytes) -> None:
        """Re-home `record` for `client` from its log; its resume is answered after."""
        record.owner = client.ident
        record.waiting.append(resume_frame)
        self.failover.start_rehome(record)
