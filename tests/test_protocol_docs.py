"""docs/protocol.md keeps up with runtime/protocol.py.

Every message type, every field of every wire struct and every error code must be
documented, and every message of the worked exchange must be a valid message in its
direction (the exchange itself was captured from a live server; see the page).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgpack
import msgspec
import pytest
from radixlm.runtime import protocol

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
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
