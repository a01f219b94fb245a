"""The serving loop's intake thread: control requests are answered while a model forward
runs (the forward is held open by the test), in causal order per client, and whatever
they change leaves the pool consistent."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine.engine_main import build_engine
from radixlm.runtime.engine.serve_loop import EngineLoop, StopFlag
from radixlm.runtime.engine.wire import (
    EngineAbort,
    EngineCommand,
    EngineGenerate,
    EngineOpenSession,
    Shutdown,
    StepOutputs,
    ToClient,
    encode,
    to_frontend_decoder,
)
from radixlm.runtime.protocol import (
    CloseSession,
    FlushCache,
    GetStats,
    ListSessions,
    Ok,
    SamplingParams,
    SessionList,
    SessionOpened,
    StatsReply,
    decode_server,
)
from radixlm.runtime.transport.channel import open_socket
from tiny_models import make_tiny_checkpoint


class HeldForward:
    """Wraps the model: each forward waits for the test's `release()` once `hold()` was
    called (`entered` tells the test it is inside)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = model.device
        self.entered = threading.Event()
        self._go = threading.Event()
        self._go.set()

    def hold(self) -> None:
        self.entered.clear()
        self._go.clear()

    def release(self) -> None:
        self._go.set()

    def forward(self, batch: Any) -> torch.Tensor:
        self.entered.set()
        assert self._go.wait(60), "the test never released the forward"
        return self.model.forward(batch)


