"""Starting and stopping servers: the `radixlm` CLI end to end, SIGTERM, orphans, start-up
failures, and the CLI's client commands against the shared server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    assert_pool_clean,
    pid_from_file,
    process_alive,
    start_test_server,
    wait_until_gone,
)
from radixlm.runtime.protocol import (
    CloseSession,
    Done,
    ErrorCode,
    ListSessions,
    OpenSession,
    SessionList,
    SessionOpened,
)
from radixlm.runtime.transport.errors import EngineError

CLI = [sys.executable, "-m", "radixlm.runtime.cli"]


def _runtime_dir_of(pid: int) -> Path:
    """The launcher passes each child its spec file, inside the runtime directory."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    spec = next(a for a in args if a.endswith(b"spec.json"))
    return Path(os.fsdecode(spec)).parent


def test_sigterm_stops_every_process_and_removes_sockets(tmp_path: Path, tiny_model_dir: Path) -> None:
    socket_path = tmp_path / "radixlm.sock"
    with start_test_server(tmp_path / "srv", tiny_model_dir, "--endpoint",
                           f"ipc://{socket_path}") as srv:
        assert srv.endpoint == f"ipc://{socket_path}" and socket_path.exists()
        assert len(srv.child_pids) == 2, srv.child_pids  # engine + frontend
        runtime_dir = _runtime_dir_of(srv.child_pids[0])
        assert runtime_dir.stat().st_mode & 0o777 == 0o700
        assert socket_path.stat().st_mode & 0o777 == 0o600
        with srv.client() as c:
            assert isinstance(c.generate("Hi", max_tokens=2, temperature=0), Done)
            assert_pool_clean(c)
        code = srv.stop()
        assert code == 0, srv.log()
        assert not srv.survivors(), "children outlived the server"
        assert not socket_path.exists(), "client socket left behind"
        assert not runtime_dir.exists(), "runtime directory left behind"
        assert not srv.endpoint_file.exists()


def _child_dies_with_killed_parent(tmp_path: Path, guard: str) -> None:
    """Start parent -> child where the child first runs `guard` (with `parent_pid` set),
    SIGKILL the parent, and require the child to be gone within 10 s."""
    pid_file = tmp_path / "child.pid"
    child = (
        "import os, sys, time; from radixlm.runtime.server import child; "
        f"parent_pid = int(sys.argv[1]); {guard}; "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    parent = (
        "import os, subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())]); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        child_pid = pid_from_file(pid_file, proc, 30, "the child")
        assert process_alive(child_pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wait_until_gone([child_pid], 10, f"child {child_pid} outlived its parent")


def test_children_die_with_their_parent(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a SIGKILLed launcher takes its children with it."""
    _child_dies_with_killed_parent(tmp_path, "child.die_with_parent(parent_pid)")


def test_watcher_stops_a_process_whose_parent_was_sigkilled(tmp_path: Path) -> None:
    """`stop_when_gone` (serve --parent-pid): polled, so it does not depend on the thread
    that started the process, and it sees a SIGKILLed parent."""
    _child_dies_with_killed_parent(tmp_path, "child.stop_when_gone(parent_pid, 0.05)")


def test_serve_stops_cleanly_when_its_parent_pid_exits(tmp_path: Path, tiny_model_dir: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with start_test_server(tmp_path / "srv", tiny_model_dir,
                               "--parent-pid", str(owner.pid)) as srv:
            assert srv.process.poll() is None
            owner.kill()
            owner.wait()
            assert srv.process.wait(30) == 0, srv.log()
            assert "is gone: stopping" in srv.log()
            assert not srv.survivors(), "children outlived the server"
            assert not srv.endpoint_file.exists()
    finally:
        owner.kill()
        owner.wait()


def test_engine_start_failure_is_reported(tmp_path: Path) -> None:
    not_a_model = tmp_path / "not-a-model"  # there (so the launcher's checks pass), but empty
    not_a_model.mkdir()
    proc = subprocess.run([*CLI, "generate", "hi", "--model", str(not_a_model), "--device",
                           "cpu"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc
    assert "engine process exited with code 1 during start-up" in proc.stderr, proc.stderr
    assert str(not_a_model) in proc.stderr, proc.stderr  # the engine's own error, not a timeout
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # said once


@pytest.mark.usefixtures("pool_integrity")
def test_cli_generate_and_sessions_against_a_running_server(server: Any) -> None:
    with server.client() as c:
        reference = c.generate("Once upon a time", max_tokens=6, temperature=0, ignore_eos=True)
    out = subprocess.run(
        [*CLI, "generate", "Once upon a time", "--endpoint", server.endpoint, "--max-tokens", "6",
         "--temperature", "0", "--raw"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    if 2 not in reference.token_ids:  # EOS would end the CLI's run (it does not ignore EOS)
        assert out.stdout == reference.text + "\n"

    with server.client() as owner:
        opened = owner.call(OpenSession(rid="s"))
        assert isinstance(opened, SessionOpened)
        listed = subprocess.run([*CLI, "sessions", "--endpoint", server.endpoint],
                                capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["SESSION", "LENGTH", "IDLE", "RETENTION", "BUSY", "NAMESPACE",
                              "TOOLS"]
    # Another client's session shows as an 8-hex prefix: enough for a person, never the id.
    prefix = opened.session[:8]
    assert any(row.split()[0] == prefix for row in rows), listed.stdout
    assert opened.session[:9] not in listed.stdout
    with server.client() as stranger:
        mine = stranger.call(ListSessions(rid="ls"))
        assert isinstance(mine, SessionList) and mine.sessions == []  # default: own only
        with pytest.raises(EngineError) as refused:
            stranger.call(CloseSession(rid="c", session=prefix))
        assert refused.value.code == ErrorCode.NOT_FOUND


def test_serve_refuses_a_public_wildcard_endpoint() -> None:
    """(The endpoint rules themselves: transport/test_channel.py.)"""
    proc = subprocess.run([*CLI, "serve", "--endpoint", "tcp://*:5555"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "tcp://*:5555" in proc.stderr, proc
