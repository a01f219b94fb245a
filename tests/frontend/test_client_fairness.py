"""Fairness: admission goes round-robin over clients (a client's long queue cannot starve
another's request), a client's priority is clamped to the server's --max-priority, and a
client's in-flight generations are capped by --max-inflight-per-client."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq
from radixlm.runtime import protocol as wire
from radixlm.runtime.engine.policy import order_waiting

from tests.conftest import assert_pool_clean, start_test_server


def fake(client: bytes, arrival: int, priority: int = 0) -> SimpleNamespace:
    return SimpleNamespace(group=SimpleNamespace(client=client, priority=priority),
                           arrival=arrival, num_tokens=4)


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "shortest-prefill-first"])
def test_admission_is_round_robin_over_clients(policy: str) -> None:
    flood = [fake(b"a", t) for t in range(6)]
    late = fake(b"b", 100)
    urgent = fake(b"a", 200, priority=1)
    waiting = [*flood, late, urgent]
    order = order_waiting(policy, waiting, lambda r: (None, 0))  # type: ignore[arg-type]
    # Priority first; then every client's first request, then every client's second, ...
    assert order[:3] == [urgent, flood[0], late]
    assert order[3:] == flood[1:]


def test_fair_admission_priority_cap_and_inflight_cap(tmp_path: Path, tiny_model_dir: Path) -> None:
    flags = ("--max-running", "1", "--schedule-policy", "fcfs", "--max-inflight-per-client", "4",
             "--max-priority", "0")
    with start_test_server(tmp_path, tiny_model_dir, *flags) as server, \
            server.client() as a, server.client() as b:
        def gen(client, rid: str, tokens: int, priority: int = 0, stream: bool = False) -> None:  # noqa: ANN001
            client.send(wire.Generate(rid=rid, input=wire.Input(text=f"request {rid}"), stream=stream,
                                 priority=priority, sampling=wire.SamplingParams(
                                     max_tokens=tokens, temperature=0.0, ignore_eos=True)))

        # Each request runs alone (--max-running 1). The first one is long, so that the
        # others all wait for it: the order they then run in is the admission order.
        def finish_order(rids: int) -> list[str]:
            poller = zmq.Poller()
            for client in (a, b):
                poller.register(client._sock, zmq.POLLIN)  # noqa: SLF001
            finished: list[str] = []
            for client in (a, b):  # replies read (and kept) while waiting for a stats reply
                while client._buffer:  # noqa: SLF001
                    msg = client._buffer.popleft()  # noqa: SLF001
                    assert not isinstance(msg, wire.Error), msg
                    if isinstance(msg, wire.Done):
                        finished.append(msg.rid)
            while len(finished) < rids:
                ready = dict(poller.poll(60_000))
                assert ready, f"no progress after {finished}"
                for client in (a, b):
                    if client._sock in ready:  # noqa: SLF001
                        msg = client.recv()
                        assert not isinstance(msg, wire.Error), msg
                        if isinstance(msg, wire.Done):
                            finished.append(msg.rid)
            return finished

        def queue_behind_a_long_request(first: str, then: list[tuple[object, str, int]],
                                        tokens: int = 40) -> bool:
            """Start `first` on a, send `then` (client, rid, priority); True if they all
            reached the engine's waiting queue while `first` still ran (the machine may
            be too slow to send them in time: then the caller tries again)."""
            gen(a, first, 240)  # not streamed: its chunks would crowd a's socket
            # (the tiny model decodes ~2,000 tok/s: on a loaded machine `first` can end
            # before a stats reply shows it running, so its Done ends the wait too)
            while not a.call(wire.GetStats(rid=f"started-{first}")).running:  # type: ignore[attr-defined]
                if any(isinstance(m, wire.Done) and m.rid == first for m in a._buffer):  # noqa: SLF001
                    return False
            for client, rid, priority in then:
                gen(client, rid, tokens, priority=priority)
            for client in (a, b):  # each answered after that client's requests got there
                stats = client.call(wire.GetStats(rid=f"stats-{first}"))
            assert isinstance(stats, wire.StatsReply)
            return stats.running == 1 and stats.waiting == len(then)

        # b1's place among a's requests is read across two sockets, which keep no order
        # between them: 160-token requests (~80 ms each here, longer on a loaded machine)
        # keep their Done messages far enough apart for the arrival order to be theirs.
        for attempt in range(6):
            queued = queue_behind_a_long_request(f"a1-{attempt}", [
                (a, f"a2-{attempt}", 0), (a, f"a3-{attempt}", 0), (a, f"a4-{attempt}", 0),
                (b, f"b1-{attempt}", 0)], tokens=160)
            order = [rid.split("-")[0] for rid in finish_order(5)]
            if queued:
                break
        assert queued, "the queue never formed"
        # Round-robin: b1 (its client not served yet) before the rest of a's queue.
        assert order == ["a1", "b1", "a2", "a3", "a4"]

        for attempt in range(6):
            queued = queue_behind_a_long_request(f"c1-{attempt}", [
                (a, f"c2-{attempt}", 0), (a, f"c3-{attempt}", 10)])  # 10: over the cap
            order = [rid.split("-")[0] for rid in finish_order(3)]
            if queued:
                break
        assert queued, "the queue never formed"
        assert order == ["c1", "c2", "c3"]  # c3's priority was clamped to 0

        for rid in ("d1", "d2", "d3", "d4"):
            gen(a, rid, 200)
        gen(a, "d5", 4)  # a fifth in flight: over the cap
        refused = a.recv_for("d5")
        assert isinstance(refused, wire.Error) and refused.code == wire.ErrorCode.CAPACITY
        assert finish_order(4) == ["d1", "d2", "d3", "d4"]
        assert_pool_clean(a)
