"""The state directory: made private, refused in one line when it cannot be used, locked
by one server at a time (the lock goes with its holder, even on SIGKILL)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from radixlm.runtime.state.location import (
    StateDirError,
    default_state_dir,
    make_private_dir,
    open_state_dir,
)


def test_default_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RADIXLM_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "radixlm"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/is/ignored")
    assert default_state_dir() == Path.home() / ".local" / "state" / "radixlm"
    monkeypatch.setenv("RADIXLM_STATE_DIR", str(tmp_path / "mine"))
    assert default_state_dir() == tmp_path / "mine"


def test_a_missing_directory_is_made_private(tmp_path: Path) -> None:
    state = open_state_dir(tmp_path / "a" / "b")
    try:
        assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700
        assert stat.S_IMODE((tmp_path / "a" / "b" / "lock").stat().st_mode) == 0o600
        model = state.model_dir("f" * 24)
        assert model.is_dir() and stat.S_IMODE(model.stat().st_mode) == 0o700
        assert state.other_models("f" * 24) == []
        state.model_dir("e" * 24)
        assert state.other_models("f" * 24) == ["e" * 24]
    finally:
        state.close()


def test_a_group_readable_directory_is_made_private(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    make_private_dir(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_a_file_in_the_way_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StateDirError, match="not a directory|File exists"):
        open_state_dir(tmp_path / "file")


@pytest.mark.skipif(os.getuid() == 0, reason="root writes anywhere")
def test_a_read_only_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    with pytest.raises(StateDirError, match="permission denied|read-only"):
        open_state_dir(d)


def test_a_read_only_mount_is_refused_in_one_line(tmp_path: Path) -> None:
    """/proc is mounted read-only for writes of new files everywhere (root too)."""
    with pytest.raises(StateDirError) as info:
        open_state_dir("/proc/radixlm-state")
    assert "\n" not in str(info.value)


def test_a_second_server_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    first = open_state_dir(tmp_path)
    try:
        with pytest.raises(StateDirError, match=rf"in use by another radixlm server \(pid {os.getpid()}\)"):
            open_state_dir(tmp_path)
    finally:
        first.close()
    open_state_dir(tmp_path).close()  # free again once closed


def test_the_lock_goes_with_a_killed_holder(tmp_path: Path) -> None:
    code = ("import sys, time; from radixlm.runtime.state.location import open_state_dir; "
            f"s = open_state_dir({str(tmp_path)!r}); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(StateDirError, match=f"pid {holder.pid}"):
            open_state_dir(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    deadline = time.monotonic() + 5
    while True:
        try:
            open_state_dir(tmp_path).close()
            break
        except StateDirError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
