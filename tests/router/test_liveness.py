"""The router's replica liveness against fake replicas (a ZeroMQ ROUTER in a thread that
speaks just enough of the protocol), so the timing cases are exact and need no model:

- a fan-out (stats) never waits past ``--replica-timeout`` on a replica whose control
  connection answers but whose link does not: the client gets the others' merged reply;
- a replica that welcomes but whose engine does not answer yet (starting, rejoining) is
  not up: stats answer at once without it, and it joins once it answers.

The reference is what each fake replica was told to hold (its capacity).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    GetStats,
    Hello,
    StatsReply,
    Welcome,
    decode_client,
    encode,
)
from radixlm.runtime.transport.raw_client import RawClient

from tests.router.test_router_process import start_router


def _stats(rid: str, capacity: int) -> StatsReply:
    return StatsReply(rid=rid, capacity=capacity, free=capacity, evictable=0, protected=0,
                      private=0, retained_tokens={}, retained_cap=0, host_capacity=0,
                      host_used=0, sessions=0, pins=0, running=0, waiting=0,
                      prompt_tokens_total=0, cached_tokens_total=0, hit_rate=0.0,
                      invariant_ok=True, generated_tokens_total=0, retractions=0,
                      fair_preemptions=0, capped_steps=0, finish_reasons={}, latency={})


class FakeReplica:
    """Welcomes every connection; answers `stats` with `capacity` while `serving`
    (requests that came meanwhile are answered once it serves), and on the router's
    links (not its control connection) only if `links_answer`."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.endpoint = f"ipc://{path}"
        self.capacity = capacity
        self.serving = threading.Event()
        self.serving.set()
        self.links_answer = True
        self.link_stats = 0  # stats requests seen on links
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeReplica:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        self._ready.set()
        names: dict[bytes, str] = {}
        held: list[tuple[bytes, str]] = []
        welcome = Welcome(protocol_version=PROTOCOL_VERSION, server_version="fake",
                          model="fake", context_length=4096, page_size=16,
                          kv_capacity=self.capacity)
        try:
            while not self._stop.is_set():
                if self.serving.is_set():
                    for ident, rid in held:
                        sock.send_multipart([ident, encode(_stats(rid, self.capacity))])
                    held.clear()
                if not sock.poll(20):
                    continue
                ident, data = sock.recv_multipart()
                msg = decode_client(data)
                if isinstance(msg, Hello):
                    names[ident] = msg.client_name
                    sock.send_multipart([ident, encode(welcome)])
                elif isinstance(msg, GetStats):
                    link = names.get(ident) != "radixlm-router"
                    self.link_stats += link
                    if link and not self.links_answer:
                        continue
                    if self.serving.is_set():
                        sock.send_multipart([ident, encode(_stats(msg.rid, self.capacity))])
                    else:
                        held.append((ident, msg.rid))
        finally:
            sock.close(0)
            ctx.term()


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[tuple[FakeReplica, FakeReplica]]:
    with FakeReplica(tmp_path / "a.sock", 100) as a, FakeReplica(tmp_path / "b.sock", 10) as b:
        yield a, b


def _capacity_soon(client: RawClient, expected: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while (got := client.stats().capacity) != expected:
        assert time.monotonic() < deadline, f"capacity {got}, expected {expected}"
        time.sleep(0.1)


def test_a_fan_out_never_waits_past_the_timeout_on_a_silent_link(
        tmp_path: Path, fakes: tuple[FakeReplica, FakeReplica]) -> None:
    a, b = fakes
    with (start_router(tmp_path / "router", [a.endpoint, b.endpoint], "--replica-timeout", "2")
          as (endpoint, _, log), RawClient(endpoint, timeout_s=20) as via):
        _capacity_soon(via, 110, 20)
        b.links_answer = False  # its control connection still answers: it stays up
        start = time.monotonic()
        stats = via.stats()  # the old router waited for b forever here
        took = time.monotonic() - start
        assert stats.capacity == 100, stats  # b's part left out
        assert 1.5 < took < 10, took
        assert "did not answer a fan-out" in log.read_text()
        b.links_answer = True
        _capacity_soon(via, 110, 10)  # b's next answer counts again


def test_a_replica_joins_only_once_its_engine_answers(
        tmp_path: Path, fakes: tuple[FakeReplica, FakeReplica]) -> None:
    a, b = fakes
    b.serving.clear()  # b welcomes, but its engine is not answering yet
    with (start_router(tmp_path / "router", [a.endpoint, b.endpoint], "--replica-timeout", "2")
          as (endpoint, _, _), RawClient(endpoint, timeout_s=20) as via):
        for _ in range(5):  # answered at once, b not asked
            start = time.monotonic()
            assert via.stats().capacity == 100
            assert time.monotonic() - start < 1.5
        assert b.link_stats == 0
        b.serving.set()
        _capacity_soon(via, 110, 10)
