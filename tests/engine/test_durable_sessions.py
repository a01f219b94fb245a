"""Durable sessions end to end (a server with a state directory, the tiny model): a
durable session outlives its connection and is resumed by id from another one; it and
every pin outlive a clean restart and a SIGKILL of the whole server; the history after a
resume is token-exact (transformers' `apply_chat_template` of the whole conversation);
non-durable sessions end with their connection; nobody resumes an unknown id; a server
without state says so (`Welcome.state`) and grants no durability."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import transformers
from radixlm.runtime.protocol import (
    CloseSession,
    Error,
    ErrorCode,
    Input,
    Message,
    OpenSession,
    Pin,
    Pinned,
    ResumeSession,
    SessionOpened,
)
from radixlm.runtime.transport.raw_client import RawClient

from tests.conftest import assert_pool_clean, start_test_server
from tests.engine.test_turn_endings import expected_prompt

FIRST = [Message(role="system", content="You are terse."),
         Message(role="user", content="Name a colour.")]
SECOND = Message(role="user", content="And another one?")
SAMPLING: dict[str, Any] = dict(temperature=0.0, ignore_eos=True, max_tokens=12)


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))


def open_durable(c: RawClient) -> str:
    opened = c.call(OpenSession(rid=c.new_rid("open"), durable=True))
    assert isinstance(opened, SessionOpened) and opened.durable, opened
    return opened.session


def resume(c: RawClient, session: str) -> SessionOpened:
    reply = c.call(ResumeSession(rid=c.new_rid("resume"), session=session))
    assert isinstance(reply, SessionOpened), reply
    return reply


def check_second_turn(c: RawClient, hf_tok: Any, session: str, first_reply: list[int],
                      history_len: int) -> int:
    """The next turn's prompt is exactly the conversation so far plus SECOND; returns how
    many of its tokens were cached."""
    nxt = c.generate(Input(messages=[SECOND]), session=session, max_tokens=1, temperature=0.0,
                     ignore_eos=True)
    expected = expected_prompt(hf_tok, FIRST, first_reply, SECOND)
    assert nxt.usage.prompt_tokens == len(expected)
    probe = c.generate(Input(input_ids=[*expected, 5]), max_tokens=1, temperature=0.0,
                       ignore_eos=True)
    assert probe.usage.cached_tokens == len(expected)  # only that prompt put it there
    assert nxt.session_length == len(expected) + 1
    assert history_len <= len(expected)
    return nxt.usage.cached_tokens


def test_a_durable_session_outlives_its_connection(tmp_path: Path, tiny_model_dir: Path,
                                                  hf_tok: Any) -> None:
    with start_test_server(tmp_path, tiny_model_dir, "--state-dir", str(tmp_path / "state"),
                           "--page-size", "1") as server:
        assert server.welcome.state  # a fingerprint: this server keeps state
        with server.client() as a:
            session = open_durable(a)
            plain = a.call(OpenSession(rid="plain"))
            assert isinstance(plain, SessionOpened) and not plain.durable
            done = a.generate(Input(messages=FIRST), session=session, **SAMPLING)
        with server.client() as b:  # a's connection is gone
            listed = {s.session: s for s in b.list_sessions()}
            assert session in listed and not listed[session].attached and listed[session].durable
            assert plain.session not in listed  # closed with its connection
            gone = b.request(ResumeSession(rid="r0", session=plain.session))
            assert isinstance(gone, Error) and gone.code == ErrorCode.NOT_FOUND
            back = resume(b, session)
            assert back.length == done.session_length and back.durable
            cached = check_second_turn(b, hf_tok, session, done.token_ids, back.length)
            assert cached == done.session_length  # still held: nothing recomputed
            b.call(CloseSession(rid="c", session=session))
            assert session not in {s.session for s in b.list_sessions()}
            assert_pool_clean(b)


@pytest.mark.parametrize("how", ["restart", "sigkill"])
def test_durable_sessions_and_pins_outlive_the_server(tmp_path: Path, tiny_model_dir: Path,
                                                      hf_tok: Any, how: str) -> None:
    state = tmp_path / "state"
    pin_ids = list(range(40, 90))
    with start_test_server(tmp_path / "one", tiny_model_dir, "--state-dir", str(state),
                           "--page-size", "1") as server:
        with server.client() as c:
            session = open_durable(c)
            done = c.generate(Input(messages=FIRST), session=session, **SAMPLING)
            pinned = c.call(Pin(rid="pin", name="tools", input=Input(input_ids=pin_ids)))
            assert isinstance(pinned, Pinned)
        time.sleep(0.5)  # the turn's row is written in the background (not acknowledged)
        if how == "sigkill":  # every process of the server at once: nothing is cleaned up
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
    with start_test_server(tmp_path / "two", tiny_model_dir, "--state-dir", str(state),
                           "--page-size", "1") as server, server.client() as c:
        listed = {s.session: s for s in c.list_sessions()}
        assert session in listed and not listed[session].attached
        back = resume(c, session)
        assert back.length == done.session_length
        check_second_turn(c, hf_tok, session, done.token_ids, back.length)
        from_pin = c.call(OpenSession(rid="fp", pinned="tools"))
        assert isinstance(from_pin, SessionOpened) and from_pin.length == len(pin_ids)
        assert from_pin.cached_tokens == len(pin_ids)  # the pin holds its prefix again
        c.call(CloseSession(rid="c", sessions=[session, from_pin.session]))
        assert_pool_clean(c)


def test_without_state_nothing_is_durable(tmp_path: Path, tiny_model_dir: Path) -> None:
    with start_test_server(tmp_path, tiny_model_dir) as server, server.client() as c:
        assert server.welcome.state == ""
        opened = c.call(OpenSession(rid="o", durable=True))
        assert isinstance(opened, SessionOpened) and not opened.durable
        refused = c.request(ResumeSession(rid="r", session=opened.session))
        assert isinstance(refused, Error) and refused.code == ErrorCode.NOT_FOUND
        c.call(CloseSession(rid="c", session=opened.session))


def test_another_tenant_cannot_resume_list_or_hit_after_a_restart(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two CurveZMQ tenants; alice's durable session and pin, after a restart: bob can
    neither resume it, nor see it listed, nor hit its tokens in the cache."""
    from tests.frontend.test_tenant_isolation import cached, client
    from tests.transport.test_curve_auth import make_keys, serve

    auth = tmp_path / "auth"
    make_keys(auth, "alice", "bob")
    flags = ("--auth-dir", str(auth), "--endpoint", "tcp://127.0.0.1:0",
             "--state-dir", str(tmp_path / "state"), "--page-size", "1")
    secret = "The vault code is 4417 and the guard changes at nine."
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    with serve(tmp_path / "one", tiny_model_dir, *flags) as (endpoint, _), \
            client((endpoint, auth), "alice") as alice:
        session = open_durable(alice)
        alice.generate(Input(text=secret), session=session, max_tokens=1, temperature=0.0)
    with serve(tmp_path / "two", tiny_model_dir, *flags) as (endpoint, _):
        shared = (endpoint, auth)
        with client(shared, "bob") as bob:
            refused = bob.request(ResumeSession(rid="r", session=session))
            assert isinstance(refused, Error) and refused.code == ErrorCode.NOT_FOUND
            assert session not in {s.session for s in bob.list_sessions()}
            assert all(s.session[:8] != session[:8] for s in bob.list_sessions())
            assert cached(bob, secret) == 0
        with client(shared, "alice") as alice:
            assert session in {s.session for s in alice.list_sessions()}
            back = resume(alice, session)
            assert back.length > 0
            alice.call(CloseSession(rid="c", session=session))
