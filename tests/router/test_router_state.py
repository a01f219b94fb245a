"""A restarted router keeps its durable sessions (runtime/router/durable.py): their homes
and their logs are in its state directory. Two replicas with state directories of their
own (they keep the sessions themselves while the router is away), the tiny model.

After a clean restart and after a SIGKILL of the router, a new client resumes every
durable session by id: each is on the replica it was on (its whole history cached there,
nothing recomputed), while a session that was not durable is gone. Then a replica is
SIGKILLed: its sessions are rebuilt on the other one from the logs the router read back,
and every conversation's tokens are exactly what one engine makes of it (the reference:
the same conversation run straight on the surviving replica).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import ServerHandle
from radixlm.runtime.protocol import (
    Error,
    ForkSession,
    Input,
    ListSessions,
    OpenSession,
    ResumeSession,
    SessionList,
    SessionOpened,
    SessionsForked,
)
from radixlm.runtime.transport.raw_client import RawClient

from tests.router.test_router_process import (
    _kill,
    _replicas,
    _turn,
    _wait_capacity,
    start_router,
)

pytestmark = pytest.mark.timeout(300)

CONTENTS = ["Name a colour.", "And another?", "Why?"]


def _inner_sessions(handle: ServerHandle) -> set[str]:
    """The sessions `handle` holds, every client's (by 8-hex prefix, as it lists them)."""
    with handle.client() as c:
        reply = c.call(ListSessions(rid="l", all=True))
        assert isinstance(reply, SessionList)
        return {s.session[:8] for s in reply.sessions}


def _homes(replicas: list[ServerHandle]) -> dict[str, int]:
    """Session id prefix -> the index of the replica holding it."""
    return {sid: i for i, h in enumerate(replicas) for sid in _inner_sessions(h)}


def _resume(client: RawClient, session: str) -> SessionOpened:
    reply = client.call(ResumeSession(rid=client.new_rid("r"), session=session))
    assert isinstance(reply, SessionOpened), reply
    return reply


@pytest.mark.parametrize("how", ["restart", "sigkill"])
def test_a_restarted_router_keeps_its_durable_sessions(tmp_path: Path, tiny_model_dir: Path,
                                                       how: str) -> None:
    state = ("--state-dir", str(tmp_path / "router-state"))
    with _replicas(tmp_path, tiny_model_dir, "a", "b", state=True) as (a, b):
        replicas = [a.endpoint, b.endpoint]
        capacity = a.welcome.kv_capacity + b.welcome.kv_capacity
        with start_router(tmp_path / "r1", replicas, *state) as (endpoint, proc, _), \
                RawClient(endpoint) as c:
            _wait_capacity(c, capacity)
            convs: list[tuple[str, list]] = []
            for i in range(4):  # distinct openings: spread over both replicas
                opened = c.call(OpenSession(rid=c.new_rid(), input=Input(text=f"agent {i}: " * 8),
                                            durable=True))
                assert isinstance(opened, SessionOpened) and opened.durable, opened
                convs.append((opened.session, [_turn(c, opened.session, CONTENTS[0])]))
            forked = c.call(ForkSession(rid="f", session=convs[0][0]))
            assert isinstance(forked, SessionsForked)
            plain = c.call(OpenSession(rid="p", input=Input(text="not durable " * 4)))
            assert isinstance(plain, SessionOpened) and not plain.durable
            homes = _homes([a, b])
            assert {homes[sid[:8]] for sid, _ in convs} == {0, 1}, homes  # both replicas
            time.sleep(0.5)  # the router writes its rows in the background
            if how == "sigkill":
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert list((tmp_path / "router-state" / "router").glob("*/router.sqlite"))
        with start_router(tmp_path / "r2", replicas, *state) as (endpoint, _, log), \
                RawClient(endpoint) as c:
            _wait_capacity(c, capacity)
            gone = c.request(ResumeSession(rid="g", session=plain.session))
            assert isinstance(gone, Error) and gone.code == "not_found"
            for sid, turns in convs:
                assert _resume(c, sid).length == turns[-1].session_length
                done = _turn(c, sid, CONTENTS[1])
                # still on its replica: its whole history cached there, nothing recomputed
                assert done.usage.cached_tokens >= turns[-1].session_length, done.usage
                assert done.usage.recomputed_tokens == 0
                turns.append(done)
            del homes[plain.session[:8]]  # closed with its client's links
            assert _homes([a, b]) == homes
            # A replica dies: what it held is rebuilt on the other from the router's logs
            # (the fork is detached: rebuilt when it is resumed).
            victim = a if homes[convs[0][0][:8]] == 0 else b
            _kill(victim)
            for sid, turns in convs:
                turns.append(_turn(c, sid, CONTENTS[2]))
            moved = [t[-1].usage.recomputed_tokens for sid, t in convs
                     if homes[sid[:8]] == [a, b].index(victim)]
            assert moved and all(r > 0 for r in moved), (moved, log.read_text())
            back = _resume(c, forked.sessions[0])
            assert back.length == convs[0][1][0].session_length
            fork_turn = _turn(c, forked.sessions[0], "Now a fruit.")
        survivor = b if victim is a else a
        with survivor.client() as ref:  # one engine, the same conversations
            for i, (_, turns) in enumerate(convs):
                opened = ref.call(OpenSession(rid="o", input=Input(text=f"agent {i}: " * 8)))
                assert isinstance(opened, SessionOpened)
                want = [_turn(ref, opened.session, text) for text in CONTENTS]
                assert [t.token_ids for t in turns] == [t.token_ids for t in want]
                assert [t.session_length for t in turns] == [t.session_length for t in want]
                if i == 0:
                    again = ref.call(OpenSession(rid="o2", input=Input(text="agent 0: " * 8)))
                    assert isinstance(again, SessionOpened)
                    _turn(ref, again.session, CONTENTS[0])
                    assert _turn(ref, again.session, "Now a fruit.").token_ids == \
                        fork_turn.token_ids


