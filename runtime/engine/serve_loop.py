"""The engine's serving loop, and the intake thread that answers control requests while
the model computes.

Two threads share the scheduler:

- the **loop** (the engine's main thread): takes the messages the intake queued, runs one
  scheduler step, sends what it produced; idle, it waits for the next message;
- the **intake thread**: owns the PULL socket, decodes every frame and queues it for the
  loop, except a control request (stats, session listings and commands, flush, abort of
  a request that is not running) that arrives while the loop is inside a model forward:
  that one it answers at once. When a forward starts with control requests queued
  while the loop was busy, the loop wakes it (an inproc socket) to answer them; with none
  queued it does not (a batch-1 decode step is a few ms, and on two cores a wake-up a step
  took a core from the kernel's threads: SmolLM2 Q6_K decode ~3% faster without it). A
  control request the intake thread could only queue because the forward had not started
  yet is tried again right after it is queued, so one that lands as the gate opens is
  still answered in the forward (either the loop sees it queued, or the intake thread
  sees the gate open).

The `StateGate` makes this safe: the loop holds it whenever it touches scheduler state,
and lets go only around the model forward (which reads the batch it was given and writes
KV slots that running requests own, nothing a control request changes). Before letting
go the loop sends everything it has produced, so replies keep their causal order: what a
client caused before the forward reaches it before what the intake answers during it. A
control request from a client that still has messages queued waits in the queue behind
them (its answer must see them). The PUSH socket is used by whoever holds the gate (a
ZeroMQ socket may change threads behind a lock, which is a full memory barrier).

So a `stats` during a long prefill chunk, the frontend's liveness probe included, is
answered in milliseconds instead of after the chunk: a busy engine is never mistaken
for a dead one.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import msgspec
import zmq
from radixlm.runtime.engine.wire import (
    EngineAbort,
    EngineCommand,
    Shutdown,
    ToFrontend,
    encode,
    to_engine_decoder,
)

log = logging.getLogger("radixlm.engine")

IDLE_WAIT_S = 0.1  # nothing to do: wait this long for a message (then tick sessions)
STALLED_WAIT_S = 0.005  # work queued but nothing schedulable this step
POLL_MS = 100  # the intake thread's poll, so it notices `stop` within this


class LoopScheduler(Protocol):
    """What the loop needs of `Scheduler`."""

    gate: Any

    def handle(self, msg: object) -> None: ...
    def has_work(self) -> bool: ...
    def maybe_tick(self) -> None: ...
    def step(self) -> bool: ...
    def take_outbox(self) -> list[ToFrontend]: ...
    def can_answer_now(self, msg: object) -> bool: ...


class StopFlag:
    """Set by Shutdown, SIGTERM or the caller; both threads watch it."""

    def __init__(self) -> None:
        self.set = False

    def __call__(self, signum: int, frame: object) -> None:
        log.info("engine: signal %d, stopping", signum)
        self.set = True


class StateGate:
    """The scheduler-state lock (see the module doc). The loop holds it from `start` on
    and lets go only inside `forward()`."""

    def __init__(self, flush: Callable[[], None], wake: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._flush = flush
        self._wake = wake
        self.forwards = 0  # forwards that ran with the gate open (stats for tests)

    def start(self) -> None:
        self._lock.acquire()

    def stop(self) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around the model forward: send what the step produced so far, then let the
        intake thread in until the forward returns."""
        self._flush()
        self.forwards += 1
        self._lock.release()
        self._wake()  # control requests queued just before may be answered now
        try:
            yield
        finally:
            self._lock.acquire()

    def try_enter(self) -> bool:
        """The intake thread: the gate if the loop is inside a forward (never waits)."""
        return self._lock.acquire(blocking=False)

    def leave(self) -> None:
        self._lock.release()


