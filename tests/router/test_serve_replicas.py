"""``radixlm serve --replicas 2 --auth-dir`` end to end: CurveZMQ tenants at the router
stay themselves on every replica (a hot pin is on both, and still only its tenant's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from radixlm.runtime.protocol import (
    Error,
    Generate,
    Input,
    ListSessions,
    OpenSession,
    Pin,
    Pinned,
    SessionList,
    SessionOpened,
    StatsReply,
)

from tests.frontend.test_tenant_isolation import cached, client
from tests.transport.test_curve_auth import make_keys, serve

SECRET = "The vault code is 7731 and the backup code is 4410. " * 3


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("replicas")
    auth = tmp / "auth"
    make_keys(auth, "alice", "bob")
    with serve(tmp, tiny_model_dir, "--replicas", "2", "--auth-dir", str(auth), "--endpoint",
               "tcp://127.0.0.1:0", "--no-http", "--hot-pin-uses", "2") as (endpoint, _):
        yield endpoint, auth


def test_tenants_are_the_same_on_every_replica(routed: tuple[str, Path]) -> None:
    with client(routed, "alice") as alice, client(routed, "bob") as bob:
        stats = alice.stats()
        assert isinstance(stats, StatsReply) and stats.capacity == 2 * 1024  # both replicas
        assert isinstance(alice.call(Pin(rid="p", name="vault", input=Input(text=SECRET))), Pinned)
        sessions = []
        for i in range(3):  # from the 2nd use on, the pin is hot: on both replicas
            opened = alice.call(OpenSession(rid=f"o{i}", pinned="vault"))
            assert isinstance(opened, SessionOpened)
            sessions.append(opened.session)
        # alice finds her prompt cached whichever replica a request goes to...
        assert all(cached(alice, SECRET + f" question {i}") > 0 for i in range(4))
        # ...bob never does, on either (each probe in a namespace of its own, so his own
        # probes cannot hit each other), and sees none of her sessions or pins
        assert all(cached(bob, SECRET + f" question {i}", f"probe{i}") == 0 for i in range(4))
        listing = bob.call(ListSessions(rid="l"))
        assert isinstance(listing, SessionList) and listing.sessions == []
        reply = bob.request(OpenSession(rid="o", pinned="vault"))
        assert isinstance(reply, Error) and reply.code == "not_found"
        reply = bob.request(Generate(rid="t", session=sessions[0], input=Input(text="hi")))
        assert isinstance(reply, Error) and reply.code == "not_found"
        # bob's own pin of the same name is his, beside hers
        assert isinstance(bob.call(Pin(rid="p", name="vault", input=Input(text="bob's"))), Pinned)
        mine = alice.call(ListSessions(rid="l"))
        assert isinstance(mine, SessionList)
        assert sorted(s.session for s in mine.sessions) == sorted(sessions)


def test_a_dead_replica_process_is_reaped_and_started_again(tmp_path: Path,
                                                            tiny_model_dir: Path) -> None:
    """``serve --replicas 2``: SIGKILL one replica's engine; it is reaped (no zombie is
    left under serve) and started again, and the router keeps serving throughout."""
    import os
    import signal
    import time

    from tests.conftest import child_cmdlines, start_test_server

    def engines(pid: int) -> list[int]:
        # the killed engine may vanish between the listing and its command line's read
        return [p for p, argv in child_cmdlines(pid).items()
                if b"radixlm.runtime.server.child" in argv and b"engine" in argv]

    with start_test_server(tmp_path, tiny_model_dir, "--replicas", "2") as server:
        before = engines(server.process.pid)
        assert len(before) == 2
        os.kill(before[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            now = engines(server.process.pid)
            if before[0] not in now and len(now) == 2:
                break
            assert time.monotonic() < deadline, now
            time.sleep(0.2)
        assert not Path(f"/proc/{before[0]}").exists()  # reaped, not a zombie
        from radixlm.runtime.transport.errors import EngineUnavailableError

        with server.client() as c:
            for i in range(4):  # spread over both replicas; the restarted one may still load
                while True:
                    try:
                        c.generate(Input(text=f"still serving {i}"), max_tokens=2,
                                   temperature=0.0)
                        break
                    except EngineUnavailableError as e:
                        assert time.monotonic() < deadline, e
                        time.sleep(0.2)
        assert "replica 0: the engine process was killed by signal 9" in server.log_path.read_text()
