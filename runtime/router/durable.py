"""Durable sessions through the router: they outlive their client's connection and, with a
state directory, the router itself.

- A session its replica opened as durable (``session_opened.durable``; its forks and
  branches too) is *detached* when its client goes, not forgotten: the replica keeps it
  too (its link closed). Any client of the same tenant takes it back by id with
  ``resume_session``: the router asks its home replica to resume it over that client's
  link; if the home is down, has lost it (``not_found``: its engine restarted without
  its state) or holds another history, the router rebuilds it from its log on a live
  replica (replay.py), and answers once it is there. Another tenant's id is forwarded
  like any unknown one, and the replica answers ``not_found``.
- With a state directory (``radixlm router --state-dir``, on by default), each durable
  session's record, its log and every pin are rows of ``router.sqlite`` (session_db.py),
  read back at start: a restarted router knows each session's home and how to rebuild
  it, and its clients resume them as after a disconnect.
- A detached session nobody resumes for `DETACHED_EXPIRY_S` is forgotten here (its
  replica closes it after its own ``--durable-session-expiry``).

The router's loop calls it at a few points (server.py); it calls back the router's own
ways of sending, forwarding and re-homing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec
from radixlm.runtime import protocol as wire
from radixlm.runtime.router.records import DETACHED, Pending, PinRecord, SessionRecord
from radixlm.runtime.router.session_db import (
    RouterDB,
    open_router_db,
    replicas_name,
    router_folder,
)

if TYPE_CHECKING:
    from radixlm.runtime.router.server import Client, Router

__all__ = ["DETACHED_EXPIRY_S", "DurableSessions"]

log = logging.getLogger("radixlm.router")

DETACHED_EXPIRY_S = 30 * 86400.0  # as the engine's --durable-session-expiry default


class DurableSessions:
    def __init__(self, router: Router, state_dir: str, name: str = "") -> None:
        """`state_dir`: the state directory ("": none), whose ``router/<name>`` folder is
        this router's (`name` "": the hash of its replicas' endpoints)."""
        self.router = router
        endpoints = [replica.spec.endpoint for replica in router.replicas]
        folder = state_dir and router_folder(state_dir, name or replicas_name(endpoints))
        self.db: RouterDB | None = open_router_db(folder) if folder else None
        if self.db is not None:
            self._restore(self.db)

    def _restore(self, db: RouterDB) -> None:
        r = self.router
        loaded = db.load([replica.spec.endpoint for replica in r.replicas])
        now = time.time()
        for record in loaded.sessions:
            if now - record.detached_at > DETACHED_EXPIRY_S:
                db.delete(record.vid)
                continue
            r.sessions[record.vid] = record
            r.inner_to_vid[(record.home, record.inner)] = record.vid
            r.homed[record.home] += 1
            if record.key:
                r.routing.tree.insert(record.key, record.home)
        for pin in loaded.pins:
            r.pins[(pin.tenant, pin.name)] = pin
        log.info("router state: %d durable session(s) and %d pin(s) read back from %s",
                 len(r.sessions), len(loaded.pins), db.folder.path)

    # -- rows -----------------------------------------------------------------------------

    def save(self, record: SessionRecord | None) -> None:
        if self.db is not None and record is not None and record.durable:
            self.db.save(record, self.router.replicas[record.home].spec.endpoint)

    def forgotten(self, record: SessionRecord) -> None:
        if self.db is not None and record.durable:
            self.db.delete(record.vid)

    def pinned(self, pin: PinRecord) -> None:
        if self.db is not None:
            self.db.save_pin(pin)

    def unpinned(self, tenant: str | None, name: str) -> None:
        if self.db is not None:
            self.db.delete_pin(tenant, name)

    def after_reply(self, p: Pending, msg: wire.ServerMessage) -> None:
        """A reply that made or changed sessions (already in the client's terms)."""
        sessions = self.router.sessions
        parent = sessions.get(p.session) if p.session else None
        if isinstance(msg, wire.SessionOpened) and p.kind == "open":
            opened = sessions.get(msg.session)
            if opened is not None:
                opened.durable = msg.durable
                self.save(opened)
            return
        if parent is None or not parent.durable or isinstance(msg, wire.Error):
            return
        born: list[str] = []
        if isinstance(msg, wire.SessionsForked):
            born = msg.sessions
        elif isinstance(msg, wire.Done) and msg.session not in (None, parent.vid):
            born = [msg.session]  # a branch of an n > 1 turn
        for vid in born:
            child = sessions.get(vid)
            if child is not None:
                child.durable = True
                self.save(child)
        self.save(parent)

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    # -- clients ----------------------------------------------------------------------------

    def client_gone(self, ident: bytes) -> None:
        """Its links closed: its durable sessions are detached (their replicas keep them),
        the others forgotten (their replicas closed them)."""
        r = self.router
        now = time.time()
        for vid, record in list(r.sessions.items()):
            if record.owner == ident and record.durable:
                record.owner, record.detached_at = DETACHED, now
                if record.rehoming:  # its rebuilding stops; it starts again on a resume
                    record.rehoming = False
                    record.waiting.clear()
                    for rid, job in list(r.internal.items()):
                        if getattr(job, "record", None) is record:
                            del r.internal[rid]
            elif record.owner == ident or (record.owner == DETACHED
                                           and now - record.detached_at > DETACHED_EXPIRY_S):
                r._forget(vid)  # (gone with its link, or nobody resumed it in time)

    def resume(self, client: Client, msg: wire.ResumeSession, data: bytes,
               live: list[int]) -> None:
        """Take a durable session back for `client` (module doc)."""
        r = self.router
        record = r.sessions.get(msg.session)
        if record is None or not record.durable or record.tenant != client.tenant:
            r._forward(client, live[0], msg.rid, data, Pending("plain", live[0], data))
            return  # the replica answers not_found (or resumes one the router never saw)
        if record.rehoming:
            record.waiting.append(data)  # answered once it is home
            return
        if record.owner == client.ident:  # (after it was rebuilt for this resume)
            r._reply(client, wire.SessionOpened(rid=msg.rid, session=record.vid,
                                                length=record.length, durable=True))
            return
        if record.home not in live:
            self._rebuild(client, record, data)
            return
        sent = wire.encode(wire.ResumeSession(rid=msg.rid, session=record.inner))
        r._forward(client, record.home, msg.rid, sent,
                   Pending("resume", record.home, data, session=record.vid))

    def resumed(self, client: Client, replica: int, p: Pending,
                msg: wire.ServerMessage) -> wire.ServerMessage | None:
        """The home replica's answer to a resume: the reply for the client, or None when
        it is being rebuilt (the client is answered once it is)."""
        r = self.router
        record = r.sessions.get(p.session or "")
        if record is None:
            return msg
        if isinstance(msg, wire.SessionOpened):
            if msg.length == record.length:
                record.owner = client.ident
                return msgspec.structs.replace(msg, session=record.vid)
            log.warning("session %s: replica %d holds %d tokens of it, its log %d: rebuilt "
                        "from the log", record.vid[:8], replica, msg.length, record.length)
            r._send(client, replica, wire.CloseSession(rid=r._internal_rid(),
                                                       session=record.inner))
        elif not (isinstance(msg, wire.Error) and msg.code == wire.ErrorCode.NOT_FOUND):
            return msg  # busy, ...: the client may try again
        self._rebuild(client, record, p.frame)
        return None

    def _rebuild(self, client: Client, record: SessionRecord, resume_frame: bytes) -> None:
        """Re-home `record` for `client` from its log; its resume is answered after."""
        record.owner = client.ident
        record.waiting.append(resume_frame)
        self.router._start_rehome(record)
