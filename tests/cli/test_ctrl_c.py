"""Ctrl-C, typed into a terminal (a pseudo-terminal: the kernel sends SIGINT to the
terminal's foreground process group), stops the reply in flight, not the engine: in
`radixlm chat` and in a script around `rl.Engine()`. The engine runs in a session of its
own and stops only when its owner exits.

To make "in flight" certain, the engine process is stopped (SIGSTOP) before the request
is sent and continued after the Ctrl-C: the request cannot have finished by itself."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ServerHandle, process_alive, wait_until_gone
from pty_session import CTRL_C, PtySession, descendants, engine_role_of
from radixlm.runtime.transport.raw_client import RawClient

START_S = 240.0  # an engine start on a loaded machine
ENGINE_ENV = "RADIXLM_TEST_ENGINE"


def _wait_idle(endpoint: str) -> None:
    """Until the engine has nothing running or waiting (its aborted request included)."""
    with RawClient(endpoint, timeout_s=60) as client:
        deadline = time.monotonic() + 60
        while True:
            stats = client.stats()
            if stats.running == 0 and stats.waiting == 0:
                return
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)


def test_ctrl_c_in_chat_aborts_the_reply_and_the_chat_goes_on(tmp_path: Path,
                                                                tiny_model_dir: Path) -> None:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    argv = [sys.executable, "-m", "radixlm.runtime.cli", "chat", "--model", str(tiny_model_dir),
            "--device", "cpu", "--temperature", "0", "--max-tokens", "64"]
    with PtySession(argv, env=env) as term:
        term.expect("chatting with", START_S)
        term.expect("> ")
        serve, engine, endpoint = engine_role_of(term.pid)
        os.kill(engine, signal.SIGSTOP)
        try:
            term.type("hello\r")
            term.expect("hello\r?\n")  # readline took the line: the turn starts
            time.sleep(0.3)  # (most likely sent by now; either way the outcome is the same)
            term.type(CTRL_C)
            term.expect(r"\(interrupted\)", 30)
        finally:
            os.kill(engine, signal.SIGCONT)
        _wait_idle(endpoint)
        term.expect("> ")
        term.type("again\r")
        term.expect(r"\[\d+ tokens in [\d.]+ s \| prompt \d+ tokens, \d+ cached", 120)
        assert process_alive(engine) and process_alive(serve), "the engine was stopped"
        # Line editing (readline): arrow keys move the cursor, up recalls the history.
        term.expect("> ")
        term.type("/hlp\x1b[D\x1b[De\r")  # "/hlp", two left, "e": "/help"
        term.expect("/reset")
        term.type("\x1b[A\r")  # the line before: "/help" again
        term.expect("/reset")
        # At the idle prompt: the first Ctrl-C says how to leave, the second leaves.
        # A person reads the prompt before pressing a key; a Ctrl-C sent the instant it is
        # drawn can land before CPython's readline waits for input, and is then only seen
        # at the next key (once in CI): wait as a person would.
        term.expect("> ")
        time.sleep(0.3)
        term.type(CTRL_C)
        term.expect(r"Ctrl-C again.*\n> ")  # (the prompt is back: a person reads, then types)
        time.sleep(0.3)
        term.type(CTRL_C)
        assert term.wait(60) == 0, term.output
        assert "Traceback" not in term.output and "error" not in term.output, term.output
    wait_until_gone([engine, serve], 30, "the engine outlived the chat that started it")
    history = (tmp_path / "state" / "radixlm" / "chat_history").read_text()
    # (readline may keep a recalled, unchanged line once or twice)
    assert [line for line in history.splitlines() if line][:3] == ["hello", "again", "/help"]


SCRIPT = textwrap.dedent(f"""
    import os, sys
    import radixlm as rl

    engine = rl.Engine(os.environ["{ENGINE_ENV}"], device="cpu", kv_tokens=1024, threads=1)
    print("READY", flush=True)
    sys.stdin.readline()  # the test stops the engine process, then says go
    try:
        with engine.stream("Once upon a time", max_tokens=100, ignore_eos=True,
                           temperature=0) as stream:
            print("STREAMING", flush=True)
            for delta in stream:
                pass
        print("NOT INTERRUPTED", flush=True)
    except KeyboardInterrupt:
        print("CAUGHT", engine.aclient.in_flight, flush=True)
    sys.stdin.readline()  # the test continues the engine, then says go
    result = engine.generate("Hello", max_tokens=4, temperature=0)
    print("AFTER", result.meta_info["completion_tokens"], engine.alive, flush=True)
    engine.close()
    print("CLOSED", flush=True)
""")


def test_a_script_catching_ctrl_c_around_a_stream_keeps_its_engine(tmp_path: Path,
                                                                   tiny_model_dir: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, ENGINE_ENV: str(tiny_model_dir)}
    with PtySession([sys.executable, str(script)], env=env) as term:
        term.expect("READY", START_S)
        serve, engine, endpoint = engine_role_of(term.pid)
        os.kill(engine, signal.SIGSTOP)
        try:
            term.type("go\r")
            term.expect("STREAMING")
            time.sleep(0.3)  # (most likely sent by now; either way the outcome is the same)
            term.type(CTRL_C)
            term.expect(r"CAUGHT 0", 30)  # the stream was closed: nothing left in flight
        finally:
            os.kill(engine, signal.SIGCONT)
        _wait_idle(endpoint)
        assert process_alive(engine) and process_alive(serve), "the engine was stopped"
        # rl.Engine() serves ZeroMQ only: no HTTP process unless asked for.
        assert not any("radixlm.runtime.http" in argv for argv in descendants(term.pid).values())
        term.type("go\r")
        term.expect(r"AFTER 4 True", 120)
        term.expect("CLOSED", 60)
        assert term.wait(60) == 0, term.output
        assert "Traceback" not in term.output, term.output
    wait_until_gone([engine, serve], 30, "the engine outlived the script that started it")


@pytest.mark.usefixtures("pool_integrity")
def test_ctrl_c_in_generate_aborts_the_request_and_exits_130(server: ServerHandle) -> None:
    """The request in flight is aborted in the server (the pool is clean after), the
    command exits with 130 and no traceback; the server goes on."""
    engine = server.child_pids[0] if _is_engine(server.child_pids[0]) else server.child_pids[1]
    argv = [sys.executable, "-m", "radixlm.runtime.cli", "generate", "Once upon a time",
            "--endpoint", server.endpoint, "--max-tokens", "200", "--raw"]
    os.kill(engine, signal.SIGSTOP)
    try:
        with PtySession(argv) as term:
            term.expect("waiting for the reply", 120)  # sent (the engine cannot answer)
            term.type(CTRL_C)
            assert term.wait(60) == 130, term.output
            assert "Traceback" not in term.output, term.output
    finally:
        os.kill(engine, signal.SIGCONT)
    _wait_idle(server.endpoint)


def _is_engine(pid: int) -> bool:
    return b"engine" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
