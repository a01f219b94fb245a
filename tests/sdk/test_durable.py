"""The SDK's durable sessions: `durable=True` chats outlive the client that opened them
and a server restart, `resume(id)` takes one back token-exact, and a client whose
connection the server dropped (its frontend restarted) reconnects by itself on its next
call, its durable sessions resumed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import radixlm as rl

from tests.conftest import start_test_server
from tests.server.test_engine_liveness import role_pid

SAMPLING = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_a_durable_chat_outlives_its_client_and_a_restart(tmp_path: Path,
                                                         tiny_model_dir: Path) -> None:
    state = tmp_path / "state"
    with start_test_server(tmp_path / "a", tiny_model_dir, "--state-dir", str(state)) as server:
        with rl.connect(server.endpoint) as client:
            assert client.state  # this server keeps state
            with client.session(system="You are terse.", durable=True) as chat:
                first = chat.send("Name a colour.", **SAMPLING)
                sid, length = chat.id, chat.length
            assert chat.durable and sid is not None  # `with` left it open
        with rl.connect(server.endpoint) as other:  # another process of the same user
            back = other.resume(sid)
            assert back.length == length
            second = back.send("Another?", **SAMPLING)
            assert second.meta_info["cached_tokens"] == length  # the whole history hit
            length = back.length
    with start_test_server(tmp_path / "b", tiny_model_dir, "--state-dir", str(state)) as server, \
            rl.connect(server.endpoint) as client:
        back = client.resume(sid)
        assert back.length == length and first.text is not None
        back.send("And one more?", **SAMPLING)
        back.close()
        with pytest.raises(rl.NotFoundError):
            client.resume(sid)


def test_a_client_reconnects_after_its_frontend_restarts(tmp_path: Path,
                                                        tiny_model_dir: Path) -> None:
    with start_test_server(tmp_path, tiny_model_dir, "--state-dir", str(tmp_path / "state")
                           ) as server, rl.connect(server.endpoint) as client:
        chat = client.session(durable=True).open()
        chat.send("Remember the number 42.", **SAMPLING)
        length = chat.length
        os.kill(role_pid(server.process.pid, "frontend"), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # in flight at the crash: EngineDeadError; the next call reconnects
            try:
                again = chat.send("What was it?", **SAMPLING)
                break
            except rl.EngineError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert again.meta_info["cached_tokens"] == length  # resumed, its history held
        assert client.alive
        chat.close()
