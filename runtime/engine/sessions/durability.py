"""What makes a durable session outlive its connection and the engine: its row (durable.py)
and its KV (the disk tier) saved whenever it changes, read back at start, detached when
its client goes, resumed by a client of its tenant, and closed once detached too long.
Pins are saved the same way (every pin is kept when there is a state directory).

Apart from manager.py because none of it changes what a session holds in the cache: it
writes and reads the state directory and moves sessions between owners. Without a state
directory (`log` None) nothing is durable and every call here is a no-op or a refusal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from radixlm.runtime.engine.sessions.disk_backup import DiskBackup
from radixlm.runtime.engine.sessions.durable import DurableLog, PinRow, SessionRow
from radixlm.runtime.engine.sessions.records import (
    DETACHED,
    PinnedPrefix,
    Records,
    Residency,
    Session,
)
from radixlm.runtime.protocol import ErrorCode
from radixlm.runtime.rules import RequestError

log = logging.getLogger(__name__)


class Durability:
    """The durable sessions and pins of one `SessionManager` (the manager's `durability`).

    `log`: the state directory's rows (None: no state directory); `disk`: the disk tier
    that keeps their KV (None: their history is recomputed after a restart);
    `expiry_s`: how long a detached durable session is kept (None: until its TTL and
    retention let it go).
    """

    def __init__(self, records: Records, clock: Callable[[], float], log: DurableLog | None,
                 disk: DiskBackup | None, expiry_s: float | None) -> None:
        self.records = records
        self.clock = clock
        self.log = log
        self.disk = disk
        self.expiry_s = expiry_s

    @property
    def enabled(self) -> bool:
        """Whether sessions may be durable (there is a state directory)."""
        return self.log is not None

    # ------------------------------------------------------------------ saving
    def persist(self, s: Session) -> Future[None] | None:
        """Save a durable session's row (None: not durable); the future resolves once it
        is committed."""
        if not s.durable or self.log is None:
            return None
        row = SessionRow(s.id, s.tenant, s.namespace, s.retention, s.ttl_s, s.history,
                         s.assistant_open, s.lineage)
        if self.disk is not None:
            self.disk.save(s)  # its KV, in the background
        return self.log.save_session(row, time.time())

    def persist_pin(self, pin: PinnedPrefix) -> Future[None] | None:
        """Save a pin (every pin is kept across restarts when there is a state directory)."""
        if self.log is None:
            return None
        if self.disk is not None:
            self.disk.save_prefix(pin.namespace, pin.ids)
        return self.log.save_pin(PinRow(pin.name, pin.namespace, pin.ids))

    def forget(self, s: Session) -> None:
        """`s` was closed: a durable session's row goes."""
        if s.durable and self.log is not None:
            self.log.delete_session(s.id)

    def forget_pin(self, name: str) -> None:
        """The pin `name` was released: its row goes."""
        if self.log is not None:
            self.log.delete_pin(name)

    # ----------------------------------------------------------------- loading
    def load_state(self, sessions: list[SessionRow]) -> int:
        """Durable sessions read back at start (durable.py): detached and demoted, their
        whole history what their next turn should find (on disk, or recomputed); idle
        since their last write. Returns how many were loaded."""
        now, wall = self.clock(), time.time()
        for row in sessions:
            self.records.sessions[row.id] = Session(
                id=row.id, client=DETACHED, namespace=row.namespace, retention=row.retention,
                ttl_s=row.ttl_s, history=row.history, residency=Residency.DEMOTED, node=None,
                held_len=0, kv_len=len(row.history),
                last_used=now - max(0.0, wall - row.updated), lineage=row.lineage,
                assistant_open=row.assistant_open, durable=True, tenant=row.tenant)
        return len(sessions)

    # ------------------------------------------------------------------ owners
    def detach(self, s: Session) -> None:
        """`s`'s client is gone: the session is kept, nobody's, for a client of its tenant
        to `resume`."""
        s.client = DETACHED
        s.last_used = self.clock()
        log.debug("session %s detached (durable)", s.id[:8])

    def resume(self, session_id: str, client: bytes, tenant: str | None) -> Session:
        """Make durable session `session_id` the connection `client`'s own (its previous
        connection loses it). NOT_FOUND unless it is durable and of `tenant`, exactly as
        for an unknown id; BUSY while a turn runs."""
        s = self.records.sessions.get(session_id)
        if s is None or not s.durable or s.tenant != tenant:
            raise RequestError(ErrorCode.NOT_FOUND, f"no session {session_id!r}")
        if s.busy:
            raise RequestError(ErrorCode.BUSY, f"session {session_id!r} has a request in flight")
        s.client = client
        s.last_used = self.clock()
        log.debug("session %s resumed", s.id[:8])
        return s

    def expired(self, now: float) -> list[Session]:
        """Detached sessions idle past the durable expiry (the caller closes them)."""
        if self.expiry_s is None:
            return []
        gone = [s for s in self.records.sessions.values()
                if s.client == DETACHED and now - s.last_used > self.expiry_s]
        for s in gone:
            log.info("session %s: detached for %.0fs, closed", s.id[:8], now - s.last_used)
        return gone