class IntakeQueue:
    """The intake thread's queue for the loop, with each client's count of queued
    messages (a control request is answered early only when its client has none)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()
        self._pending: collections.Counter[bytes] = collections.Counter()
        self.answered_early = 0  # control requests answered during a forward

    def put(self, msg: object) -> None:
        client = getattr(msg, "client", None)
        with self._cond:
            self._queue.append(msg)
            if client is not None:
                self._pending[client] += 1
            self._cond.notify()

    def take(self, wait_s: float) -> list[object]:
        """Every queued message; waits up to `wait_s` for one when there are none."""
        with self._cond:
            if not self._queue and wait_s > 0:
                self._cond.wait(wait_s)
            msgs = list(self._queue)
            self._queue.clear()
            for msg in msgs:
                client = getattr(msg, "client", None)
                if client is not None:
                    self._pending[client] -= 1
                    if not self._pending[client]:
                        del self._pending[client]
            return msgs

    def queued_for(self, client: bytes | None) -> bool:
        with self._cond:
            return bool(self._queue) if client is None else self._pending[client] > 0

    def has_controls(self) -> bool:
        """Whether any control request is queued."""
        with self._cond:
            return any(is_control(msg) for msg in self._queue)

    def take_controls(self) -> list[object]:
        """Take the queued control requests that nothing of their client waits ahead of
        (in queue order; the rest stays queued)."""
        with self._cond:
            if not self._queue:
                return []
            taken: list[object] = []
            kept: collections.deque[object] = collections.deque()
            blocked: set[bytes | None] = set()
            for msg in self._queue:
                client = getattr(msg, "client", None)
                if client not in blocked and is_control(msg):
                    taken.append(msg)
                    if client is not None:
                        self._pending[client] -= 1
                        if not self._pending[client]:
                            del self._pending[client]
                else:
                    kept.append(msg)
                    blocked.add(client)
            self._queue = kept
            return taken

    def put_back(self, msgs: list[object]) -> None:
        """Return messages `take_controls` took but could not answer, ahead of the rest."""
        with self._cond:
            for msg in reversed(msgs):
                self._queue.appendleft(msg)
                client = getattr(msg, "client", None)
                if client is not None:
                    self._pending[client] += 1


def is_control(msg: object) -> bool:
    """Requests the intake thread may answer during a forward: engine commands (stats,
    listings, session commands, flush) and aborts (of requests that are not running,
    checked by `Scheduler.can_answer_now`)."""
    return isinstance(msg, (EngineCommand, EngineAbort))


class EngineLoop:
    """Runs the scheduler against its two sockets until `stop` is set."""

    def __init__(self, sched: LoopScheduler, inbox: zmq.Socket[Any], outbox: zmq.Socket[Any],
                 stop: StopFlag, on_step: Callable[[], None] | None = None) -> None:
        self.sched = sched
        self.inbox = inbox
        self.outbox = outbox
        self.stop = stop
        self.on_step = on_step
        self.busy_s = 0.0  # time spent in scheduler steps that ran (for throughput figures)
        self.intake = IntakeQueue()
        self.wakes = 0  # intake-thread wake-ups sent as forwards started (stats for tests)
        # The loop rings this when a forward starts with control requests queued (the
        # intake thread then answers them): an inproc pair, one message at most pending.
        ctx = inbox.context
        address = f"inproc://radixlm-intake-wake-{id(self)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_rx.bind(address)
        self._wake_tx = ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.SNDHWM, 1)
        self._wake_tx.connect(address)
        self.gate = StateGate(self._send_outbox, self._ring)
        sched.gate = self.gate

    def _ring(self) -> None:
        """A forward has started (the gate is open): wake the intake thread if control
        requests are queued for it to answer."""
        if not self.intake.has_controls():
            return
        self.wakes += 1
        with contextlib.suppress(zmq.Again):  # one pending already: that one will do
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def _send_outbox(self) -> None:
        for out in self.sched.take_outbox():
            self.outbox.send(encode(out))

    def run(self) -> None:
        self.gate.start()
        reader = threading.Thread(target=self._read, name="radixlm-intake", daemon=True)
        reader.start()
        try:
            self._loop()
        finally:
            self.stop.set = True
            self.gate.stop()  # (an intake thread inside the gate finishes its answer first)
            reader.join(timeout=2 * POLL_MS / 1000)
            self.gate.start()  # hold it again: nobody touches the sockets after this
            self._wake_tx.close(linger=0)
            self._wake_rx.close(linger=0)

    def _loop(self) -> None:
        sched = self.sched
        wait = 0.0
        while not self.stop.set:
            for msg in self.intake.take(wait):
                if isinstance(msg, Shutdown):
                    log.info("engine: shutdown requested")
                    self.stop.set = True
                    break
                sched.handle(msg)
            if self.stop.set:
                break
            sched.maybe_tick()
            started = time.monotonic()
            ran = sched.step() if sched.has_work() else False
            if ran:
                self.busy_s += time.monotonic() - started
            self._send_outbox()
            if self.on_step is not None:
                self.on_step()
            wait = 0.0 if ran else (STALLED_WAIT_S if sched.has_work() else IDLE_WAIT_S)

    # -- the intake thread -----------------------------------------------------------------
    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while not self.stop.set:
                ready = dict(poller.poll(POLL_MS))
                if self._wake_rx in ready:
                    while True:
                        try:
                            self._wake_rx.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    self._answer_queued()
                if self.inbox not in ready:
                    continue
                while not self.stop.set:
                    try:
                        data = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = to_engine_decoder.decode(data)
                    except msgspec.MsgspecError as e:  # our own frontend's bug: drop it
                        log.error("undecodable message dropped: %s", e)
                        continue
                    control = is_control(msg)
                    if control and self._answer_now(msg):
                        continue
                    self.intake.put(msg)
                    if control:  # the forward may have started meanwhile
                        self._answer_queued()
        except zmq.ZMQError as e:  # the socket closed under us at shutdown
            if not self.stop.set:
                log.error("engine intake stopped: %s", e)
                self.stop.set = True
                self.intake.put(Shutdown())

    def _answer_queued(self) -> None:
        """A forward has started: answer the control requests that were queued while the
        loop was busy (those nothing of their client waits ahead of)."""
        if not self.gate.try_enter():
            return  # the forward is over already
        try:
            msgs = self.intake.take_controls()
            for i, msg in enumerate(msgs):
                if not self.sched.can_answer_now(msg):
                    self.intake.put_back(msgs[i:])  # (keeps their order)
                    break
                self.sched.handle(msg)
                self.intake.answered_early += 1
            self._send_outbox()
        finally:
            self.gate.leave()

    def _answer_now(self, msg: object) -> bool:
        """Handle `msg` here if the loop is inside a forward and nothing of its client is
        queued ahead of it; False: queue it."""
        client = getattr(msg, "client", None)
        if self.intake.queued_for(client) or not self.gate.try_enter():
            return False
        try:
            # Checked again inside the gate: the loop may have queued-then-taken meanwhile.
            if self.intake.queued_for(client) or not self.sched.can_answer_now(msg):
                return False
            t0 = time.perf_counter()
            self.sched.handle(msg)
            self.intake.answered_early += 1  # counted before the reply leaves
            self._send_outbox()
            log.debug("answered %s during a forward in %.1f ms", type(msg).__name__,
                      1e3 * (time.perf_counter() - t0))
            return True
        finally:
            self.gate.leave()
