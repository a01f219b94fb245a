"""docs/protocol.md keeps up with runtime/protocol.py.

Every message type, every field of every wire struct and every error code must be
documented, and every message of the worked exchange must be a valid message in its
direction. The exchange was captured from a live server by docs/worked_exchange.py; the
same script runs here against the test server, and the page must show the same frames
(types, request ids, fields, error codes) and the same cache behaviour: every session
turn finds its session's whole history cached.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
from radixlm.runtime import protocol

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
EXCHANGE_SCRIPT = DOC.with_name("worked_exchange.py")
WIRE_STRUCTS = [
    protocol.Message, protocol.SamplingParams, protocol.Input, protocol.TopLogprob,
    protocol.Usage, protocol.SessionInfo, protocol.Tool, protocol.ToolCall,
    protocol.NamedToolChoice,
    *protocol.ClientMessage.__args__, *protocol.ServerMessage.__args__,
]  # fmt: skip


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


def test_every_message_type_has_a_section_or_row(doc: str) -> None:
    for struct in (*protocol.ClientMessage.__args__, *protocol.ServerMessage.__args__):
        tag = struct.__struct_config__.tag
        assert f"`{tag}`" in doc, f"docs/protocol.md does not mention message type {tag!r}"


@pytest.mark.parametrize("struct", WIRE_STRUCTS, ids=lambda s: s.__name__)
def test_every_field_is_documented(doc: str, struct: type[msgspec.Struct]) -> None:
    missing = [f for f in struct.__struct_fields__ if f"`{f}`" not in doc]
    assert not missing, f"{struct.__name__} fields missing from docs/protocol.md: {missing}"


def test_every_error_code_has_a_row(doc: str) -> None:
    codes = [v for k, v in vars(protocol.ErrorCode).items() if not k.startswith("_")]
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", doc, flags=re.MULTILINE))
    assert set(codes) <= rows, f"error codes without a row: {set(codes) - rows}"


def test_version_matches(doc: str) -> None:
    assert f"Protocol version: **{protocol.PROTOCOL_VERSION}**" in doc


def test_worked_exchange_messages_are_valid(doc: str) -> None:
    """Lines `C: {...}` (client to server) and `S: {...}` (server to client) in the
    exchange decode as protocol messages of their direction, except a client message
    the server answers with `bad_message` (the exchange shows one on purpose)."""
    exchange = doc.split("## A worked exchange", 1)[1]
    lines = re.findall(r"^([CS]): (\{.*\})$", exchange, flags=re.MULTILINE)
    assert len(lines) >= 20, "the worked exchange is missing"
    seen = set()
    refused: str | None = None  # rid of a client message the decoder refused
    for direction, text in lines:
        message = json.loads(text)
        if direction == "C":
            assert refused is None, f"client message {refused!r} got no bad_message reply"
            try:
                protocol.decode_client(msgpack.packb(message))
            except msgspec.ValidationError:
                refused = message["rid"]
        else:
            reply = protocol.decode_server(msgpack.packb(message))
            if refused is not None:
                assert isinstance(reply, protocol.Error), reply
                assert (reply.rid, reply.code) == (refused, protocol.ErrorCode.BAD_MESSAGE)
                refused = None
        seen.add((direction, message["type"]))
    for wanted in [
        ("C", "hello"),
        ("S", "welcome"),
        ("C", "generate"),
        ("S", "chunk"),
        ("S", "done"),
        ("C", "open_session"),
        ("S", "session_opened"),
        ("C", "fork_session"),
        ("S", "sessions_forked"),
        ("S", "error"),
    ]:
        assert wanted in seen, f"the worked exchange has no {wanted}"


def documented_frames(doc: str) -> list[tuple[str, Any]]:
    """The worked exchange's frames, as (direction, decoded map or raw bytes)."""
    exchange = doc.split("## A worked exchange", 1)[1]
    frames: list[tuple[str, Any]] = []
    for direction, text in re.findall(r"^([CS]): (.*)$", exchange, flags=re.MULTILINE):
        raw = re.fullmatch(r"<the \d+ bytes ([0-9a-f ]+): not msgpack>", text)
        frames.append((direction, bytes.fromhex(raw[1]) if raw else json.loads(text)))
    return frames


def structure(frames: list[tuple[str, Any]]) -> list[tuple[Any, ...]]:
    """What must not change between runs: each frame's direction, type, rid, fields and
    error code (a run of chunks counts once: tokens per chunk depend on the model)."""
    out: list[tuple[Any, ...]] = []
    for direction, m in frames:
        if isinstance(m, bytes):
            out.append((direction, "not msgpack"))
            continue
        fields = tuple(sorted(set(m) - {"matched_stop"}))  # present only when a stop matched
        key = (direction, m["type"], m.get("rid"), fields, m.get("code"))
        if not (m["type"] == "chunk" and out and out[-1] == key):
            out.append(key)
    return out


def whole_history_turns(frames: list[tuple[str, Any]]) -> int:
    """Check that every turn on a session found the session's whole history cached
    (`cached_tokens` == its length before the turn); returns how many turns there were."""
    length: dict[str, int] = {}
    forked_from = None
    turns = 0
    for direction, m in frames:
        if isinstance(m, bytes):
            continue
        if direction == "C" and m["type"] == "fork_session":
            forked_from = m["session"]
        elif m["type"] == "session_opened":
            length[m["session"]] = m["length"]
        elif m["type"] == "sessions_forked":
            length.update((sid, length[forked_from]) for sid in m["sessions"])
        elif m["type"] == "done" and "session" in m:
            assert m["usage"]["cached_tokens"] == length[m["session"]], m
            length[m["session"]] = m["session_length"]
            turns += 1
    return turns


def test_worked_exchange_matches_a_live_run(doc: str, server: Any) -> None:
    spec = importlib.util.spec_from_file_location("worked_exchange", EXCHANGE_SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    # From an empty cache, as on the page's fresh server: on this shared server, other
    # tests' prompts could otherwise be cached beyond a turn's history.
    with server.client() as c:
        assert isinstance(c.call(protocol.FlushCache(rid="flush")), protocol.Ok)
    live = script.exchange(server.endpoint)
    documented = documented_frames(doc)
    assert structure(live) == structure(documented)
    assert whole_history_turns(documented) == whole_history_turns(live) == 3
