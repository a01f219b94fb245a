"""The router's durable sessions and pins on disk: ``<folder>/router.sqlite``.

The folder is the router's own in a state directory (``<state dir>/router/<name>``: the
CLI names it, cli.py), made 0700 and locked like a server's state directory, so two
routers never share one. Each durable session is a row (its tenant, home replica, id
there, length and routing key) and its log one row per entry, appended as the session
grows (a log never shrinks: a cut is an entry too); each pin a row. Written by
`StateDB`'s thread, never the router's loop; nothing waits for it: the replicas have
acknowledged what the rows record, and a row lost in a crash of the router costs that
session's re-homing from the router (its replica still holds it), never wrong tokens.
Read once, at start.
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from radixlm.runtime.protocol import Input
from radixlm.runtime.router.records import (
    DETACHED,
    LogEntry,
    PinRecord,
    SessionRecord,
    decode_entry,
    encode_entry,
)
from radixlm.runtime.state.db import StateDB
from radixlm.runtime.state.location import (
    StateDir,
    StateDirError,
    make_private_dir,
    open_state_dir,
)

__all__ = ["KEY_CHARS", "ROUTER_DB", "Loaded", "RouterDB", "open_router_db", "router_folder",
           "replicas_name"]

log = logging.getLogger("radixlm.router")

ROUTER_DB = "router.sqlite"
ROUTERS = "router"  # the routers' folders in a state directory
KEY_CHARS = 8192  # of a session's routing key kept (an estimate's prefix is enough)

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    vid TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    home INTEGER NOT NULL,
    endpoint TEXT NOT NULL,
    inner TEXT NOT NULL,
    length INTEGER NOT NULL,
    key TEXT NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS log (
    vid TEXT NOT NULL,
    seq INTEGER NOT NULL,
    entry BLOB NOT NULL,
    PRIMARY KEY (vid, seq)
);
CREATE TABLE IF NOT EXISTS pins (
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    input BLOB NOT NULL,
    namespace TEXT,
    key TEXT NOT NULL,
    length INTEGER NOT NULL,
    PRIMARY KEY (tenant, name)
);
"""


@dataclass
class Loaded:
    sessions: list[SessionRecord]
    pins: list[PinRecord]


def _tenant(tenant: str | None) -> str:
    return "" if tenant is None else tenant


class RouterDB:
    """The router's rows; `open_router_db` makes one."""

    def __init__(self, folder: StateDir, db: StateDB) -> None:
        self.folder = folder
        self.db = db

    def save(self, record: SessionRecord, endpoint: str) -> None:
        """Write `record`'s row and the log entries not written yet."""
        row = (record.vid, _tenant(record.tenant), record.home, endpoint, record.inner,
               record.length, record.key[:KEY_CHARS], time.time())
        first = record.saved
        entries = [(record.vid, first + i, encode_entry(e))
                   for i, e in enumerate(record.log[first:])]
        record.saved = len(record.log)

        def job(c: sqlite3.Connection) -> None:
            c.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
            c.executemany("INSERT OR REPLACE INTO log VALUES (?, ?, ?)", entries)

        self.db.write(job)

    def delete(self, vid: str) -> None:
        def job(c: sqlite3.Connection) -> None:
            c.execute("DELETE FROM log WHERE vid = ?", (vid,))
            c.execute("DELETE FROM sessions WHERE vid = ?", (vid,))

        self.db.write(job)

    def save_pin(self, pin: PinRecord) -> None:
        self.db.execute("INSERT OR REPLACE INTO pins VALUES (?, ?, ?, ?, ?, ?)",
                        (_tenant(pin.tenant), pin.name, msgspec.msgpack.encode(pin.msg_input),
                         pin.namespace, pin.key, pin.length))

    def delete_pin(self, tenant: str | None, name: str) -> None:
        self.db.execute("DELETE FROM pins WHERE tenant = ? AND name = ?", (_tenant(tenant), name))

    def load(self, endpoints: list[str]) -> Loaded:
        """Every durable session (detached) and pin; sessions' replicas by endpoint (by index
        when the endpoint is not among `endpoints`: ``serve --replicas`` starts its
        replicas on new private sockets, in the same order); a row whose replica is
        neither, or that cannot be read, is said and left out."""
        logs: dict[str, list[LogEntry]] = {}
        bad: set[str] = set()
        for vid, _, entry in self.db.read("SELECT vid, seq, entry FROM log ORDER BY vid, seq"):
            try:
                logs.setdefault(vid, []).append(decode_entry(entry))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                bad.add(vid)
        sessions = []
        for vid, tenant, home, endpoint, inner, length, key, updated in self.db.read(
                "SELECT * FROM sessions"):
            at = _replica(endpoints, endpoint, home)
            entries = logs.get(vid, [])
            if vid in bad or at is None or not entries:
                log.error("router state: session %s cannot be restored (%s); left out",
                          vid[:8], "its replica is gone" if at is None else "its log is damaged")
                continue
            sessions.append(SessionRecord(
                vid, DETACHED, tenant or None, at, inner, length, key, entries, durable=True,
                saved=len(entries), detached_at=updated))
        pins = []
        for tenant, name, inp, namespace, key, length in self.db.read("SELECT * FROM pins"):
            try:
                msg_input = msgspec.msgpack.decode(inp, type=Input)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            # Held nowhere as far as the router knows: placed again before its first use
            # (a replica that kept it says so, and counts as holding it).
            pins.append(PinRecord(name, tenant or None, msg_input, namespace, key, length))
        return Loaded(sessions, pins)

    def close(self) -> None:
        self.db.close()
        self.folder.close()


def _replica(endpoints: list[str], endpoint: str, index: int) -> int | None:
    if endpoint in endpoints:
        return endpoints.index(endpoint)
    return index if 0 <= index < len(endpoints) else None


def open_router_db(folder: str, *, max_bytes: int = 0) -> RouterDB | None:
    """The router's database in `folder` (made 0700 and locked); None, said in one line,
    when it cannot be used (the router then keeps its sessions in memory only)."""
    try:
        held = open_state_dir(Path(folder))
    except StateDirError as e:
        log.error("%s: the router keeps its sessions in memory only (a restart of the "
                  "router loses them)", e)
        return None
    try:
        db = StateDB(held.path / ROUTER_DB, SCHEMA, name="session logs", log=log,
                     max_bytes=max_bytes)
    except StateDirError as e:
        held.close()
        log.error("%s: the router keeps its sessions in memory only (a restart of the "
                  "router loses them)", e)
        return None
    return RouterDB(held, db)


def replicas_name(endpoints: list[str]) -> str:
    """A router's folder name for its replicas: the same set, the same folder."""
    return hashlib.sha256("\n".join(sorted(endpoints)).encode()).hexdigest()[:16]


def router_folder(state_dir: str, name: str) -> str:
    """``<state_dir>/router/<name>`` (its parents made 0700); "" (said in one line) when
    the state directory cannot be used."""
    try:
        root = make_private_dir(Path(state_dir).expanduser().absolute())
        return str(make_private_dir(root / ROUTERS) / name)
    except StateDirError as e:
        log.error("%s: the router keeps its sessions in memory only (a restart of the "
                  "router loses them)", e)
        return ""
