"""Server-sent events: the streaming response, and starting a stream so that an error in
its first reply still gets its own HTTP status (not a 200 with an error event)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.responses import StreamingResponse

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def data(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def event(kind: str, obj: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode(obj) + b"\n\n"


def response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=HEADERS)


async def first_then_rest(replies: AsyncIterator[Any]) -> tuple[Any, AsyncIterator[Any]]:
    """Await the first item now (its error raises here, before any byte is sent)."""
    try:
        first = await replies.__anext__()
    except BaseException:
        await replies.aclose()  # type: ignore[attr-defined]
        raise
    return first, replies
