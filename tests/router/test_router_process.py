"""The router (runtime/router) in front of two real replicas of the tiny model.

References are independent of the router: the same requests sent straight to one engine
(greedy, so the tokens must be identical), and the engines' own session listings.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ServerHandle, process_alive, start_test_server
from radixlm.runtime.protocol import (
    CloseSession,
    Done,
    Error,
    ForkSession,
    Generate,
    Input,
    ListSessions,
    Message,
    Ok,
    OpenSession,
    Pin,
    SamplingParams,
    SessionList,
    SessionOpened,
    SessionsForked,
    StatsReply,
    TruncateSession,
    Unpin,
)
from radixlm.runtime.transport.errors import EngineError
from radixlm.runtime.transport.raw_client import RawClient

START_S = 120.0


@contextlib.contextmanager
def start_router(workdir: Path, replicas: list[str], *flags: str) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    workdir.mkdir(parents=True, exist_ok=True)
    endpoint_file, log_path = workdir / "endpoint", workdir / "router.log"
    command = [sys.executable, "-m", "radixlm.runtime.cli", "router", "--endpoint-file",
               str(endpoint_file), "--replica-timeout", "3", *flags]
    for r in replicas:
        command += ["--replica", r]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while not endpoint_file.exists():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        yield endpoint_file.read_text().strip(), proc, log_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _replica(tmp: Path, name: str, model: Path) -> contextlib.AbstractContextManager[ServerHandle]:
    return start_test_server(tmp / name, model, "--endpoint", f"ipc://{tmp}/{name}.sock")


@contextlib.contextmanager
def _replicas(tmp: Path, model: Path, *names: str) -> Iterator[list[ServerHandle]]:
    """Replicas started at once (each start is mostly imports: in parallel they take
    about one's time), all stopped on exit."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(names)) as pool:
        managers = [_replica(tmp, name, model) for name in names]
        futures = [pool.submit(m.__enter__) for m in managers]
        for m, f in zip(managers, futures, strict=True):
            with contextlib.suppress(BaseException):  # a failed one is raised below
                f.result()
                stack.push(m.__exit__)
        yield [f.result() for f in futures]


@contextlib.contextmanager
def cluster(tmp: Path, model: Path) -> Iterator[tuple[ServerHandle, ServerHandle, str, Path]]:
    """Two replicas and a router in front of them, once it sees both."""
    with (_replicas(tmp, model, "a", "b") as (a, b),
          start_router(tmp / "router", [a.endpoint, b.endpoint]) as (endpoint, _, log)):
        with RawClient(endpoint) as probe:
            _wait_capacity(probe, a.welcome.kv_capacity + b.welcome.kv_capacity)
        yield a, b, endpoint, log


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[tuple[ServerHandle, ServerHandle, str]]:
    with cluster(tmp_path_factory.mktemp("rt"), tiny_model_dir) as (a, b, endpoint, _):
        yield a, b, endpoint


def _wait_capacity(client: RawClient, expected: int, log: Path | None = None) -> None:
    """Until the router's stats cover `expected` KV tokens (the replicas it sees up);
    a failure shows the router's log, which says what it saw of its replicas."""
    deadline = time.monotonic() + 60
    said = (lambda: log.read_text()) if log is not None else (lambda: "")
    while True:
        try:
            got = client.stats().capacity
        except EngineError as e:
            raise AssertionError(f"{e}\n{said()}") from e
        if got == expected:
            return
        assert time.monotonic() < deadline, f"router capacity {got}, expected {expected}\n{said()}"
        time.sleep(0.2)


def _turn(client: RawClient, session: str | None, content: str, **kw: object) -> Done:
    return client.generate(Input(messages=[Message(role="user", content=content)]),
                           session=session, max_tokens=6, temperature=0, **kw)


def _conversation(client: RawClient, contents: list[str], pinned: str | None = None) -> tuple[str, list[Done]]:
    opened = client.call(OpenSession(rid=client.new_rid(), pinned=pinned))
    assert isinstance(opened, SessionOpened), opened
    return opened.session, [_turn(client, opened.session, c) for c in contents]


def _all_sessions(handle: ServerHandle) -> int:
    """Sessions the engine holds (every client's)."""
    with handle.client() as c:
        reply = c.call(ListSessions(rid="l", all=True))
        assert isinstance(reply, SessionList)
        return len(reply.sessions)


def test_session_turns_fork_and_pin_match_one_engine(pair: tuple[ServerHandle, ServerHandle, str]) -> None:
    a, _, endpoint = pair
    contents = ["Name a colour.", "And another?", "Why?"]
    with RawClient(endpoint) as via, a.client() as direct:
        sid, turns = _conversation(via, contents)
        ref_sid, ref = _conversation(direct, contents)
        assert [t.token_ids for t in turns] == [t.token_ids for t in ref]
        assert [t.session_length for t in turns] == [t.session_length for t in ref]
        # each turn finds its whole history cached (the reference may find more: it ran
        # after the routed conversation, which may have been on the same engine)
        for before, turn in zip(turns, turns[1:], strict=False):
            assert turn.usage.cached_tokens >= before.session_length
        assert all(t.session == sid for t in turns)
        # a fork stays with its parent and continues its history
        forked = via.call(ForkSession(rid="f", session=sid))
        ref_forked = direct.call(ForkSession(rid="f", session=ref_sid))
        assert isinstance(forked, SessionsForked) and isinstance(ref_forked, SessionsForked)
        got = _turn(via, forked.sessions[0], "Now a fruit.")
        want = _turn(direct, ref_forked.sessions[0], "Now a fruit.")
        assert got.token_ids == want.token_ids
        assert got.usage.cached_tokens >= turns[-1].session_length
        # truncate, then a turn on the cut history
        assert isinstance(via.call(TruncateSession(rid="t", session=sid, length=10)), Ok)
        direct.call(TruncateSession(rid="t", session=ref_sid, length=10))
        assert _turn(via, sid, "Again.").token_ids == _turn(direct, ref_sid, "Again.").token_ids
        # a pin, and a session from it
        system = [Message(role="system", content="You are a terse assistant. " * 8)]
        pinned = via.call(Pin(rid="p", name="sys", input=Input(messages=system,
                                                                 add_generation_prompt=False)))
        ref_pinned = direct.call(Pin(rid="p", name="sys-ref", input=Input(
            messages=system, add_generation_prompt=False)))
        assert not isinstance(pinned, Error), pinned
        assert pinned.length == ref_pinned.length  # type: ignore[union-attr]
        psid, pturns = _conversation(via, ["Hello."], pinned="sys")
        _, pref = _conversation(direct, ["Hello."], pinned="sys-ref")
        assert pturns[0].token_ids == pref[0].token_ids
        assert pturns[0].usage.cached_tokens >= ref_pinned.length  # type: ignore[union-attr]
        for s in (sid, psid, *forked.sessions):
            assert isinstance(via.call(CloseSession(rid="c", session=s)), Ok)
        assert isinstance(via.call(Unpin(rid="u", name="sys")), Ok)
        direct.call(Unpin(rid="u", name="sys-ref"))
        direct.call(CloseSession(rid="c", sessions=[ref_sid, *ref_forked.sessions]))


def test_stats_and_listings_cover_both_replicas(pair: tuple[ServerHandle, ServerHandle, str]) -> None:
    a, b, endpoint = pair
    with RawClient(endpoint) as via, a.client() as ca, b.client() as cb:
        opened = [via.call(OpenSession(rid=f"o{i}", input=Input(text=f"agent {i} " * (i + 3))))
                  for i in range(6)]
        sids = [o.session for o in opened if isinstance(o, SessionOpened)]
        assert len(sids) == 6
        listed = {s.session for s in via.list_sessions()}
        assert listed == set(sids)
        stats = via.stats()
        direct = [ca.stats(), cb.stats()]
        assert isinstance(stats, StatsReply)
        assert stats.capacity == sum(s.capacity for s in direct)
        assert stats.sessions == sum(s.sessions for s in direct) >= 6
        via.call(CloseSession(rid="c", sessions=sids))
        assert via.list_sessions() == []


def test_concurrent_sessions_of_two_clients_never_cross(pair: tuple[ServerHandle, ServerHandle, str]) -> None:
    a, b, endpoint = pair
    greedy = SamplingParams(max_tokens=6, temperature=0)
    ask = Input(messages=[Message(role="user", content="Go on.")])
    with RawClient(endpoint) as c1, RawClient(endpoint) as c2, a.client() as ref:
        sessions: dict[tuple[str, int], tuple[RawClient, str]] = {}
        for client, name in ((c1, "x"), (c2, "y")):
            for i in range(4):
                opened = client.call(OpenSession(rid=client.new_rid(), input=Input(
                    text=f"{name}{i} " * (4 + i))))
                assert isinstance(opened, SessionOpened)
                sessions[(name, i)] = (client, opened.session)
        assert len({sid for _, sid in sessions.values()}) == 8
        assert _all_sessions(a) >= 1 and _all_sessions(b) >= 1  # spread over both
        rids = {}
        for key, (client, sid) in sessions.items():  # every turn in flight at once
            rids[key] = client.new_rid("t")
            client.send(Generate(rid=rids[key], session=sid, input=ask, sampling=greedy))
        for (name, i), (client, sid) in sessions.items():
            done = client.recv_for(rids[(name, i)])
            assert isinstance(done, Done) and done.session == sid
            opened = ref.call(OpenSession(rid="o", input=Input(text=f"{name}{i} " * (4 + i))))
            assert isinstance(opened, SessionOpened)
            want = ref.generate(ask, session=opened.session, max_tokens=6, temperature=0)
            assert (done.token_ids, done.session_length) == (want.token_ids, want.session_length)
            ref.call(CloseSession(rid="c", session=opened.session))
        other = c2.request(Generate(rid="z", session=sessions[("x", 0)][1], input=ask))
        assert isinstance(other, Error) and other.code == "not_found"
        for client, sid in sessions.values():
            client.call(CloseSession(rid="c", session=sid))


def test_unknown_session_and_bad_frames_get_the_engines_errors(pair: tuple[ServerHandle, ServerHandle, str]) -> None:
    a, _, endpoint = pair
    with RawClient(endpoint) as via, a.client() as direct:
        for client in (via, direct):
            reply = client.request(ForkSession(rid="x", session="0" * 32))
            assert isinstance(reply, Error) and reply.code == "not_found"
        via.send_raw(b"\xc1\xc1\xc1")
        reply = via.recv(10)
        assert isinstance(reply, Error) and reply.code == "bad_message" and reply.rid is None
        assert _turn(via, None, "still serving").finish_reason in ("stop", "length")


def _kill(handle: ServerHandle) -> None:
    for pid in [handle.pid, *handle.child_pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    handle.process.wait()
    deadline = time.monotonic() + 10
    while any(process_alive(p) for p in handle.child_pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_sigkill_of_a_replica_loses_no_conversation(tmp_path: Path, tiny_model_dir: Path) -> None:
    contents = ["Name a colour.", "And another?", "Why?", "Tell me more."]
    with cluster(tmp_path, tiny_model_dir) as (a, b, endpoint, log):
        with RawClient(endpoint) as via, RawClient(endpoint) as other:
            # sessions on both replicas: agents with distinct openings
            convs = []
            for i in range(4):
                opened = via.call(OpenSession(rid=f"o{i}", input=Input(text=f"agent {i}: " * 8)))
                assert isinstance(opened, SessionOpened)
                convs.append((opened.session, [_turn(via, opened.session, contents[0])]))
            forked = via.call(ForkSession(rid="f", session=convs[0][0]))
            assert isinstance(forked, SessionsForked)
            homes = [_all_sessions(a), _all_sessions(b)]
            assert min(homes) >= 1, homes  # both replicas hold sessions
            victim = a if homes[0] >= homes[1] else b
            _kill(victim)
            # every conversation continues, and its next turn says what was recomputed
            for sid, turns in convs:
                done = _turn(via, sid, contents[1])
                assert isinstance(done, Done)
                turns.append(done)
            recomputed = [t[-1].usage.recomputed_tokens for _, t in convs]
            assert any(r > 0 for r in recomputed), (recomputed, log.read_text())
            for (_, turns), r in zip(convs, recomputed, strict=True):
                if r:  # the history was computed again, less what the target had cached
                    assert 0 < r <= turns[-2].session_length
                    assert turns[-1].usage.cached_tokens + r == turns[-2].session_length
            fork_turn = _turn(via, forked.sessions[0], contents[2])
            assert fork_turn.usage.prompt_tokens > convs[0][1][0].session_length
            assert _turn(other, None, "a new client").finish_reason in ("stop", "length")
        # the histories are exactly what one engine makes of the same conversation
        survivor = b if victim is a else a
        with survivor.client() as ref:
            for i, (_, turns) in enumerate(convs):
                opened = ref.call(OpenSession(rid="o", input=Input(text=f"agent {i}: " * 8)))
                assert isinstance(opened, SessionOpened)
                want = [_turn(ref, opened.session, c) for c in contents[:2]]
                assert [t.token_ids for t in turns] == [t.token_ids for t in want]
                assert [t.session_length for t in turns] == [t.session_length for t in want]


def test_a_replica_that_comes_back_rejoins(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Killed, then started again at the same endpoint: while it is out and while it
    rejoins, every request is answered (by the other); once back, it gets work again."""
    with _replicas(tmp_path, tiny_model_dir, "a", "b") as (a, b):
        restarted: list[contextlib.AbstractContextManager[ServerHandle]] = []
        try:
            with (start_router(tmp_path / "router", [a.endpoint, b.endpoint]) as (endpoint, _, log),
                  RawClient(endpoint) as via):
                one = a.welcome.kv_capacity
                _wait_capacity(via, 2 * one, log)
                _kill(b)
                _wait_capacity(via, one, log)  # taken out
                (tmp_path / "b" / "endpoint").unlink(missing_ok=True)  # SIGKILL left it
                restarted.append(_replica(tmp_path, "b", tiny_model_dir))  # the same endpoint
                with ThreadPoolExecutor(1) as pool:
                    back = pool.submit(restarted[0].__enter__)
                    answered = 0
                    # requests meanwhile: each answered (a RawClient call waits 60 s at most)
                    while not back.done() or answered < 3:
                        assert _turn(via, None, f"meanwhile {answered}").finish_reason in (
                            "stop", "length")
                        assert via.stats().capacity in (one, 2 * one)
                        answered += 1
                    b2 = back.result()
                _wait_capacity(via, 2 * one)  # back
                # it gets work again: new sessions spread over both
                sids = [via.call(OpenSession(rid=f"o{i}", input=Input(text=f"agent {i}: " * 8)))
                        for i in range(6)]
                assert _all_sessions(b2) >= 1, log.read_text()
                via.call(CloseSession(rid="c", sessions=[s.session for s in sids
                                                          if isinstance(s, SessionOpened)]))
        finally:
            for m in restarted:
                m.__exit__(None, None, None)


def test_a_replica_lost_during_a_stats_fan_out_leaves_the_others_replies(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A stats fan-out waiting on both replicas when one dies: the survivor's reply, still
    to come, is merged (the router once dropped it, and answered 'no replica is up')."""
    with cluster(tmp_path, tiny_model_dir) as (a, b, endpoint, log), RawClient(endpoint) as via:
        one = a.welcome.kv_capacity
        a_pids = [a.pid, *a.child_pids]
        for pid in [*a_pids, b.pid, *b.child_pids]:  # neither answers: the fan-out waits on both
            os.kill(pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(via.stats)
                time.sleep(0.3)
                _kill(b)
                deadline = time.monotonic() + 2  # well inside the 3 s replica timeout
                while "replica 1" not in log.read_text() or "is down" not in log.read_text():
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.02)
                for pid in a_pids:
                    os.kill(pid, signal.SIGCONT)
                a_pids = []
                assert pending.result(30).capacity == one, log.read_text()
        finally:
            for pid in a_pids:
                os.kill(pid, signal.SIGCONT)
