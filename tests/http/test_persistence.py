"""Stored responses, chat sessions and conversations outlive ``radixlm serve`` (a state
directory, two API keys, the tiny model): after a clean restart and after a SIGKILL of
every process of the server, each is back under its own key only, and its next turn
computes only the new tokens (the history's KV comes back from the engine's disk tier);
when the engine has lost its state the turn is recomputed, never an error; a state
directory whose database is full gives one log line and a server that serves on, in
memory.

References: transformers' chat template for what a continued prompt must hold (the
stored history, token-exact, plus the new message), the engine's disk block size for
what must come back cached, and the objects as the first server returned them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import start_test_server
from http_helpers import API_KEY, HttpServer, free_port
from radixlm.runtime.engine.sessions.disk_backup import BLOCK_TOKENS as BLOCK
from radixlm.runtime.http.state import MAX_BYTES_ENV

pytestmark = pytest.mark.timeout(300)

OTHER_KEY = "other-key-51d0"
LONG = ("You answer questions about a radix tree that caches attention keys and values "
        "for many agents at once. ") * 3  # more than two disk blocks with the template
KW: dict[str, Any] = dict(max_output_tokens=8, temperature=0)


@contextlib.contextmanager
def serve(workdir: Path, model_dir: Path, state: Path) -> Iterator[HttpServer]:
    port = free_port()
    with start_test_server(workdir, model_dir, "--http", f"127.0.0.1:{port}", "--api-key",
                           API_KEY, "--api-key", OTHER_KEY, "--state-dir", str(state)) as handle:
        yield HttpServer(handle, f"http://127.0.0.1:{port}", model_dir.name, model_dir)


@pytest.fixture(scope="module")
def hf_tok(http_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(http_model_dir))


def _history(r: Any) -> int:
    return r.usage.input_tokens + r.usage.output_tokens


def _delta_len(tok: Any, text: str) -> int:
    """Tokens of one user message appended to a history, with the assistant header."""
    rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True, tokenize=False)
    return len(tok(rendered, add_special_tokens=False)["input_ids"])


def _on_disk(length: int) -> int:
    return length // BLOCK * BLOCK


def _chat_turn(api: Any, server: HttpServer, session: str, text: str) -> Any:
    """A turn of chat session `session`, in place."""
    reply = api.chat.completions.create(
        model=server.model, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": text}], extra_body={"session": {"id": session}})
    assert reply.model_extra["session"]["id"] == session
    return reply


def _kill(server: HttpServer) -> None:
    """Every process of the server at once: nothing is cleaned up."""
    os.killpg(server.server.process.pid, signal.SIGKILL)
    server.server.process.wait()


def _first_server(server: HttpServer) -> dict[str, Any]:
    """A stored response, a chat session and a conversation with a turn and items."""
    api = server.openai()
    r1 = api.responses.create(model=server.model, instructions=LONG, input="Name a colour.",
                              **KW)
    chat = api.chat.completions.create(
        model=server.model, max_tokens=8, temperature=0, extra_body={"session": {}},
        messages=[{"role": "system", "content": LONG}, {"role": "user", "content": "Hi."}])
    conv = api.conversations.create(items=[{"type": "message", "role": "user",
                                            "content": "Remember the number 41."}])
    turn = api.responses.create(model=server.model, conversation=conv.id, input="Which one?",
                                **KW)
    api.conversations.items.create(conv.id, items=[{"type": "message", "role": "user",
                                                    "content": "And now?"}])
    items = [i.id for i in api.conversations.items.list(conv.id, order="asc")]
    assert len(items) == 4  # its two messages, the turn's input and output, the added one
    api.close()
    return {"r1": r1, "chat": chat, "session": chat.model_extra["session"], "conv": conv,
            "turn": turn, "items": items}


@pytest.mark.parametrize("how", ["restart", "sigkill"])
def test_stored_objects_outlive_the_server(tmp_path: Path, http_model_dir: Path, hf_tok: Any,
                                           how: str) -> None:
    state = tmp_path / "state"
    with serve(tmp_path / "one", http_model_dir, state) as server:
        first = _first_server(server)
        time.sleep(0.5)  # the engine writes turns and KV blocks in the background
        if how == "sigkill":
            _kill(server)
    assert list(state.glob("models/*/http.sqlite")), "the HTTP API's database"
    with serve(tmp_path / "two", http_model_dir, state) as server:
        api = server.openai()
        r1 = first["r1"]
        got = api.responses.retrieve(r1.id)
        assert got.output_text == r1.output_text and got.instructions == LONG
        # previous_response_id continues the stored history, token-exact; its KV comes
        # back from the disk tier: only the tail past the last whole block is computed.
        r2 = api.responses.create(model=server.model, instructions=LONG, input="Another?",
                                  previous_response_id=r1.id, **KW)
        # (A reply cut by max_output_tokens gets its turn's two closing tokens first.)
        delta = _delta_len(hf_tok, "Another?")
        assert r2.usage.input_tokens - _history(r1) in (delta, delta + 2)
        cached = r2.usage.input_tokens_details.cached_tokens
        assert _on_disk(_history(r1)) >= 2 * BLOCK
        assert _on_disk(_history(r1)) <= cached <= _history(r1), r2.usage

        # The chat session continues in place, its history back from disk too.
        session = first["session"]
        nxt = _chat_turn(api, server, session["id"], "Again.")
        delta = _delta_len(hf_tok, "Again.")
        assert nxt.usage.prompt_tokens - session["length"] in (delta, delta + 2)
        assert nxt.usage.prompt_tokens_details.cached_tokens >= _on_disk(session["length"])
        status, body = server.request("GET", f"/v1/sessions/{session['id']}")
        assert status == 200 and body["length"] == nxt.model_extra["session"]["length"]

        # The conversation: its metadata, its items in order, and a next turn.
        conv = first["conv"]
        assert api.conversations.retrieve(conv.id).created_at == conv.created_at
        listed = [i.id for i in api.conversations.items.list(conv.id, order="asc")]
        assert listed == first["items"]
        more = api.responses.create(model=server.model, conversation=conv.id, input="Sure?",
                                    **KW)
        assert more.usage.input_tokens_details.cached_tokens >= _on_disk(_history(first["turn"]))
        assert len(api.conversations.items.list(conv.id).data) == len(listed) + 2

        # Another key's tenant finds none of them, exactly as unknown ids.
        other = server.openai(api_key=OTHER_KEY)
        for call in (lambda: other.responses.retrieve(r1.id),
                     lambda: other.responses.create(model=server.model, input="x",
                                                    previous_response_id=r1.id, **KW),
                     lambda: other.conversations.retrieve(conv.id),
                     lambda: other.conversations.items.list(conv.id),
                     lambda: other.chat.completions.create(
                         model=server.model, max_tokens=2,
                         messages=[{"role": "user", "content": "x"}],
                         extra_body={"session": {"id": session["id"]}})):
            with pytest.raises(openai.NotFoundError):
                call()
        assert server.request("GET", f"/v1/sessions/{session['id']}", key=OTHER_KEY)[0] == 404
        # ... and its own are its own.
        mine = other.responses.create(model=server.model, input="Mine.", **KW)
        assert other.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(mine.id)
        # Deleted objects stay deleted (after the next restart too).
        api.responses.delete(r2.id)
        api.conversations.delete(conv.id)
        other.close()
        api.close()
    with serve(tmp_path / "three", http_model_dir, state) as server:
        api = server.openai()
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(r2.id)
        with pytest.raises(openai.NotFoundError):
            api.conversations.retrieve(conv.id)
        assert api.responses.retrieve(r1.id).id == r1.id
        assert server.openai(api_key=OTHER_KEY).responses.retrieve(mine.id).id == mine.id
        api.close()


def test_a_lost_engine_state_is_recomputed_never_an_error(tmp_path: Path,
                                                           http_model_dir: Path) -> None:
    """The engine's sessions and KV are gone (its files removed), the HTTP API's rows are
    there: each stored object's next turn renders its stored history again."""
    state = tmp_path / "state"
    with serve(tmp_path / "one", http_model_dir, state) as server:
        first = _first_server(server)
    (model,) = state.glob("models/*")
    for path in model.iterdir():
        if path.name != "http.sqlite" and not path.name.startswith("http.sqlite-"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    with serve(tmp_path / "two", http_model_dir, state) as server:
        api = server.openai()
        r1 = first["r1"]
        r2 = api.responses.create(model=server.model, instructions=LONG, input="Another?",
                                  previous_response_id=r1.id, **KW)
        assert r2.usage.input_tokens > _history(r1)  # rendered again: the whole conversation
        assert r2.usage.input_tokens_details.cached_tokens < _on_disk(_history(r1))
        session = first["session"]
        nxt = _chat_turn(api, server, session["id"], "Again.")
        assert nxt.model_extra["session"]["length"] > session["length"]
        # A second turn is in the new session: its history is cached again.
        third = _chat_turn(api, server, session["id"], "Once more.")
        length = nxt.model_extra["session"]["length"]
        assert third.usage.prompt_tokens_details.cached_tokens == length
        more = api.responses.create(model=server.model, conversation=first["conv"].id,
                                    input="Sure?", **KW)
        assert more.status in ("completed", "incomplete")
        api.close()


def test_a_full_state_database_is_said_once_and_the_api_serves_on(
        tmp_path: Path, http_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_BYTES_ENV, str(17 * 4096))  # the schema's pages and one more
    state = tmp_path / "state"
    with serve(tmp_path / "one", http_model_dir, state) as server:
        api = server.openai()
        last = None
        for i in range(6):
            last = api.responses.create(model=server.model, input=f"Turn {i}. {LONG}",
                                        previous_response_id=last.id if last else None, **KW)
        conv = api.conversations.create(items=[{"type": "message", "role": "user",
                                                "content": LONG}])
        assert api.responses.retrieve(last.id).id == last.id  # kept, in memory
        assert api.conversations.items.list(conv.id).data
        api.close()
        log = server.server.log()
    said = [line for line in log.splitlines() if "cannot write" in line]
    assert len(said) == 1 and "http.sqlite" in said[0] and "disk full" in said[0], log


def test_a_killed_http_process_resumes_its_objects_sessions(tmp_path: Path,
                                                            http_model_dir: Path) -> None:
    """The engine runs on; the HTTP process is SIGKILLed and `radixlm serve` starts it
    again: its stored objects' sessions, detached by the engine, are resumed with their
    whole history cached (nothing recomputed)."""
    state = tmp_path / "state"
    with serve(tmp_path / "one", http_model_dir, state) as server:
        api = server.openai()
        r1 = api.responses.create(model=server.model, input="Name a colour.", instructions=LONG,
                                  **KW)
        chat = api.chat.completions.create(
            messages=[{"role": "user", "content": "Hi."}], max_tokens=6, temperature=0,
            model=server.model, extra_body={"session": {}})
        session = chat.model_extra["session"]
        api.close()
        old = next(p for p in server.server.child_pids
                   if b"radixlm.runtime.http" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.request("GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, server.server.log()
            time.sleep(0.2)
        api = server.openai()
        r2 = api.responses.create(model=server.model, input="Another?", instructions=LONG,
                                  previous_response_id=r1.id, **KW)
        assert r2.usage.input_tokens_details.cached_tokens == _history(r1)
        nxt = _chat_turn(api, server, session["id"], "Again.")
        assert nxt.usage.prompt_tokens_details.cached_tokens == session["length"]
        api.close()


def test_an_engine_started_again_under_the_http_api_keeps_its_objects(
        tmp_path: Path, http_model_dir: Path) -> None:
    """The engine is SIGKILLed and `radixlm serve` starts it again (it reads its state
    back); the HTTP process lives on: a chat session's next turn (in place) and a stored
    response's continuation resume their sessions, the history back from disk."""
    from tests.server.test_engine_liveness import role_pid

    state = tmp_path / "state"
    with serve(tmp_path / "one", http_model_dir, state) as server:
        api = server.openai()
        r1 = api.responses.create(model=server.model, input="Name a colour.", instructions=LONG,
                                  **KW)
        chat = api.chat.completions.create(
            messages=[{"role": "system", "content": LONG}, {"role": "user", "content": "Hi."}],
            max_tokens=6, temperature=0, model=server.model, extra_body={"session": {}})
        session = chat.model_extra["session"]
        time.sleep(0.5)  # the engine writes turns and KV blocks in the background
        os.kill(role_pid(server.server.pid, "engine"), signal.SIGKILL)
        deadline = time.monotonic() + 90
        while server.request("GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, server.server.log()
            time.sleep(0.2)
        nxt = _chat_turn(api, server, session["id"], "Again.")
        assert nxt.usage.prompt_tokens_details.cached_tokens >= _on_disk(session["length"])
        r2 = api.responses.create(model=server.model, input="Another?", instructions=LONG,
                                  previous_response_id=r1.id, **KW)
        assert r2.usage.input_tokens_details.cached_tokens >= _on_disk(_history(r1))
        api.close()