def test_rows_round_trip_entry_by_entry_and_find_their_replicas(tmp_path: Path) -> None:
    """session_db.py alone: what is saved is read back as it was (a log written entry by
    entry), each session's replica found by endpoint, else by index, else left out; one
    router at a time per folder."""
    from radixlm.runtime.protocol import Message, Tool
    from radixlm.runtime.router.records import (
        Appended,
        Cut,
        Opened,
        PinRecord,
        Produced,
        SessionRecord,
    )
    from radixlm.runtime.router.session_db import open_router_db

    folder = str(tmp_path / "router")
    db = open_router_db(folder)
    assert db is not None
    assert open_router_db(folder) is None  # locked by the first
    log = [Opened(OpenSession(rid="o", durable=True, pinned="sys")),
           Appended(Input(messages=[Message(role="user", content="hi")]), [Tool(name="f")]),
           Produced([5, 6, 7])]
    record = SessionRecord("v1", b"client", "alice", 1, "inner1", 40, "key", list(log),
                           durable=True)
    db.save(record, "ipc://b")
    assert record.saved == 3
    record.log += [Cut(20), Produced([8])]
    record.length = 21
    db.save(record, "ipc://b")
    db.save_pin(PinRecord("sys", "alice", Input(text="system"), None, "pkey", 12))
    db.save_pin(PinRecord("gone", None, Input(text="x"), None, "k", 1))
    db.delete_pin(None, "gone")
    db.close()
    db = open_router_db(folder)
    assert db is not None
    for endpoints, home in ((["ipc://a", "ipc://b"], 1), (["ipc://b", "ipc://a"], 0),
                            (["ipc://x", "ipc://y"], 1), (["ipc://x"], None)):
        loaded = db.load(endpoints)
        if home is None:
            assert loaded.sessions == []
            continue
        (back,) = loaded.sessions
        assert (back.vid, back.tenant, back.home, back.inner, back.length) == (
            "v1", "alice", home, "inner1", 21)
        assert back.log == record.log and back.durable and back.owner == b""
        (pin,) = loaded.pins
        assert (pin.name, pin.tenant, pin.msg_input, pin.length) == (
            "sys", "alice", Input(text="system"), 12)
    db.delete("v1")
    db.close()
    db = open_router_db(folder)
    assert db is not None and db.load(["ipc://b"]).sessions == []
    db.close()


def test_serve_replicas_keeps_the_http_apis_objects_across_a_restart(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """``serve --replicas 2`` with a state directory: each replica's own, the router's and
    its HTTP API's; a stored response continues after a restart of the whole server,
    its session resumed through the router (at its home: its history cached)."""
    from http_helpers import free_port

    from tests.conftest import start_test_server

    state = tmp_path / "state"
    port = free_port()
    flags = ("--replicas", "2", "--http", f"127.0.0.1:{port}", "--state-dir", str(state))
    import openai

    def api() -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                             max_retries=0)

    kw = dict(model=tiny_model_dir.name, max_output_tokens=6, temperature=0)
    with start_test_server(tmp_path / "one", tiny_model_dir, *flags):
        r1 = api().responses.create(input="Name a colour.", instructions="Be brief. " * 20,
                                    **kw)
    assert sorted(p.name for p in state.iterdir()) == ["replicas", "router"]
    assert list(state.glob("router/serve/router.sqlite"))
    assert list(state.glob("router/serve/models/*/http.sqlite"))
    with start_test_server(tmp_path / "two", tiny_model_dir, *flags):
        r2 = api().responses.create(input="Why?", instructions="Be brief. " * 20,
                                    previous_response_id=r1.id, **kw)
        assert r2.usage.input_tokens_details.cached_tokens >= \
            (r1.usage.input_tokens + r1.usage.output_tokens) // 64 * 64, r2.usage