class Pipes:
    """The frontend's side of the engine's two sockets."""

    def __init__(self, tmp: Path) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.to_engine = f"ipc://{tmp}/e"
        self.from_engine = open_socket(self.ctx, zmq.PULL, f"ipc://{tmp}/f", bind=True)
        self.engine_in = open_socket(self.ctx, zmq.PULL, self.to_engine, bind=True)
        self.engine_out = open_socket(self.ctx, zmq.PUSH, f"ipc://{tmp}/f", bind=False)
        self.send_sock = open_socket(self.ctx, zmq.PUSH, self.to_engine, bind=False)
        self.seen: list[object] = []

    def send(self, msg: Any) -> None:
        self.send_sock.send(encode(msg))

    def recv(self, timeout_s: float) -> object | None:
        if not self.from_engine.poll(int(timeout_s * 1000)):
            return None
        msg = to_frontend_decoder.decode(self.from_engine.recv())
        self.seen.append(msg)
        return msg

    def reply_to(self, client: bytes, timeout_s: float) -> Any:
        """The next reply addressed to `client` (other messages are kept in `seen`)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(left)
            if isinstance(msg, ToClient) and msg.client == client:
                return decode_server(msg.data)
        return None

    def finish_of(self, key: int, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while True:
            for m in self.seen:
                if isinstance(m, StepOutputs):
                    for o in m.outputs:
                        if o.key == key and o.finish_reason is not None:
                            return o.finish_reason
            left = deadline - time.monotonic()
            if left <= 0 or self.recv(left) is None:
                return None

    def close(self) -> None:
        for s in (self.from_engine, self.engine_in, self.engine_out, self.send_sock):
            s.close(0)
        self.ctx.term()


@pytest.fixture
def served(tmp_path: Path):
    model = make_tiny_checkpoint(tmp_path / "m", "llama", seed=5, max_position_embeddings=1024)
    config = EngineConfig(model=str(model), device="cpu", kv_tokens=2048, threads=1,
                          max_running=1, schedule_policy="fcfs")
    engine = build_engine(config)
    sched = engine.scheduler
    held = HeldForward(sched.model)
    sched.model = held
    pipes = Pipes(tmp_path)
    stop = StopFlag()
    loop = EngineLoop(sched, pipes.engine_in, pipes.engine_out, stop)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        yield pipes, held, sched, loop
    finally:
        held.release()
        pipes.send(Shutdown())
        thread.join(10)
        assert not thread.is_alive()
        sched.check_integrity()
        pipes.close()


def gen(key: int, client: bytes, n_prompt: int, max_tokens: int = 4) -> EngineGenerate:
    return EngineGenerate(key=key, client=client, rid=f"r{key}", input_ids=list(range(3, 3 + n_prompt)),
                          sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                  ignore_eos=True))


def test_control_requests_are_answered_while_a_forward_runs(served) -> None:
    pipes, held, sched, loop = served
    pipes.send(EngineOpenSession(client=b"b", rid="open", input_ids=list(range(40, 60))))
    opened = pipes.reply_to(b"b", 30)
    assert isinstance(opened, SessionOpened)

    held.hold()
    pipes.send(gen(1, b"a", 200))
    assert held.entered.wait(30), "the prefill never started"
    # The forward is held open: every one of these is answered inside it.
    t0 = time.monotonic()
    pipes.send(EngineCommand(client=b"b", msg=GetStats(rid="s1")))
    stats = pipes.reply_to(b"b", 5)
    assert isinstance(stats, StatsReply), stats
    assert stats.running == 1 and stats.invariant_ok  # the request being computed
    pipes.send(EngineCommand(client=b"b", msg=ListSessions(rid="l1")))
    listing = pipes.reply_to(b"b", 5)
    assert isinstance(listing, SessionList) and [s.session for s in listing.sessions] == [opened.session]
    pipes.send(EngineCommand(client=b"b", msg=CloseSession(rid="c1", session=opened.session)))
    assert isinstance(pipes.reply_to(b"b", 5), Ok)
    pipes.send(EngineCommand(client=b"b", msg=FlushCache(rid="f1")))
    assert isinstance(pipes.reply_to(b"b", 5), Ok)
    assert time.monotonic() - t0 < 5 and not held._go.is_set()  # noqa: SLF001 - still inside
    assert loop.intake.answered_early == 4
    held.release()
    assert pipes.finish_of(1, 30) == "length"


def test_an_early_answer_is_counted_before_its_reply_leaves(served) -> None:
    """Whoever reads `answered_early` after the reply arrived sees it counted: the intake
    thread counts before it sends. (It counted after: on a loaded machine the test above
    read 3 of 4. Here the intake thread is held right after sending, which made the old
    order fail every time.)"""
    pipes, held, sched, loop = served
    send = loop._send_outbox

    def send_then_pause() -> None:
        send()
        if threading.current_thread().name == "radixlm-intake":
            time.sleep(0.2)  # the reply is out; the intake thread is not done yet

    loop._send_outbox = send_then_pause
    held.hold()
    pipes.send(gen(1, b"a", 50))
    assert held.entered.wait(30), "the prefill never started"
    pipes.send(EngineCommand(client=b"b", msg=GetStats(rid="s1")))
    assert isinstance(pipes.reply_to(b"b", 5), StatsReply)
    assert loop.intake.answered_early == 1
    held.release()
    assert pipes.finish_of(1, 30) == "length"


def test_a_control_request_waits_behind_its_clients_queued_messages(served) -> None:
    pipes, held, sched, loop = served
    held.hold()
    pipes.send(gen(1, b"a", 100))
    assert held.entered.wait(30)
    # c's generate is queued (the loop is in the forward): c's stats must count it, so it
    # waits for the loop; d, with nothing queued, is answered at once.
    pipes.send(gen(2, b"c", 10))
    pipes.send(EngineCommand(client=b"c", msg=GetStats(rid="sc")))
    pipes.send(EngineCommand(client=b"d", msg=GetStats(rid="sd")))
    d_stats = pipes.reply_to(b"d", 5)
    assert isinstance(d_stats, StatsReply) and d_stats.waiting == 0
    assert not [m for m in pipes.seen if isinstance(m, ToClient) and m.client == b"c"]
    held.release()
    c_stats = pipes.reply_to(b"c", 30)
    assert isinstance(c_stats, StatsReply)
    assert c_stats.running + c_stats.waiting == 2  # its own request is there
    assert pipes.finish_of(2, 30) == "length"


def test_a_waiting_request_is_aborted_during_a_forward(served) -> None:
    pipes, held, sched, loop = served
    pipes.send(gen(1, b"a", 50, max_tokens=64))
    pipes.send(gen(2, b"b", 10))  # waits: --max-running 1
    deadline = time.monotonic() + 30
    while not (sched.table.waiting and sched.table.running) and time.monotonic() < deadline:
        time.sleep(0.01)
    held.hold()
    assert held.entered.wait(30)
    early = loop.intake.answered_early
    pipes.send(EngineAbort(key=2))  # not running: handled inside the forward
    assert pipes.finish_of(2, 5) == "abort"
    pipes.send(EngineAbort(key=1))  # running: it waits for the forward to end
    assert pipes.finish_of(1, 0.3) is None
    assert loop.intake.answered_early == early + 1
    held.release()
    assert pipes.finish_of(1, 30) == "abort"


def hold_between_steps(pipes: Pipes, held: HeldForward, sched: Any) -> tuple[threading.Event, threading.Event]:
    """Start a 64-token request, then stop the loop once between two steps (it holds the
    state there) with the next forward held open: `busy` is set when the loop stopped,
    `resume` lets it go on into that forward."""
    pipes.send(gen(1, b"a", 30, max_tokens=64))
    deadline = time.monotonic() + 30
    while not sched.table.running and time.monotonic() < deadline:
        time.sleep(0.01)
    busy, resume = threading.Event(), threading.Event()
    tick = sched.maybe_tick

    def slow_tick() -> None:  # the loop's own work between steps, held by the test, once
        sched.maybe_tick = tick
        held.hold()  # (from the loop's thread: the very next forward is the held one)
        busy.set()
        assert resume.wait(30)
        tick()

    sched.maybe_tick = slow_tick
    return busy, resume


def test_a_control_request_queued_while_the_loop_was_busy_is_answered_in_the_forward(served) -> None:
    """The loop is between two forwards (holding the state) when `stats` arrives, so it is
    queued; once the next forward starts, the intake thread answers it there instead of
    leaving it for after the forward."""
    pipes, held, sched, loop = served
    busy, resume = hold_between_steps(pipes, held, sched)
    assert busy.wait(30)
    pipes.send(EngineCommand(client=b"b", msg=GetStats(rid="queued")))
    time.sleep(0.2)  # it reaches the intake thread, which can only queue it
    assert not [m for m in pipes.seen if isinstance(m, ToClient) and m.client == b"b"]
    resume.set()
    assert held.entered.wait(30)
    stats = pipes.reply_to(b"b", 5)  # the forward is still held open
    assert isinstance(stats, StatsReply) and not held._go.is_set()  # noqa: SLF001
    assert loop.wakes == 1  # the forward found it queued and woke the intake thread
    held.release()
    pipes.send(EngineAbort(key=1))
    assert pipes.finish_of(1, 30) in ("abort", "length")


def test_forwards_with_nothing_queued_do_not_wake_the_intake_thread(served) -> None:
    """A decode step of a few ms woke the intake thread at every forward, for nothing; now
    only a forward that starts with control requests queued does."""
    pipes, held, sched, loop = served
    pipes.send(gen(1, b"a", 20, max_tokens=24))
    assert pipes.finish_of(1, 30) == "length"
    assert loop.gate.forwards >= 24 and loop.wakes == 0


def test_a_control_request_queued_as_the_forward_opens_is_answered_in_it(served) -> None:
    """The race the conditional wake-up opens: the intake thread finds the gate closed
    (the loop is between steps) and queues a `stats`, but the forward starts and checks
    the queue before the message is in it, so the loop sends no wake-up. The intake
    thread tries the gate again right after queueing, finds it open, and answers inside
    the forward (without that retry the reply waited for the forward's end)."""
    pipes, held, sched, loop = served
    busy, resume = hold_between_steps(pipes, held, sched)
    queueing = threading.Event()
    put = loop.intake.put

    def late_put(msg: object) -> None:  # the intake thread, after it found the gate closed
        if isinstance(msg, EngineCommand):
            queueing.set()
            assert held.entered.wait(30)  # the forward started (and checked the queue) first
        put(msg)

    loop.intake.put = late_put  # type: ignore[method-assign]
    assert busy.wait(30)
    pipes.send(EngineCommand(client=b"b", msg=GetStats(rid="late")))
    assert queueing.wait(30)
    resume.set()
    stats = pipes.reply_to(b"b", 5)
    assert isinstance(stats, StatsReply) and not held._go.is_set()  # noqa: SLF001 - still inside
    assert loop.wakes == 0  # answered by the retry, not by a wake-up
    held.release()
    pipes.send(EngineAbort(key=1))
    assert pipes.finish_of(1, 30) in ("abort", "length")
