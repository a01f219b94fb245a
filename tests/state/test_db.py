"""`StateDB`: committed before a future resolves, group commits, one bad job fails alone,
a full disk fails writes with one log line and the process goes on; what was committed
survives a SIGKILL of the writing process."""

from __future__ import annotations

import logging
import signal
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from radixlm.runtime.state.db import StateDB, StateWriteError

SCHEMA = "CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, v BLOB);"


def _put(k: str, v: bytes):
    return lambda c: c.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (k, v))


def test_a_write_is_readable_by_another_connection_once_its_future_resolves(tmp_path: Path) -> None:
    db = StateDB(tmp_path / "s.sqlite", SCHEMA, name="things")
    try:
        db.write(_put("a", b"1")).result(10)
        other = sqlite3.connect(tmp_path / "s.sqlite")
        assert other.execute("SELECT v FROM kv WHERE k='a'").fetchone() == (b"1",)
        other.close()
        assert stat.S_IMODE((tmp_path / "s.sqlite").stat().st_mode) == 0o600
    finally:
        db.close()


def test_many_writes_commit_in_order(tmp_path: Path) -> None:
    db = StateDB(tmp_path / "s.sqlite", SCHEMA, name="things")
    try:
        futs = [db.write(_put("k", str(i).encode())) for i in range(2000)]
        for f in futs:
            f.result(30)
        assert db.read("SELECT v FROM kv") == [(b"1999",)]
    finally:
        db.close()


def test_a_failing_job_fails_alone(tmp_path: Path) -> None:
    db = StateDB(tmp_path / "s.sqlite", SCHEMA, name="things")
    try:
        good1 = db.write(_put("a", b"1"))
        bad = db.write(lambda c: c.execute("INSERT INTO missing VALUES (1)"))
        good2 = db.write(_put("b", b"2"))
        good1.result(10), good2.result(10)
        with pytest.raises(StateWriteError):
            bad.result(10)
        assert sorted(db.read("SELECT k FROM kv")) == [("a",), ("b",)]
    finally:
        db.close()


def test_a_full_disk_is_said_once_and_writes_work_again_when_room_returns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = StateDB(tmp_path / "s.sqlite", SCHEMA, name="sessions", max_bytes=64 * 1024)
    caplog.set_level(logging.WARNING, logger="radixlm.state")
    try:
        big = b"x" * 40_000
        db.write(_put("a", big)).result(10)
        failures = 0
        for i in range(5):
            try:
                db.write(_put(f"b{i}", big)).result(10)
            except StateWriteError as e:
                failures += 1
                assert "disk full" in str(e)
        assert failures == 5 and db.failing == "disk full"
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "disk full" in errors[0].getMessage()
        assert "keeps serving" in errors[0].getMessage()
        db.write(lambda c: c.execute("DELETE FROM kv")).result(10)  # room again
        db.write(_put("c", b"small")).result(10)
        assert db.failing is None
        assert any("work again" in r.getMessage() for r in caplog.records)
    finally:
        db.close()


def test_committed_writes_survive_a_sigkill(tmp_path: Path) -> None:
    code = (
        "import os, signal\n"
        "from radixlm.runtime.state.db import StateDB\n"
        f"db = StateDB({str(tmp_path / 's.sqlite')!r}, {SCHEMA!r}, name='t')\n"
        "for i in range(50):\n"
        "    db.write(lambda c, i=i: c.execute('INSERT INTO kv VALUES (?, ?)', (str(i), b'v'))).result()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    db = StateDB(tmp_path / "s.sqlite", SCHEMA, name="t")
    try:
        assert len(db.read("SELECT k FROM kv")) == 50
    finally:
        db.close()
