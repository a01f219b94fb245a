"""The wire protocol as a client in another language sees it.

Only pyzmq and the plain `msgpack` package: no msgspec, no SDK, nothing from radixlm. What
this file sends and expects is what docs/protocol.md promises, so a client written from
that page alone behaves like this one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

RECV_TIMEOUT_S = 60.0


class RawClient:
    """A DEALER socket speaking one msgpack map per frame."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._rid = 0
        self.welcome: dict[str, Any] = {}

    def close(self) -> None:
        self.sock.close(linger=0)

    def rid(self) -> str:
        self._rid += 1
        return f"raw-{self._rid}"

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.send(msgpack.packb(msg))

    def send_bytes(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = RECV_TIMEOUT_S) -> dict[str, Any]:
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no reply within {timeout_s} s")
        frames = self.sock.recv_multipart()
        assert len(frames) == 1, f"a reply is one frame, got {len(frames)}"
        msg = msgpack.unpackb(frames[0])  # raw=False: str stays str
        assert isinstance(msg, dict) and isinstance(msg.get("type"), str), msg
        return msg

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send `msg` with a fresh rid and return its reply (one message)."""
        msg = {**msg, "rid": self.rid()}
        self.send(msg)
        reply = self.recv()
        assert reply.get("rid") == msg["rid"], (msg, reply)
        return reply

    def hello(self) -> dict[str, Any]:
        self.send({"type": "hello", "protocol_version": 1, "client_name": "raw-wire-test"})
        return self.recv()

    def generate(self, **fields: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Run one generate; returns (chunks, done) after checking their order."""
        rid = self.rid()
        self.send({"type": "generate", "rid": rid, **fields})
        chunks: list[dict[str, Any]] = []
        while True:
            reply = self.recv()
            assert reply["rid"] == rid, reply
            if reply["type"] == "chunk":
                chunks.append(reply)
                continue
            assert reply["type"] in ("done", "error"), reply
            return chunks, reply

    def assert_quiet(self, wait_s: float = 0.2) -> None:
        assert not self.sock.poll(int(wait_s * 1000)), f"unexpected extra reply {self.recv()}"


@pytest.fixture
def client(wire_endpoint: str) -> Iterator[RawClient]:
    c = RawClient(wire_endpoint)
    yield c
    c.close()


@pytest.fixture
def ready(client: RawClient) -> RawClient:
    client.welcome = client.hello()
    assert client.welcome["type"] == "welcome", client.welcome
    return client


