"""Protocol robustness: thousands of random and mutated frames against a live server.

Every frame the server cannot read gets an `error` reply (`bad_message` or
`unknown_type`), every reply the server sends decodes as a protocol message with a
known error code; the server never crashes or
hangs, answers a ping after each batch, leaks no KV slot (`invariant_ok`, `private == 0`
once idle) and afterwards still generates exactly what it generated before the fuzzing.

The server runs in its own process group for this module only, so a crash here cannot
take other tests' server down, and its log is attached to any failure.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from message_mutations import mutated, nested_values
from radixlm.runtime import protocol

PING_TIMEOUT_S = 20.0
MAX_EXAMPLES = 160  # batches of 8-20 multipart messages: ~2,300 frames, plus the crafted ones
MIN_FRAMES = 2_000

# --- frames --------------------------------------------------------------------------------

RID, SESSION = "<rid>", "<session>"  # placeholders filled in at send time
_SMALL = {"max_tokens": 2, "temperature": 0}
BASE_MESSAGES: list[dict[str, Any]] = [
    {"type": "generate", "rid": RID, "input": {"input_ids": [5, 6, 7]}, "sampling": _SMALL},
    {"type": "generate", "rid": RID, "input": {"text": "hi"}, "sampling": _SMALL, "stream": True},
    {"type": "generate", "rid": RID, "session": SESSION, "sampling": _SMALL,
     "input": {"messages": [{"role": "user", "content": "hi"}]}},
    {"type": "generate", "rid": RID, "input": {"input_ids": [3, 4]}, "n": 2,
     "sampling": {**_SMALL, "temperature": 1.0, "seed": 1, "logprobs": True, "top_logprobs": 2},
     "prompt_logprobs_start": 0},
    {"type": "abort", "rid": RID},
    {"type": "stats", "rid": RID},
    {"type": "open_session", "rid": RID, "input": {"text": "sys"}, "retention": "soft"},
    {"type": "fork_session", "rid": RID, "session": SESSION, "n": 2},
    {"type": "truncate_session", "rid": RID, "session": SESSION, "length": 2},
    {"type": "close_session", "rid": RID, "session": SESSION},
    {"type": "pin", "rid": RID, "name": "p", "input": {"input_ids": [9, 9, 9]}},
    {"type": "unpin", "rid": RID, "name": "p"},
    {"type": "list_sessions", "rid": RID},
    {"type": "tokenize", "rid": RID, "input": {"text": "hello"}},
    {"type": "hello", "protocol_version": 1},
]  # fmt: skip

# Hand-made attacks on the decoder: lengths that claim gigabytes, deep nesting (before and
# after the "type" key), a 2 MB frame, truncations, huge prompts, unpackable extension types.
_DEEP = b"\x91" * 5000 + b"\xc0"
CRAFTED: list[list[bytes]] = [
    [b""],
    [b"\xdd\xff\xff\xff\xff"],  # array32 claiming 4 G items
    [b"\xdf\xff\xff\xff\xff"],  # map32 claiming 4 G pairs
    [b"\xdb\xff\xff\xff\xff"],  # str32 claiming 4 GB
    [b"\xc6\x7f\xff\xff\xff"],  # bin32 claiming 2 GB
    [_DEEP],
    [b"\x82\xa3rid" + _DEEP + b"\xa4type\xa5stats"],
    [b"\x82\xa4type\xa8generate\xa5input" + _DEEP],
    [b"\x00" * 2_000_000],
    [msgpack.packb({"type": "stats", "rid": "x"})[:-1]],
    [msgpack.packb({"type": "stats", "rid": "x"}) + b"\xc0"],
    [msgpack.packb({"type": "stats", "rid": "x"}), b"second frame"],
    [b"", msgpack.packb({"type": "stats", "rid": "x"})],
    [msgpack.packb({"type": "generate", "rid": "big", "input": {"input_ids": [1] * 100_000}})],
    [msgpack.packb({"type": "generate", "rid": "long", "input": {"text": "ab " * 50_000}})],
    [msgpack.packb({"type": "stats", "rid": msgpack.ExtType(5, b"xx")})],
    [msgpack.packb({"type": "stats", "rid": 2**64 - 1})],
    [msgpack.packb({"type": "generate", "rid": "f", "input": {"input_ids": [2**63 - 1]}})],
    [msgpack.packb({"type": "generate", "rid": "f", "input": {"text": "x"},
                    "sampling": {"max_tokens": 2**63 - 1, "temperature": float("nan")}})],
]  # fmt: skip

_ints = st.one_of(
    st.integers(-3, 300), st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([2**31, 2**32, 2**53 + 1, -(2**63), 2**64 - 1]),
)  # fmt: skip
_scalars = st.one_of(
    st.none(), st.booleans(), _ints, st.floats(), st.text(max_size=12), st.binary(max_size=12),
    st.sampled_from([RID, SESSION, "hard", "soft", "user", "generate", "stats", ""]),
)  # fmt: skip
_values = nested_values(_scalars, max_size=4, max_leaves=10)


def mutated_message() -> st.SearchStrategy[dict[str, Any]]:
    """A valid message with 0-3 fields replaced, dropped or added, at any depth."""
    return mutated(BASE_MESSAGES, _values, ["x", "rid", "type", "n", "session", "input"], (0, 3))


# One multipart message: a list of frames (dicts are packed at send time, placeholders
# filled). Mutated valid messages are weighted double: they reach the deepest code.
frames_strategy = st.one_of(
    mutated_message().map(lambda m: [m]),
    mutated_message().map(lambda m: [m]),
    st.binary(max_size=48).map(lambda b: [b]),
    _values.map(lambda v: [msgpack.packb(v)]),
    st.sampled_from(CRAFTED),
    st.lists(st.one_of(st.binary(max_size=16), mutated_message()), min_size=2, max_size=3),
)


# --- the client side -------------------------------------------------------------------------


class FuzzClient:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sock = self._connect()
        self.rids = itertools.count()
        self.sessions: list[str] = []
        self.sent: deque[list[bytes]] = deque(maxlen=40)  # for failure reports
        self.frames_sent = 0
        self.replies = 0
        self.welcomed = False

    def _connect(self) -> zmq.Socket[Any]:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def close(self) -> None:
        self.sock.close(linger=0)

    def recv(self, timeout_s: float = PING_TIMEOUT_S) -> protocol.ServerMessage:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(
                f"the server did not answer within {timeout_s} s; last frames sent:\n"
                + "\n".join(repr(f)[:300] for f in self.sent)
            )
        frames = self.sock.recv_multipart()
        assert len(frames) == 1, frames
        self.replies += 1
        # Every reply must be a well-formed protocol message.
        msg = protocol.decode_server(frames[0])
        if isinstance(msg, protocol.Error):
            assert msg.code in ERROR_CODES, msg
        return msg

    def fill(self, msg: dict[str, Any], rids: list[str]) -> dict[str, Any]:
        """Replace placeholders: a fresh rid, one of the open sessions."""
        out: dict[str, Any] = {}
        for key, value in msg.items():
            if value == RID:
                value = f"fz{next(self.rids)}"
                rids.append(value)
            elif value == SESSION:
                value = self.sessions[len(rids) % len(self.sessions)] if self.sessions else "gone"
            elif isinstance(value, dict):
                value = self.fill(value, rids)
            out[key] = value
        return out

    def send(self, frames: list[bytes | dict[str, Any]], rids: list[str]) -> int:
        """Send one multipart message; returns 1 if the server cannot read it (an Error
        reply is owed), else 0."""
        raw = [msgpack.packb(self.fill(f, rids)) if isinstance(f, dict) else f for f in frames]
        self.sent.append(raw)
        self.frames_sent += len(raw)
        self.sock.send_multipart(raw)
        if len(raw) == 1 and is_hello(raw[0]):
            self.welcomed = True
        return int(len(raw) != 1 or not decodes(raw[0]))

    def ping(self) -> tuple[list[protocol.ServerMessage], protocol.StatsReply | protocol.Error]:
        """Everything received until the reply to a stats request sent now (an Error
        `handshake_required` before hello)."""
        rid = f"ping{next(self.rids)}"
        self.sock.send(msgpack.packb({"type": "stats", "rid": rid}))
        got = []
        while True:
            msg = self.recv()
            if isinstance(msg, (protocol.StatsReply, protocol.Error)) and msg.rid == rid:
                return got, msg
            got.append(msg)

    def request(self, msg: dict[str, Any]) -> protocol.ServerMessage:
        rid = f"req{next(self.rids)}"
        self.sock.send(msgpack.packb({**msg, "rid": rid}))
        while True:
            reply = self.recv()
            if getattr(reply, "rid", None) == rid:
                return reply

    def hello(self) -> None:
        self.sock.send(msgpack.packb({"type": "hello", "protocol_version": 1}))
        assert isinstance(self.recv(), protocol.Welcome)
        self.welcomed = True


ERROR_CODES = {v for k, v in vars(protocol.ErrorCode).items() if not k.startswith("_")}


def decodes(data: bytes) -> bool:
    try:
        protocol.decode_client(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    except RecursionError:  # deep nesting: not a valid message either
        return False
    return True


def is_hello(data: bytes) -> bool:
    return decodes(data) and protocol.decode_client(data) == protocol.Hello(protocol_version=1)


def greedy(c: FuzzClient) -> list[int]:
    done = c.request(
        {
            "type": "generate",
            "input": {"input_ids": [11, 12, 13, 14]},
            "sampling": {"max_tokens": 6, "temperature": 0, "ignore_eos": True},
        }
    )
    assert isinstance(done, protocol.Done), done
    return done.token_ids


def wait_idle(c: FuzzClient, timeout_s: float = 60.0) -> protocol.StatsReply:
    deadline = time.monotonic() + timeout_s
    while True:
        _, stats = c.ping()
        if stats.running == 0 and stats.waiting == 0:
            return stats
        assert time.monotonic() < deadline, f"requests still running after {timeout_s} s: {stats}"
        time.sleep(0.05)


@pytest.fixture
def fuzz_client(fuzz_endpoint: str) -> Iterator[FuzzClient]:
    c = FuzzClient(fuzz_endpoint)
    yield c
    c.close()


def test_fuzzed_frames_never_break_the_server(
    fuzz_client: FuzzClient, fuzz_server_log: Any
) -> None:
    c = fuzz_client
    before_hello = FuzzClient(c.endpoint)  # frames from a client that never said hello
    try:
        c.hello()
        reference = greedy(c)
        for _ in range(3):
            opened = c.request({"type": "open_session"})
            assert isinstance(opened, protocol.SessionOpened), opened
            c.sessions.append(opened.session)

        owed = 0
        for frames in CRAFTED:
            owed += c.send(frames, [])
        got, _ = c.ping()
        assert sum(isinstance(m, protocol.Error) for m in got) >= owed, (owed, got)

        @settings(
            max_examples=MAX_EXAMPLES, deadline=None, database=None,
            suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        @given(batch=st.lists(frames_strategy, min_size=8, max_size=20), unwelcome=st.booleans())
        def batch_gets_answers(batch: list[list[Any]], unwelcome: bool) -> None:
            client = before_hello if unwelcome and len(batch) % 3 == 0 else c
            rids: list[str] = []
            owed = sum(client.send(frames, rids) for frames in batch)
            # Stop whatever the batch started, so long generations do not pile up.
            for rid in rids:
                client.sock.send(msgpack.packb({"type": "abort", "rid": rid}))
            got, _ = client.ping()
            errors = [m for m in got if isinstance(m, protocol.Error)]
            assert len(errors) >= owed, (owed, got)
            if not client.welcomed:
                assert not any(isinstance(m, (protocol.Done, protocol.Chunk)) for m in got), got

        # Hypothesis draws batch sizes at random (and may stop a run early), so one run can
        # fall short of the frame floor: run again, a bounded number of times, until it holds.
        for _ in range(4):
            batch_gets_answers()
            if c.frames_sent + before_hello.frames_sent >= MIN_FRAMES:
                break
        print(f"sent {c.frames_sent + before_hello.frames_sent} frames")
        assert c.frames_sent + before_hello.frames_sent >= MIN_FRAMES

        stats = wait_idle(c)
        assert stats.invariant_ok, stats
        assert stats.private == 0, stats
        assert stats.free + stats.evictable + stats.protected == stats.capacity, stats
        # The engine's state is intact: the same greedy request gives the same tokens, and
        # a new client can still connect.
        assert greedy(c) == reference
        fresh = FuzzClient(c.endpoint)
        fresh.hello()
        fresh.close()
    except BaseException:
        print(f"--- server log ---\n{fuzz_server_log()}")
        raise
    finally:
        before_hello.close()
