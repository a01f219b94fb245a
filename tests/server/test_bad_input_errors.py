"""Every bad input gets its stable error code, and the server keeps serving: each bad
request is followed by a good one on the same connection, which must succeed. Runs
against the real server (engine + frontend) on the tiny model; the pool is checked
after every test."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Done,
    Error,
    ErrorCode,
    Generate,
    GetStats,
    Hello,
    Input,
    SamplingParams,
    Welcome,
)
from radixlm.runtime.transport.raw_client import RawClient

GOOD = {"type": "generate", "input": {"input_ids": [5, 6, 7]},
        "sampling": {"max_tokens": 2, "temperature": 0, "ignore_eos": True}}


def good_request_succeeds(client: RawClient) -> None:
    rid = client.new_rid("good")
    client.send_raw(msgpack.packb({**GOOD, "rid": rid}))
    done = client.recv_for(rid)
    assert isinstance(done, Done) and len(done.token_ids) == 2, done


def gen(**fields: Any) -> dict[str, Any]:
    return {"type": "generate", "input": {"text": "Hello there"}, **fields}


BAD_FRAMES: list[tuple[str, bytes | dict[str, Any], str]] = [
    ("not-msgpack", b"\xc1\xc1 garbage", ErrorCode.BAD_MESSAGE),
    ("not-a-map", msgpack.packb([1, 2, 3]), ErrorCode.BAD_MESSAGE),
    ("unknown-type", {"type": "teleport"}, ErrorCode.UNKNOWN_TYPE),
    ("missing-field", {"type": "generate"}, ErrorCode.BAD_MESSAGE),
    ("wrong-field-type", gen(n="two"), ErrorCode.BAD_MESSAGE),
    ("negative-temperature", gen(sampling={"temperature": -1.0}), ErrorCode.INVALID_PARAMS),
    ("top-p-zero", gen(sampling={"top_p": 0.0}), ErrorCode.INVALID_PARAMS),
    ("top-p-above-one", gen(sampling={"top_p": 1.5}), ErrorCode.INVALID_PARAMS),
    ("negative-max-tokens", gen(sampling={"max_tokens": -1}), ErrorCode.INVALID_PARAMS),
    ("n-zero", gen(n=0), ErrorCode.INVALID_PARAMS),
    ("n-too-many", gen(n=65), ErrorCode.INVALID_PARAMS),
    ("two-inputs", gen(input={"text": "a", "input_ids": [5]}), ErrorCode.INVALID_PARAMS),
    ("id-past-vocab", gen(input={"input_ids": [5, 1_000_000]}), ErrorCode.INVALID_PARAMS),
    ("empty-text", gen(input={"text": ""}), ErrorCode.EMPTY_PROMPT),
    ("empty-ids", gen(input={"input_ids": []}), ErrorCode.EMPTY_PROMPT),
    ("too-long", gen(input={"input_ids": [5] * 200}, sampling={"max_tokens": 100}), ErrorCode.TOO_LONG),
    ("abort-unknown", {"type": "abort"}, ErrorCode.NOT_FOUND),
    ("unknown-session", gen(session="no-such-session"), ErrorCode.NOT_FOUND),
    ("fork-zero", {"type": "fork_session", "session": "x", "n": 0}, ErrorCode.INVALID_PARAMS),
    ("fork-too-many", {"type": "fork_session", "session": "x", "n": 65},
     ErrorCode.INVALID_PARAMS),
    ("close-naming-nothing", {"type": "close_session"}, ErrorCode.INVALID_PARAMS),
    ("close-too-many", {"type": "close_session", "sessions": ["x"] * 1025},
     ErrorCode.INVALID_PARAMS),
    ("two-grammars", gen(sampling={"regex": "a+", "ebnf": 'root ::= "a"'}),
     ErrorCode.INVALID_PARAMS),
    ("unknown-tool-choice-mode", gen(tool_choice="always"), ErrorCode.BAD_MESSAGE),
    ("tool-choice-names-no-tool", gen(tools=[{"name": "f"}], tool_choice={"name": "g"}),
     ErrorCode.INVALID_PARAMS),
    ("tools-not-json-schema", gen(tools=[{"name": "f", "parameters": {"type": "object",
                                  "properties": {"x": {"type": "text"}}}}]), ErrorCode.INVALID_PARAMS),
    ("required-without-tools", gen(tool_choice="required"), ErrorCode.INVALID_PARAMS),
    ("message-without-content", gen(input={"messages": [{"role": "user"}]}),
     ErrorCode.INVALID_PARAMS),
    ("close-unknown-among", {"type": "close_session", "sessions": ["a", "b"]},
     ErrorCode.NOT_FOUND),
    ("branches-without-output", gen(n=2, sampling={"max_tokens": 0}), ErrorCode.INVALID_PARAMS),
    ("pin-without-name", {"type": "pin", "name": "", "input": {"text": "x"}},
     ErrorCode.INVALID_PARAMS),
    ("pin-empty-input", {"type": "pin", "name": "p", "input": {"text": ""}},
     ErrorCode.EMPTY_PROMPT),
    ("logprobs-start-past-input", gen(input={"input_ids": [5, 6]}, prompt_logprobs_start=3),
     ErrorCode.INVALID_PARAMS),
]


@pytest.mark.parametrize(("frame", "code"), [(f, c) for _, f, c in BAD_FRAMES],
                         ids=[name for name, _, _ in BAD_FRAMES])
def test_bad_input_then_good_request(raw_client: RawClient, frame: bytes | dict[str, Any],
                                     code: str) -> None:
    if isinstance(frame, dict):
        rid = raw_client.new_rid("bad")
        raw_client.send_raw(msgpack.packb({**frame, "rid": rid}))
    else:
        rid = None  # the server cannot know a rid it cannot read
        raw_client.send_raw(frame)
    reply = raw_client.recv_for(rid)
    assert isinstance(reply, Error), reply
    assert reply.code == code and reply.message, reply
    good_request_succeeds(raw_client)


def test_handshake_is_required_then_works(server: Any) -> None:
    with server.client(handshake=False, timeout_s=30) as c:
        reply = c.request(GetStats(rid="early"))
        assert isinstance(reply, Error) and reply.code == ErrorCode.HANDSHAKE_REQUIRED
        assert reply.rid == "early"
        c.send(Hello(protocol_version=PROTOCOL_VERSION + 1))
        reply = c.recv_for(None)
        assert isinstance(reply, Error) and reply.code == ErrorCode.UNSUPPORTED_VERSION, reply
        assert isinstance(c.hello(), Welcome)
        good_request_succeeds(c)


def test_duplicate_rid_in_flight(raw_client: RawClient) -> None:
    slow = Generate(rid="twin", input=Input(input_ids=[5, 6, 7]),
                    sampling=SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    raw_client.send(slow)
    raw_client.send(slow)
    second = raw_client.recv_for("twin")
    assert isinstance(second, Error) and second.code == ErrorCode.DUPLICATE_ID, second
    raw_client.send(Abort(rid="twin"))
    done = raw_client.recv_for("twin")
    assert isinstance(done, Done) and done.finish_reason in ("abort", "length"), done
    # Once it ended the rid is free again, and an abort of it is now unknown.
    reply = raw_client.request(Abort(rid="twin"))
    assert isinstance(reply, Error) and reply.code == ErrorCode.NOT_FOUND
    good_request_succeeds(raw_client)