def assert_pool_clean(c: RawClient) -> None:
    """Nothing running or leaked: free + evictable + protected == capacity."""
    deadline = time.monotonic() + 30
    while True:
        stats = c.request({"type": "stats"})
        assert stats["type"] == "stats_reply", stats
        if stats["running"] == 0 and stats["waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert stats["invariant_ok"] is True, stats
    assert stats["private"] == 0, stats
    assert stats["free"] + stats["evictable"] + stats["protected"] == stats["capacity"], stats


# --- handshake -------------------------------------------------------------------------


def test_handshake_welcome_fields(client: RawClient) -> None:
    welcome = client.hello()
    assert welcome["type"] == "welcome"
    assert welcome["protocol_version"] == 1
    for field in ("server_version", "model"):
        assert isinstance(welcome[field], str) and welcome[field], welcome
    for field in ("context_length", "page_size", "kv_capacity"):
        assert isinstance(welcome[field], int) and welcome[field] > 0, welcome
    client.assert_quiet()


def test_request_before_hello_is_refused(client: RawClient) -> None:
    reply = client.request({"type": "stats"})
    assert reply["type"] == "error" and reply["code"] == "handshake_required", reply
    assert client.hello()["type"] == "welcome"  # the connection is still usable


def test_unsupported_version(client: RawClient) -> None:
    client.send({"type": "hello", "protocol_version": 999})
    reply = client.recv()
    assert reply["type"] == "error" and reply["code"] == "unsupported_version", reply
    assert reply["rid"] is None
    assert client.hello()["type"] == "welcome"


# --- generation --------------------------------------------------------------------------


def test_streamed_generation(ready: RawClient) -> None:
    prompt = [5, 6, 7, 8, 9, 10]
    chunks, done = ready.generate(
        input={"input_ids": prompt},
        sampling={"max_tokens": 6, "temperature": 0, "ignore_eos": True},
        stream=True,
    )
    assert done["type"] == "done", done
    assert done["finish_reason"] == "length"
    assert len(done["token_ids"]) == 6
    assert chunks, "stream=True sends chunks before done"
    # Chunks carry the output in order, without gaps or repeats.
    assert [t for c in chunks for t in c["token_ids"]] == done["token_ids"]
    assert "".join(c["text"] for c in chunks) == done["text"]
    assert all(c.get("index", 0) == 0 for c in chunks)
    usage = done["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == 6
    assert 0 <= usage["cached_tokens"] <= len(prompt)
    ready.assert_quiet()  # nothing after done

    # Without stream: the same greedy output, in done alone; the prompt is now cached.
    again, done2 = ready.generate(
        input={"input_ids": prompt},
        sampling={"max_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    assert again == [] and done2["token_ids"] == done["token_ids"]
    # All of it but the last token, whose logits must be computed to sample from.
    page = ready.welcome["page_size"]
    assert done2["usage"]["cached_tokens"] == (len(prompt) - 1) // page * page, done2
    assert_pool_clean(ready)


# --- sessions ----------------------------------------------------------------------------


def history_in_cache(done: dict[str, Any], page_size: int) -> int:
    """How much of a turn's history the next turn finds cached: all of it (the engine runs
    a turn's last sampled token through the model before the turn ends), in whole pages."""
    n_tokens = done["session_length"]
    return n_tokens - n_tokens % page_size


def session_turn(c: RawClient, session: str, content: str) -> dict[str, Any]:
    chunks, done = c.generate(
        session=session,
        input={"messages": [{"role": "user", "content": content}]},
        sampling={"max_tokens": 4, "temperature": 0, "ignore_eos": True},
        stream=True,
    )
    assert done["type"] == "done", done
    assert [t for ch in chunks for t in ch["token_ids"]] == done["token_ids"]
    assert done["session"] == session
    usage = done["usage"]
    assert done["session_length"] == usage["prompt_tokens"] + usage["completion_tokens"], done
    return done


def test_session_two_turns_and_fork(ready: RawClient) -> None:
    page = ready.welcome["page_size"]  # the tree caches whole pages only
    opened = ready.request({"type": "open_session"})
    assert opened["type"] == "session_opened", opened
    sid = opened["session"]
    assert isinstance(sid, str) and sid and opened["length"] == 0

    first = session_turn(ready, sid, "Hello there.")
    second = session_turn(ready, sid, "Tell me more.")
    # Turn 2's prompt is turn 1's whole history plus the new message, and that history
    # comes from the cache: nothing computed before is computed again.
    assert second["usage"]["prompt_tokens"] > first["session_length"]
    assert second["usage"]["cached_tokens"] == history_in_cache(first, page), (first, second)

    forked = ready.request({"type": "fork_session", "session": sid, "n": 2})
    assert forked["type"] == "sessions_forked", forked
    fork_ids = forked["sessions"]
    assert len(fork_ids) == 2 and len(set(fork_ids) | {sid}) == 3

    branch = session_turn(ready, fork_ids[0], "Another direction.")
    assert branch["usage"]["cached_tokens"] == history_in_cache(second, page), branch

    listed = ready.request({"type": "list_sessions"})
    assert listed["type"] == "session_list"
    lengths = {s["session"]: s["length"] for s in listed["sessions"]}
    assert lengths == {
        sid: second["session_length"],
        fork_ids[0]: branch["session_length"],
        fork_ids[1]: second["session_length"],
    }

    truncated = ready.request({"type": "truncate_session", "session": fork_ids[1], "length": 3})
    assert truncated["type"] == "ok", truncated
    assert ready.request({"type": "close_session", "session": sid})["type"] == "ok"
    closed = ready.request({"type": "close_session", "sessions": fork_ids})  # one request
    assert closed["type"] == "ok", closed
    assert ready.request({"type": "list_sessions"})["sessions"] == []
    assert_pool_clean(ready)


def test_a_fork_renders_its_next_message_as_its_parent_would(ready: RawClient) -> None:
    """Appended chat messages are rendered from how the history ends (an assistant turn
    left open, the model's last token): a fork's next turn must see exactly what its
    parent's does, so the same message costs the same tokens and samples the same."""
    sid = ready.request({"type": "open_session"})["session"]
    session_turn(ready, sid, "Hello there.")
    forks = ready.request({"type": "fork_session", "session": sid, "n": 2})["sessions"]
    on_fork = session_turn(ready, forks[0], "Go on.")
    on_parent = session_turn(ready, sid, "Go on.")
    assert on_fork["usage"]["prompt_tokens"] == on_parent["usage"]["prompt_tokens"]
    assert on_fork["token_ids"] == on_parent["token_ids"]
    assert ready.request({"type": "close_session", "sessions": [sid, *forks]})["type"] == "ok"
    assert_pool_clean(ready)


# --- errors ------------------------------------------------------------------------------


def test_errors_have_stable_codes(ready: RawClient) -> None:
    unknown = ready.request({"type": "close_session", "session": "no-such-session"})
    assert unknown["type"] == "error" and unknown["code"] == "not_found", unknown
    assert isinstance(unknown["message"], str) and unknown["message"]

    _, turn = ready.generate(session="no-such-session", input={"text": "hi"})
    assert turn["type"] == "error" and turn["code"] == "not_found", turn

    wrong_type = ready.request({"type": "teleport"})
    assert wrong_type["type"] == "error" and wrong_type["code"] == "unknown_type", wrong_type

    ready.send_bytes(b"\xc1 not msgpack")
    garbage = ready.recv()
    assert garbage["type"] == "error" and garbage["code"] == "bad_message", garbage
    assert garbage["rid"] is None

    _, bad = ready.generate(input={"text": "hi"}, sampling={"temperature": -1})
    assert bad["type"] == "error" and bad["code"] == "invalid_params", bad

    _, empty = ready.generate(input={"input_ids": []})
    assert empty["type"] == "error" and empty["code"] == "empty_prompt", empty
    assert_pool_clean(ready)
