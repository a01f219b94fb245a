"""A fast fuzz run: >= 10,000 mutated frames (seeded, no hypothesis shrinking) from four
pipelining clients against a live server, counting crashes (the server process gone),
hangs (a client's ping unanswered for `PING_TIMEOUT_S`), replies that do not decode as
protocol messages, error codes not in `ErrorCode`, and `internal` errors (bugs). All
must be zero; every frame is answered (when the generations it started could finish
within `DRAIN_S`), and once the clients leave the engine idles with a clean pool.

CI size: ``FUZZ_FRAMES`` (10,000). A longer opt-in run: ``RADIXLM_FUZZ_FRAMES=200000
.venv/bin/python -m pytest -q tests/protocol/test_live_fuzz.py -s`` (prints the counts).
"""

from __future__ import annotations

import copy
import os
import random
import time
from typing import Any

import msgpack
import msgspec
import zmq
from radixlm.runtime import protocol

from tests.conftest import ServerHandle, assert_pool_clean
from tests.protocol.test_message_fuzz import BASE_MESSAGES, RID, SESSION

FUZZ_FRAMES = int(os.environ.get("RADIXLM_FUZZ_FRAMES", "10000"))
CLIENTS = 4
BATCH = 250  # frames a client sends before its ping
PING_TIMEOUT_S = 30.0
DRAIN_S = 60.0  # how long the generations the frames started may run before the clients leave
CODES = {v for k, v in vars(protocol.ErrorCode).items() if not k.startswith("_")}
SCALARS: list[Any] = [None, True, False, 0, -1, 1, 255, 2**31, 2**63 - 1, -(2**63), 2**64 - 1,
                      0.5, float("nan"), float("inf"), "", "x", "generate", "hard", b"\x00",
                      [], {}, [1, 2], {"a": 1}, "\u00e9" * 3, "a" * 300]


def mutate(rng: random.Random, rid: str) -> bytes:
    """One frame: a base message with placeholders filled and a few random edits, or raw
    junk, or a truncated / extended encoding."""
    roll = rng.random()
    if roll < 0.1:
        return rng.randbytes(rng.randrange(0, 48))
    msg = _fill(rng.choice(BASE_MESSAGES), rid)
    for _ in range(rng.randrange(0, 3)):
        _edit(rng, msg)
    _keep_small(msg)
    data = msgpack.packb(msg, use_bin_type=True)
    if roll < 0.2:
        return data[: rng.randrange(0, len(data) + 1)]
    if roll < 0.25:
        return data + rng.randbytes(rng.randrange(1, 8))
    return data


def _fill(value: Any, rid: str) -> Any:
    if value == RID:
        return rid
    if value == SESSION:
        return "0" * 32
    if isinstance(value, dict):
        return {k: _fill(v, rid) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, rid) for v in value]
    return value


def _edit(rng: random.Random, msg: dict[str, Any]) -> None:
    target = msg
    while True:  # walk into a nested map now and then
        nested = [k for k, v in target.items() if isinstance(v, dict)]
        if not nested or rng.random() < 0.5:
            break
        target = target[rng.choice(nested)]
    op = rng.random()
    if op < 0.3 and target:
        target.pop(rng.choice(list(target)))
    elif op < 0.5:
        target[rng.choice(["extra", "Type", "rid", "n", "input", "max_tokens"])] = _scalar(rng)
    elif target:
        target[rng.choice(list(target))] = _scalar(rng)


def _scalar(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(SCALARS))  # a fresh one: edits may go into it


def _keep_small(msg: dict[str, Any]) -> None:
    """Valid generations stay short: the run measures the protocol, not decoding."""
    sampling = msg.get("sampling")
    if isinstance(sampling, dict):
        tokens = sampling.get("max_tokens")
        if isinstance(tokens, int) and 4 < tokens < 2**31:
            sampling["max_tokens"] = 4
    if isinstance(msg.get("n"), int) and 4 < msg["n"] < 2**31:
        msg["n"] = 4


class Tally:
    def __init__(self) -> None:
        self.frames = self.replies = self.undecodable = self.unknown_codes = 0
        self.internal = self.hangs = self.crashes = 0
        self.internal_messages: list[str] = []  # what a bug said, for the assertion

    def reply(self, data: bytes) -> None:
        self.replies += 1
        try:
            msg = protocol.decode_server(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.undecodable += 1
            return
        if isinstance(msg, protocol.Error):
            self.unknown_codes += msg.code not in CODES
            if msg.code == protocol.ErrorCode.INTERNAL:
                self.internal += 1
                self.internal_messages.append(msg.message)


def test_ten_thousand_fuzzed_frames(fuzz_server: ServerHandle) -> None:
    rng = random.Random(14)
    tally = Tally()
    ctx = zmq.Context()
    socks = []
    started = time.perf_counter()
    try:
        for _ in range(CLIENTS):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(fuzz_server.endpoint)
            sock.send(msgpack.packb({"type": "hello", "protocol_version": 1}))
            socks.append(sock)
        rids = iter(range(10**9))
        while tally.frames < FUZZ_FRAMES:
            for i, sock in enumerate(socks):
                for _ in range(BATCH):
                    sock.send(mutate(rng, f"f{next(rids)}"))
                tally.frames += BATCH
                ping = f"ping{i}-{tally.frames}"
                sock.send(msgpack.packb({"type": "tokenize", "rid": ping, "input": {"text": ""}}))
                if not _await(sock, ping, tally):
                    tally.hangs += 1
                if fuzz_server.process.poll() is not None:
                    tally.crashes += 1
                    break
            if tally.crashes:
                break
        # What the frames started runs to its end (the replies counted), up to a bound;
        # then the clients leave, and the server aborts whatever is left of theirs.
        with fuzz_server.client(timeout_s=60) as probe:
            deadline = time.monotonic() + DRAIN_S
            while ((stats := probe.stats()).running or stats.waiting) and \
                    time.monotonic() < deadline:
                for sock in socks:
                    while sock.poll(0):
                        tally.reply(sock.recv())
                time.sleep(0.05)
            drained = not (stats.running or stats.waiting)
            for sock in socks:  # the replies that came after each batch's ping
                while sock.poll(200):
                    tally.reply(sock.recv())
            for sock in socks:
                sock.close(0)
            socks.clear()
            deadline = time.monotonic() + 60
            while (stats := probe.stats()).running or stats.waiting:
                assert time.monotonic() < deadline, stats
                time.sleep(0.05)
            assert_pool_clean(probe)
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
    elapsed = time.perf_counter() - started
    print(f"\nfuzz: {tally.frames} frames from {CLIENTS} clients in {elapsed:.1f} s, "
          f"{tally.replies} replies; crashes {tally.crashes}, hangs {tally.hangs}, undecodable "
          f"{tally.undecodable}, unknown codes {tally.unknown_codes}, internal {tally.internal}")
    assert tally.frames >= FUZZ_FRAMES
    if drained:  # every frame answered (and each hello)
        assert tally.replies >= tally.frames + CLIENTS
    assert (tally.crashes, tally.hangs, tally.undecodable, tally.unknown_codes, tally.internal) \
        == (0, 0, 0, 0, 0), (tally.internal_messages, fuzz_server.log()[-3000:])


def _await(sock: zmq.Socket[Any], rid: str, tally: Tally) -> bool:
    """Read replies until the one for `rid`; False if it does not come in time."""
    deadline = time.monotonic() + PING_TIMEOUT_S
    while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        data = sock.recv()
        tally.reply(data)
        try:
            if getattr(protocol.decode_server(data), "rid", None) == rid:
                return True
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    return False
