"""Durable sessions and pins on disk: the engine's rows in the state directory's SQLite.

A durable session (``OpenSession.durable``) and every pin are written to
``<state dir>/models/<fingerprint>/engine.sqlite`` (`StateDB`: one writer thread, never the
scheduler's): a session's row when it is opened, again whenever its history changes (a
turn, a truncate) and removed when it is closed; a pin's when it is made, removed when it
is unpinned. Histories are stored whole (int32 little-endian): a row is the session's
state, so a crash between two writes loses at most the turns not yet written, never
leaves a history that was not one. On start the engine reads them back (`load`).

What the rows do not hold is KV: that is the disk tier's (cache/disk_kv.py). A session
read back here is demoted; its next turn reuses what is cached, on disk or in host
memory, and recomputes the rest.
"""

from __future__ import annotations

import json
import sqlite3
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from radixlm.runtime.state.db import StateDB

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    tenant TEXT,
    namespace TEXT,
    retention TEXT NOT NULL,
    ttl_s REAL,
    history BLOB NOT NULL,
    assistant_open INTEGER NOT NULL,
    lineage TEXT NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS pins (
    name TEXT PRIMARY KEY,
    namespace TEXT,
    ids BLOB NOT NULL
);
"""


@dataclass(frozen=True)
class SessionRow:
    id: str
    tenant: str | None  # the frontend's tenant tag: who may resume it
    namespace: str | None
    retention: str
    ttl_s: float | None
    history: np.ndarray  # int64
    assistant_open: bool
    lineage: tuple[int, ...]
    updated: float = 0.0  # time.time() of its last write (as read back)


@dataclass(frozen=True)
class PinRow:
    name: str
    namespace: str | None
    ids: np.ndarray  # int64


def _blob(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype="<i4").tobytes()


def _ids(blob: bytes) -> np.ndarray:
    arr = np.frombuffer(blob, dtype="<i4").astype(np.int64)
    arr.flags.writeable = False
    return arr


class DurableLog:
    """The engine's durable rows; every write returns a future resolved once committed."""

    def __init__(self, path: Path, *, max_bytes: int = 0) -> None:
        self.db = StateDB(path, SCHEMA, name="durable sessions and pins", max_bytes=max_bytes)

    @property
    def failing(self) -> str | None:
        return self.db.failing

    def save_session(self, row: SessionRow, updated: float) -> Future[None]:
        args = (row.id, row.tenant, row.namespace, row.retention, row.ttl_s,
                _blob(row.history), int(row.assistant_open), json.dumps(list(row.lineage)),
                updated)

        def job(c: sqlite3.Connection) -> None:
            c.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", args)

        return self.db.write(job)

    def delete_session(self, session_id: str) -> Future[None]:
        return self.db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def save_pin(self, row: PinRow) -> Future[None]:
        return self.db.execute("INSERT OR REPLACE INTO pins VALUES (?, ?, ?)",
                               (row.name, row.namespace, _blob(row.ids)))

    def delete_pin(self, name: str) -> Future[None]:
        return self.db.execute("DELETE FROM pins WHERE name = ?", (name,))

    def load(self) -> tuple[list[SessionRow], list[PinRow]]:
        """Every durable session (oldest update first) and pin."""
        sessions = [
            SessionRow(sid, tenant, ns, retention, ttl, _ids(hist), bool(open_),
                       tuple(json.loads(lin)), updated)
            for sid, tenant, ns, retention, ttl, hist, open_, lin, updated in self.db.read(
                "SELECT * FROM sessions ORDER BY updated")
        ]
        pins = [PinRow(name, ns, _ids(ids)) for name, ns, ids in self.db.read(
            "SELECT * FROM pins ORDER BY rowid")]
        return sessions, pins

    def close(self) -> None:
        self.db.close()
