"""The HTTP API's stored objects on disk: ``<state dir>/models/<fingerprint>/http.sqlite``.

Stored responses and chat sessions (`stored`), the held engine sessions they and the
conversations share (`held`, history.py), and conversations (`conversations`) with their
items in order (`items`), every row keyed by its tenant (the API key's tenant name): a
lookup always names the tenant, so another tenant's id is exactly an unknown one.

Written through `StateDB` (one writer thread, group commit): what a reply acknowledges is
committed before the reply is sent (`HttpState.committed`, awaited by the routes). Read
through a connection of its own (WAL: readers never wait for the writer), only on a miss
of the store's memory: after a restart nothing is loaded at start, each object is read
back by its id when it is next asked for. The folder is the engine's model folder
(`Welcome.state`, its fingerprint), so rows made for another model are never read.

``$RADIXLM_HTTP_STATE_MAX_BYTES`` caps the file: a fault-injection hook for tests (past it
every write fails as on a full disk), not a setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
from radixlm.runtime.protocol import Message
from radixlm.runtime.state.db import StateDB, StateWriteError
from radixlm.runtime.state.location import MODELS, StateDirError, make_private_dir

log = logging.getLogger("radixlm.http")

HTTP_DB = "http.sqlite"
MAX_BYTES_ENV = "RADIXLM_HTTP_STATE_MAX_BYTES"  # fault injection (tests): a full disk past it
_IN_CHUNK = 500  # keys per ``IN (...)`` lookup

SCHEMA = """
CREATE TABLE IF NOT EXISTS held (
    tenant TEXT NOT NULL,
    session TEXT NOT NULL,
    length INTEGER NOT NULL,
    key BLOB NOT NULL,
    chain BLOB NOT NULL,
    lost INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, session)
);
CREATE INDEX IF NOT EXISTS held_by_key ON held (tenant, key);
CREATE INDEX IF NOT EXISTS held_by_chain ON held (tenant, chain);
CREATE TABLE IF NOT EXISTS stored (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    session TEXT NOT NULL,
    shared INTEGER NOT NULL,
    length INTEGER NOT NULL,
    body BLOB,
    history BLOB NOT NULL,
    input_items BLOB NOT NULL,
    created REAL NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS stored_by_session ON stored (tenant, session);
CREATE INDEX IF NOT EXISTS stored_by_expiry ON stored (tenant, expires_at);
CREATE TABLE IF NOT EXISTS conversations (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    metadata BLOB NOT NULL,
    held TEXT,
    expires_at REAL NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS conversations_by_held ON conversations (tenant, held);
CREATE INDEX IF NOT EXISTS conversations_by_expiry ON conversations (tenant, expires_at);
CREATE TABLE IF NOT EXISTS items (
    tenant TEXT NOT NULL,
    conversation TEXT NOT NULL,
    seq INTEGER NOT NULL,
    id TEXT NOT NULL,
    item BLOB NOT NULL,
    PRIMARY KEY (tenant, conversation, seq)
);
"""

_json = msgspec.json.Encoder()
_messages = msgspec.json.Decoder(list[Message])
_any = msgspec.json.Decoder()


class HeldRow(NamedTuple):
    session: str
    length: int
    key: bytes
    chain: bytes
    lost: bool


class StoredRow(NamedTuple):
    id: str
    session: str
    shared: bool  # `session` is a held one (a response's), not its own (a chat session's)
    length: int
    body: dict[str, Any] | None
    history: list[Message]
    input_items: list[dict[str, Any]]
    created: float
    expires_at: float


class ConversationRow(NamedTuple):
    id: str
    created_at: int
    metadata: dict[str, str]
    held: str | None
    expires_at: float
    items: list[dict[str, Any]]
    next_seq: int


def open_http_state(state_dir: str | None, fingerprint: str) -> HttpState | None:
    """The stored objects' database for the model `fingerprint` (the engine's
    `Welcome.state`) in `state_dir`; None without either, or (said once) when it cannot
    be used: the objects are then kept in memory only."""
    if not state_dir or not fingerprint:
        return None
    try:
        folder = make_private_dir(Path(state_dir) / MODELS / fingerprint)
        db = StateDB(folder / HTTP_DB, SCHEMA, name="stored responses and conversations",
                     log=log, max_bytes=int(os.environ.get(MAX_BYTES_ENV) or 0))
        reader = sqlite3.connect(f"file:{folder / HTTP_DB}?mode=ro", uri=True,
                                 isolation_level=None, check_same_thread=False)
    except (StateDirError, sqlite3.Error, OSError, ValueError) as e:
        log.error("state: %s; stored responses and conversations are kept in memory only "
                  "(they end with this process)", e)
        return None
    log.info("state: stored responses and conversations in %s", folder / HTTP_DB)
    return HttpState(db, reader)


class HttpState:
    """The database, its last queued write (what `committed` waits for) and the ids
    whose deletion is queued but not yet committed (a read must not bring them back)."""

    def __init__(self, db: StateDB, reader: sqlite3.Connection) -> None:
        self.db = db
        self._reader = reader
        self._last: Future[Any] | None = None
        self._going: set[tuple[str, str]] = set()  # (tenant, id or session) being deleted

    def rows(self, tenant: str) -> TenantRows:
        return TenantRows(self, tenant)

    def write(self, job: Callable[[sqlite3.Connection], Any],
              gone: Sequence[tuple[str, str]] = ()) -> None:
        """Queue `job`; `gone`: what it deletes (unreadable from now on)."""
        self._going.update(gone)
        fut = self.db.write(job)
        if gone:
            fut.add_done_callback(lambda _: self._going.difference_update(gone))
        self._last = fut

    def going(self, tenant: str, name: str) -> bool:
        return (tenant, name) in self._going

    def read(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        try:
            return self._reader.execute(sql, params).fetchall()
        except sqlite3.Error as e:  # a damaged file: what it held is unknown, not an error
            log.error("state: reading %s failed: %s", self.db.path, e)
            return []

    async def committed(self) -> None:
        """Wait until every write queued so far is committed (the writer commits in
        order); a failed write was said once in the log, and the server goes on."""
        fut = self._last
        if fut is None:
            return
        with contextlib.suppress(StateWriteError):
            await asyncio.wrap_future(fut)

    def close(self) -> None:
        self.db.close()
        self._reader.close()


class TenantRows:
    """One tenant's rows: every query names the tenant."""

    def __init__(self, state: HttpState, tenant: str) -> None:
        self.state = state
        self.tenant = tenant
        # Rows written before this process started (read back on a miss); False: every
        # row there is, this process wrote, and its memory holds.
        self.cold = any(state.read(f"SELECT 1 FROM {table} WHERE tenant = ? LIMIT 1",
                                   (tenant,)) for table in ("stored", "conversations"))

    async def committed(self) -> None:
        await self.state.committed()

    def _write(self, sql: str, params: tuple[Any, ...], gone: Sequence[str] = ()) -> None:
        self.state.write(lambda c: c.execute(sql, params),
                         [(self.tenant, name) for name in gone])

    def _going(self, name: str) -> bool:
        return self.state.going(self.tenant, name)

    # -- held sessions ------------------------------------------------------------------------

    def save_held(self, session: str, length: int, key: bytes, chain: bytes) -> None:
        self._write("INSERT OR REPLACE INTO held VALUES (?, ?, ?, ?, ?, 0)",
                    (self.tenant, session, length, key, chain))

    def lose_held(self, session: str) -> None:
        self._write("UPDATE held SET lost = 1 WHERE tenant = ? AND session = ?",
                    (self.tenant, session))

    def delete_held(self, session: str) -> None:
        self._write("DELETE FROM held WHERE tenant = ? AND session = ?", (self.tenant, session),
                    gone=[session])

    def held_by_keys(self, keys: Sequence[bytes]) -> list[HeldRow]:
        found: list[HeldRow] = []
        for at in range(0, len(keys), _IN_CHUNK):
            chunk = tuple(keys[at:at + _IN_CHUNK])
            marks = ",".join("?" * len(chunk))
            found += self._held(f"key IN ({marks}) AND lost = 0", chunk)
        return found

    def held_by_chain(self, chain: bytes) -> HeldRow | None:
        rows = self._held("chain = ? AND lost = 0", (chain,))
        return rows[0] if rows else None

    def held_by_session(self, session: str) -> HeldRow | None:
        rows = self._held("session = ?", (session,))
        return rows[0] if rows else None

    def _held(self, where: str, params: tuple[Any, ...]) -> list[HeldRow]:
        rows = self.state.read(f"SELECT session, length, key, chain, lost FROM held "
                               f"WHERE tenant = ? AND {where}", (self.tenant, *params))
        return [HeldRow(s, n, bytes(k), bytes(c), bool(lost)) for s, n, k, c, lost in rows
                if not self._going(s)]

    def held_refs(self, session: str) -> int:
        """The stored objects that hold `session` (responses and conversations)."""
        (n,), = self.state.read(
            "SELECT (SELECT COUNT(*) FROM stored WHERE tenant = ?1 AND session = ?2 AND shared) "
            "+ (SELECT COUNT(*) FROM conversations WHERE tenant = ?1 AND held = ?2)",
            (self.tenant, session))
        return int(n)

    # -- responses and chat sessions ------------------------------------------------------------

    def save_stored(self, id: str, session: str, shared: bool, length: int,
                    body: dict[str, Any] | None, history: list[Message],
                    input_items: list[dict[str, Any]], created: float, expires_at: float) -> None:
        self._write("INSERT OR REPLACE INTO stored VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (self.tenant, id, session, int(shared), length,
                     None if body is None else _json.encode(body), _json.encode(history),
                     _json.encode(input_items), created, expires_at))

    def advance_stored(self, id: str, session: str, length: int, history: list[Message],
                       expires_at: float) -> None:
        """A chat session's turn: its session (another one after a recompute), length and
        history."""
        self._write("UPDATE stored SET session = ?, length = ?, history = ?, expires_at = ? "
                    "WHERE tenant = ? AND id = ?",
                    (session, length, _json.encode(history), expires_at, self.tenant, id))

    def touch_stored(self, id: str, expires_at: float) -> None:
        self._write("UPDATE stored SET expires_at = ? WHERE tenant = ? AND id = ?",
                    (expires_at, self.tenant, id))

    def delete_stored(self, id: str) -> None:
        self._write("DELETE FROM stored WHERE tenant = ? AND id = ?", (self.tenant, id),
                    gone=[id])

    def stored(self, id: str) -> StoredRow | None:
        if not self.cold or self._going(id):
            return None
        rows = self.state.read(
            "SELECT id, session, shared, length, body, history, input_items, created, "
            "expires_at FROM stored WHERE tenant = ? AND id = ?", (self.tenant, id))
        if not rows:
            return None
        rid, session, shared, length, body, history, items, created, expires = rows[0]
        try:
            return StoredRow(rid, session, bool(shared), length,
                             None if body is None else _any.decode(body),
                             _messages.decode(history), _any.decode(items), created, expires)
        except msgspec.DecodeError as e:
            log.error("state: stored object %s cannot be read (%s): treated as unknown", id, e)
            return None

    # -- conversations --------------------------------------------------------------------------

    def save_conversation(self, id: str, created_at: int, metadata: dict[str, str],
                          held: str | None, expires_at: float,
                          items: list[dict[str, Any]]) -> None:
        conv = (self.tenant, id, created_at, _json.encode(metadata), held, expires_at)
        rows = [(self.tenant, id, seq, item["id"], _json.encode(item))
                for seq, item in enumerate(items)]

        def job(c: sqlite3.Connection) -> None:
            c.execute("INSERT OR REPLACE INTO conversations VALUES (?, ?, ?, ?, ?, ?)", conv)
            c.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?)", rows)

        self.state.write(job)

    def update_conversation(self, id: str, *, metadata: dict[str, str] | None = None,
                            held: str | None = None, expires_at: float | None = None) -> None:
        """Set the fields given (`held` ""): none held)."""
        sets: list[str] = []
        params: list[Any] = []
        for column, value in (("metadata", None if metadata is None else _json.encode(metadata)),
                              ("held", held), ("expires_at", expires_at)):
            if value is not None:
                sets.append(f"{column} = ?")
                params.append(value or None)
        if sets:
            self._write(f"UPDATE conversations SET {', '.join(sets)} WHERE tenant = ? AND id = ?",
                        (*params, self.tenant, id))

    def add_items(self, conversation: str, first_seq: int, items: list[dict[str, Any]]) -> None:
        rows = [(self.tenant, conversation, first_seq + i, item["id"], _json.encode(item))
                for i, item in enumerate(items)]
        self.state.write(lambda c: c.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?)", rows))

    def delete_item(self, conversation: str, item_id: str) -> None:
        self._write("DELETE FROM items WHERE tenant = ? AND conversation = ? AND id = ?",
                    (self.tenant, conversation, item_id))

    def delete_conversation(self, id: str) -> None:
        key = (self.tenant, id)

        def job(c: sqlite3.Connection) -> None:
            c.execute("DELETE FROM items WHERE tenant = ? AND conversation = ?", key)
            c.execute("DELETE FROM conversations WHERE tenant = ? AND id = ?", key)

        self.state.write(job, [key])

    def conversation(self, id: str) -> ConversationRow | None:
        if not self.cold or self._going(id):
            return None
        rows = self.state.read("SELECT created_at, metadata, held, expires_at FROM "
                               "conversations WHERE tenant = ? AND id = ?", (self.tenant, id))
        if not rows:
            return None
        created_at, metadata, held, expires = rows[0]
        items = self.state.read("SELECT seq, item FROM items WHERE tenant = ? AND "
                                "conversation = ? ORDER BY seq", (self.tenant, id))
        try:
            return ConversationRow(id, created_at, _any.decode(metadata), held, expires,
                                   [_any.decode(item) for _, item in items],
                                   items[-1][0] + 1 if items else 0)
        except msgspec.DecodeError as e:
            log.error("state: conversation %s cannot be read (%s): treated as unknown", id, e)
            return None

    # -- expiry ---------------------------------------------------------------------------------

    def expired(self, before: float, limit: int) -> tuple[list[str], list[str]]:
        """Ids of responses and chat sessions, and of conversations, whose rows expired
        before `before` (at most `limit` of each)."""
        if not self.cold:
            return [], []
        found = []
        for table in ("stored", "conversations"):
            rows = self.state.read(f"SELECT id FROM {table} WHERE tenant = ? AND "
                                   "expires_at < ? LIMIT ?", (self.tenant, before, limit))
            found.append([r[0] for r in rows if not self._going(r[0])])
        return found[0], found[1]

    def orphans(self, limit: int) -> list[str]:
        """Held sessions no row names any more (a crash between two writes left them)."""
        if not self.cold:
            return []
        rows = self.state.read(
            "SELECT session FROM held h WHERE tenant = ?1 AND NOT EXISTS (SELECT 1 FROM "
            "stored s WHERE s.tenant = ?1 AND s.session = h.session AND s.shared) AND NOT "
            "EXISTS (SELECT 1 FROM conversations c WHERE c.tenant = ?1 AND c.held = h.session) "
            "LIMIT ?2", (self.tenant, limit))
        return [r[0] for r in rows if not self._going(r[0])]
