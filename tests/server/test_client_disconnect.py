"""Clients that vanish: mid-stream, and idle while holding a session.

Either way the frontend must tell the engine (`ClientGone`): the client's requests are
aborted, their private KV freed and its sessions closed. Evidence: the engine's own
counters through `stats` (no private KV, the invariant, the session count back to what it
was) from another client.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from radixlm.runtime.protocol import (
    Chunk,
    Generate,
    Input,
    OpenSession,
    SamplingParams,
    SessionOpened,
    StatsReply,
)
from radixlm.runtime.transport.raw_client import RawClient

pytestmark = pytest.mark.usefixtures("pool_integrity")


def wait_for(client: RawClient, done: Any, timeout_s: float = 30.0) -> StatsReply:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if done(stats):
            return stats
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {stats}"
        time.sleep(0.02)


def test_disconnect_mid_stream_aborts_and_frees(server: Any, check_pool: Any) -> None:
    with server.client() as observer:
        before = observer.stats()
        leaving = server.client()
        opened = leaving.call(OpenSession(rid="s", retention="hard"))
        assert isinstance(opened, SessionOpened)
        # Two long streams, one of them a session turn: far more tokens than arrive
        # before the client goes.
        leaving.send(Generate(rid="long", input=Input(text="Once upon a time"),
                              sampling=SamplingParams(max_tokens=220, ignore_eos=True),
                              stream=True))
        leaving.send(Generate(rid="turn", session=opened.session, input=Input(text="Hi"),
                              sampling=SamplingParams(max_tokens=220, ignore_eos=True),
                              stream=True))
        for rid in ("long", "turn"):
            assert isinstance(leaving.recv_for(rid), Chunk)
        busy = observer.stats()
        assert busy.running + busy.waiting >= 1 and busy.sessions == before.sessions + 1
        leaving.close()

        after = wait_for(observer, lambda s: s.running == 0 and s.waiting == 0
                         and s.sessions == before.sessions)
        assert after.private == 0 and after.invariant_ok
        check_pool(observer)
    assert "2 request(s) aborted" in server.log()


def test_idle_client_with_a_session_is_noticed(server: Any) -> None:
    """No request in flight, so no send can fail: the socket monitor must notice."""
    with server.client() as observer:
        before = observer.stats().sessions
        with server.client() as idle:
            for i in range(2):
                assert isinstance(idle.call(OpenSession(rid=f"s{i}", input=Input(text="Hi"))),
                                  SessionOpened)
            assert observer.stats().sessions == before + 2
        wait_for(observer, lambda s: s.sessions == before)
