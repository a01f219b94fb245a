"""Client frames -> protocol messages, or the error a frame that is none deserves.

`protocol.decode_client` decides what is a valid message. For a frame it refuses, the
reply still names the request when it can: a frame that is a msgpack map with a string
``"rid"`` gets its rid back, and one whose ``"type"`` is not a message type gets
``unknown_type`` rather than ``bad_message``.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec
from radixlm.runtime.protocol import CLIENT_TYPES, ClientMessage, ErrorCode, decode_client

# The top level of a frame only: values stay undecoded (msgspec still walks them to find
# their ends, and gives up on hostile nesting with a RecursionError).
_top_level = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_string = msgspec.msgpack.Decoder(str)


class FrameError(NamedTuple):
    rid: str | None
    code: str
    message: str


def decode_frame(data: bytes) -> ClientMessage | FrameError:
    try:
        return decode_client(data)
    except (msgspec.DecodeError, RecursionError) as e:
        return _classify(data, e)


def _classify(data: bytes, err: Exception) -> FrameError:
    if isinstance(err, RecursionError):
        return FrameError(None, ErrorCode.BAD_MESSAGE, "message nested too deeply")
    if not isinstance(err, msgspec.ValidationError):  # (itself a DecodeError)
        return FrameError(None, ErrorCode.BAD_MESSAGE, f"not a msgpack message: {err}")
    try:
        fields = _top_level.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return FrameError(None, ErrorCode.BAD_MESSAGE,
                          f"a message is one msgpack map with string keys: {err}")
    rid = _field_text(fields, "rid")
    kind = _field_text(fields, "type")
    if kind is None:
        return FrameError(rid, ErrorCode.BAD_MESSAGE, f'message has no string "type" field: {err}')
    if kind not in CLIENT_TYPES:
        return FrameError(rid, ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}")
    return FrameError(rid, ErrorCode.BAD_MESSAGE, f"invalid {kind!r} message: {err}")


def _field_text(fields: dict[str, msgspec.Raw], name: str) -> str | None:
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        return _string.decode(raw)
    except msgspec.DecodeError:
        return None
