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
from radixlm.runtime.engine.sessions.disk_backup import BLOCK_TOKENS as BLOCK
from radixlm.runtime.protocol import (
    CloseSession,
    Done,
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

SYSTEM = ("You are a terse assistant for a team that maintains a radix tree of cached "
          "attention keys and values. " * 2)  # two disk blocks of history (64 tokens each)
FIRST = [Message(role="system", content=SYSTEM),
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


def detached_listing(c: RawClient, session: str, timeout_s: float = 20.0) -> dict:
    """`c`'s listing once it shows `session` detached (its client's disconnect reaches the
    engine within the frontend's liveness checks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = {s.session: s for s in c.list_sessions()}
        if session in listed and not listed[session].attached:
            return listed
        assert time.monotonic() < deadline, listed
        time.sleep(0.05)


def check_second_turn(c: RawClient, hf_tok: Any, session: str, first_reply: list[int],
                      history_len: int, max_tokens: int = 1) -> Done:
    """The next turn's prompt is exactly the conversation so far plus SECOND; returns its
    `done`."""
    nxt = c.generate(Input(messages=[SECOND]), session=session, max_tokens=max_tokens,
                     temperature=0.0, ignore_eos=True)
    expected = expected_prompt(hf_tok, FIRST, first_reply, SECOND)
    assert nxt.usage.prompt_tokens == len(expected)
    probe = c.generate(Input(input_ids=[*expected, 5]), max_tokens=1, temperature=0.0,
                       ignore_eos=True)
    assert probe.usage.cached_tokens == len(expected)  # only that prompt put it there
    assert nxt.session_length == len(expected) + max_tokens
    assert history_len <= len(expected)
    return nxt


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
        with server.client() as b:  # a's connection is gone (the frontend notices soon)
            listed = detached_listing(b, session)
            assert listed[session].durable
            assert plain.session not in listed  # closed with its connection
            gone = b.request(ResumeSession(rid="r0", session=plain.session))
            assert isinstance(gone, Error) and gone.code == ErrorCode.NOT_FOUND
            back = resume(b, session)
            assert back.length == done.session_length and back.durable
            nxt = check_second_turn(b, hf_tok, session, done.token_ids, back.length)
            assert nxt.usage.cached_tokens == done.session_length  # still held: no recompute
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
        nxt = check_second_turn(c, hf_tok, session, done.token_ids, back.length)
        # Its KV came back from the disk tier: only the tail past the last whole block
        # and the new message are computed.
        on_disk = back.length // BLOCK * BLOCK
        assert on_disk >= 2 * BLOCK
        assert nxt.usage.cached_tokens >= on_disk, nxt.usage
        assert nxt.usage.restored_tokens >= on_disk - BLOCK, nxt.usage
        assert nxt.usage.recomputed_tokens == back.length - nxt.usage.cached_tokens
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


def test_a_corrupt_block_is_recomputed_and_the_output_is_unchanged(
        tmp_path: Path, tiny_model_dir: Path, hf_tok: Any) -> None:
    """A flipped byte in one block on disk: the block fails its checksum, is recomputed,
    and the next turn's output is the same as on a server that never restarted."""
    with start_test_server(tmp_path / "ref", tiny_model_dir, "--page-size", "1") as server, \
            server.client() as c:  # the server that never restarts
        opened = c.call(OpenSession(rid="o"))
        assert isinstance(opened, SessionOpened)
        done = c.generate(Input(messages=FIRST), session=opened.session, **SAMPLING)
        reference = check_second_turn(c, hf_tok, opened.session, done.token_ids,
                                      done.session_length, max_tokens=16)
    state = tmp_path / "state"
    with start_test_server(tmp_path / "one", tiny_model_dir, "--state-dir", str(state),
                           "--page-size", "1") as server, server.client() as c:
        session = open_durable(c)
        first = c.generate(Input(messages=FIRST), session=session, **SAMPLING)
        assert first.token_ids == done.token_ids
        time.sleep(0.5)  # the blocks are written in the background
    blocks = sorted(state.glob("models/*/kv/*/*.kv"))
    assert len(blocks) >= 2, blocks
    victim = blocks[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    with start_test_server(tmp_path / "two", tiny_model_dir, "--state-dir", str(state),
                           "--page-size", "1") as server, server.client() as c:
        resume(c, session)
        again = check_second_turn(c, hf_tok, session, first.token_ids, first.session_length,
                                  max_tokens=16)
        assert again.token_ids == reference.token_ids
        assert again.usage.recomputed_tokens > 0, again.usage  # the damaged block and after it
        assert again.usage.restored_tokens < len(blocks) * BLOCK, again.usage
        time.sleep(0.5)  # the recomputed block was written again, whole this time
        assert victim.read_bytes() != bytes(data)
        c.call(CloseSession(rid="c", session=session))
        assert_pool_clean(c)
    log = (tmp_path / "two" / "server.log").read_text()
    assert log.count("failed its checks") == 1  # said, once
