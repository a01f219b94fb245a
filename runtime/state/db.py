"""`StateDB`: one SQLite database of a process's durable state, written by one thread.

The caller never waits on the disk unless it asks to: `write(job)` queues a function of
a `sqlite3.Connection` and returns a `Future`; the writer thread runs every job queued
meanwhile in one transaction (group commit: one fsync for many) and resolves their
futures once it is committed. A reply that acknowledges something durable (a stored
response, a conversation item, a session opened as durable) is sent from the future's
completion, as a database commits before it answers.

WAL with ``synchronous=FULL``: a committed transaction survives a crash of the process
and of the machine. A job that fails (a full disk, a read-only file system) fails its own
future and nothing else; a failure is logged in one line, with what it means (the server
keeps serving, without saving), at most once every ten minutes however writes fail and
succeed in between (a nearly full disk takes small rows and refuses big ones), and the
first success after a logged failure is logged too.
``max_bytes`` caps the file (SQLite's ``max_page_count``): past it writes fail as on a
full disk, which is how the tests inject that fault.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from radixlm.runtime.state.location import FILE_MODE, StateDirError

T = TypeVar("T")
Job = Callable[[sqlite3.Connection], Any]
MAX_BATCH = 512  # jobs per transaction
QUIET_S = 600.0  # a write failure is logged at most this often
_STOP = object()


class StateDB:
    """One SQLite file, its schema applied at open, written by a thread of its own."""

    def __init__(self, path: Path, schema: str, *, name: str,
                 log: logging.Logger | None = None, max_bytes: int = 0) -> None:
        self.path = Path(path)
        self.name = name  # what the log calls its contents ("sessions and pins", ...)
        self.log = log or logging.getLogger("radixlm.state")
        self.failing: str | None = None  # why the last write failed (None: writes work)
        self._error: BaseException | None = None
        self._said_at = -QUIET_S  # when a failure was last logged (monotonic)
        self._said = False  # this failure episode was logged
        self._lock = threading.Lock()  # the connection: the writer, or a reader
        try:
            if not self.path.exists():
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
                os.close(fd)
            self._conn = sqlite3.connect(self.path, isolation_level=None,
                                         check_same_thread=False)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            if max_bytes > 0:
                page = self._conn.execute("PRAGMA page_size").fetchone()[0]
                self._conn.execute(f"PRAGMA max_page_count={max(1, max_bytes // page)}")
            self._conn.executescript(schema)
        except (sqlite3.Error, OSError) as e:
            raise StateDirError(f"state database {self.path}: {e}") from None
        for suffix in ("-wal", "-shm"):  # SQLite makes them with the umask's mode
            with contextlib.suppress(OSError):
                Path(f"{self.path}{suffix}").chmod(FILE_MODE)
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"state-{self.path.stem}",
                                        daemon=True)
        self._thread.start()

    # -- reading (start-up, and the rare lookup) ----------------------------------------
    def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    # -- writing -------------------------------------------------------------------------
    def write(self, job: Callable[[sqlite3.Connection], T]) -> Future[T]:
        """Queue `job(conn)`; the future resolves once its transaction is committed (or
        fails with the job's error, or the commit's)."""
        fut: Future[T] = Future()
        self._jobs.put((job, fut))
        return fut

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Future[None]:
        return self.write(lambda c: c.execute(sql, params) and None)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before this call is committed (or failed)."""
        return _wait(self.write(lambda c: None), timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Commit what is queued, then stop the writer and close the file."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout_s)
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._conn.close()

    def _run(self) -> None:
        while True:
            first = self._jobs.get()
            if first is _STOP:
                return
            batch = [first]
            stop = False
            while len(batch) < MAX_BATCH:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                batch.append(more)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[tuple[Job, Future[Any]]]) -> None:
        live = [(job, fut) for job, fut in batch if fut.set_running_or_notify_cancel()]
        if not live:
            return
        with self._lock:
            results = self._transaction(live)
            if results is None and len(live) > 1:  # one bad job: run each on its own
                for item in live:
                    self._settle([item], self._transaction([item]))
                return
        self._settle(live, results)

    def _transaction(self, jobs: list[tuple[Job, Future[Any]]]) -> list[Any] | None:
        """Run `jobs` in one transaction: their results, or None (rolled back; the
        error is kept in `_error` for the futures)."""
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            results = [job(conn) for job, _ in jobs]
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as e:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            self._error = e
            return None
        return results

    def _settle(self, jobs: list[tuple[Job, Future[Any]]], results: list[Any] | None) -> None:
        if results is None:
            why = _describe(self._error)
            now = time.monotonic()
            if self.failing is None and now - self._said_at >= QUIET_S:
                self.log.error("state: cannot write %s (%s): %s are not saved until it can; "
                               "the server keeps serving", self.path, why, self.name)
                self._said_at, self._said = now, True
            self.failing = why
            for _, fut in jobs:
                fut.set_exception(StateWriteError(f"{self.path}: {why}"))
            return
        if self.failing is not None:
            if self._said:
                self.log.warning("state: writes to %s work again", self.path)
            self.failing, self._said = None, False
        for (_, fut), result in zip(jobs, results, strict=True):
            fut.set_result(result)


class StateWriteError(Exception):
    """A write to the state database failed (full disk, read-only file system, ...)."""


def _describe(e: BaseException) -> str:
    text = str(e)
    if "full" in text:
        return "disk full"
    if "readonly" in text or "read-only" in text:
        return "read-only"
    return text


def _wait(fut: Future[Any], timeout_s: float | None) -> bool:
    try:
        fut.result(timeout_s)
    except Exception:  # noqa: BLE001 - failed is settled too
        return fut.done()
    return True
