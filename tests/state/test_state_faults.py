"""A state directory that cannot be used costs one clear line, never the server: read-only,
held by another server, on a full disk (fault injection: `RADIXLM_STATE_MAX_BYTES`), or
made by another model (never read)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from radixlm.runtime.engine.durable_state import MAX_BYTES_ENV
from radixlm.runtime.protocol import CloseSession, Input, OpenSession, SessionOpened

from tests.conftest import assert_pool_clean, start_test_server


def _unwritable(tmp_path: Path) -> Path:
    if os.getuid() == 0:  # root writes through permissions: a read-only file system then
        return Path("/sys/radixlm-state")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    return d / "state"


def _durable_open(c) -> SessionOpened:  # noqa: ANN001 - a RawClient
    opened = c.call(OpenSession(rid=c.new_rid("o"), durable=True))
    assert isinstance(opened, SessionOpened)
    return opened


def test_an_unwritable_state_directory_is_one_line_and_the_server_serves(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    state = _unwritable(tmp_path)
    with start_test_server(tmp_path, tiny_model_dir, "--state-dir", str(state)) as server, \
            server.client() as c:
        assert server.welcome.state == ""  # no state: nothing durable
        opened = _durable_open(c)
        assert not opened.durable
        c.generate(Input(text="still serving"), max_tokens=2, temperature=0.0)
        c.call(CloseSession(rid="c", session=opened.session))
    lines = [ln for ln in server.log_path.read_text().splitlines() if str(state) in ln]
    assert len(lines) == 1 and "serving without state" in lines[0], lines


def test_a_second_server_on_a_held_directory_serves_without_it(tmp_path: Path,
                                                               tiny_model_dir: Path) -> None:
    state = tmp_path / "state"
    with start_test_server(tmp_path / "a", tiny_model_dir, "--state-dir", str(state)) as first:
        assert first.welcome.state
        with start_test_server(tmp_path / "b", tiny_model_dir, "--state-dir",
                               str(state)) as second, second.client() as c:
            assert second.welcome.state == ""
            c.generate(Input(text="still serving"), max_tokens=2, temperature=0.0)
        log = second.log_path.read_text()
        assert f"in use by another radixlm server (pid {first.process.pid})" in log
        assert log.count("in use by another") == 1


def test_a_full_disk_is_said_once_and_the_engine_keeps_serving(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_BYTES_ENV, str(20 * 1024))  # a few pages: the schema and little else
    with start_test_server(tmp_path, tiny_model_dir, "--state-dir", str(tmp_path / "state"),
                           "--page-size", "1", "--retained-cap", "4000") as server, \
            server.client() as c:
        sessions = []
        for i in range(12):  # histories of ~1 KB each: the file fills up
            opened = _durable_open(c)
            sessions.append(opened.session)
            c.generate(Input(input_ids=[10 + i] * 240), session=opened.session, max_tokens=2,
                       temperature=0.0)
        time.sleep(0.5)
        refused = c.call(OpenSession(rid="full", durable=True,  # once full: opened, but not
                                     input=Input(input_ids=[7] * 240)))  # durable: said so
        assert isinstance(refused, SessionOpened) and not refused.durable
        done = c.generate(Input(text="still serving"), max_tokens=2, temperature=0.0)
        assert done.finish_reason == "length"
        c.call(CloseSession(rid="c", sessions=[*sessions, refused.session]))
        assert_pool_clean(c)
    log = server.log_path.read_text()
    assert log.count("cannot write") == 1 and "disk full" in log and "keeps serving" in log


def test_state_of_another_model_setup_is_never_used(tmp_path: Path, tiny_model_dir: Path) -> None:
    state = tmp_path / "state"
    with start_test_server(tmp_path / "a", tiny_model_dir, "--state-dir", str(state),
                           "--page-size", "1") as server, server.client() as c:
        session = _durable_open(c).session
        first = server.welcome.state
    # The same weights with another page size: another fingerprint, another KV layout.
    with start_test_server(tmp_path / "b", tiny_model_dir, "--state-dir", str(state),
                           "--page-size", "2") as server, server.client() as c:
        assert server.welcome.state and server.welcome.state != first
        assert session not in {s.session for s in c.list_sessions()}
    log = server.log_path.read_text()
    assert log.count("other model setup(s)") == 1
