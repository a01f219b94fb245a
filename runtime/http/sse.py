"""Server-sent events: the streaming response, and starting a stream so that an error in
its first reply still gets its own HTTP status (not a 200 with an error event)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from radixlm.runtime.http.errors import ApiError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def data(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def event(kind: str, obj: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _json.encode(obj) + b"\n\n"


class EventStream(StreamingResponse):
    """A streaming response that stops -- closing its body, which aborts the generation
    behind it -- as soon as the client disconnects, even while no event is being written
    (a long prefill, a reply held back until its end)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body: Any = self.body_iterator
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                with contextlib.suppress(OSError):  # the client went away while we wrote
                    await self.stream_response(send)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await body.aclose()

    @staticmethod
    async def _watch(receive: Receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()


def response(body: AsyncIterator[bytes], *, error_event: bool = False) -> StreamingResponse:
    """The event stream of `body`. An error after the first event (the engine went away)
    can no longer change the status: it is sent as a last event, OpenAI's error object
    (``event: error`` in the Responses API's format with `error_event`), then the end."""
    return EventStream(_errors_as_events(body, error_event), media_type="text/event-stream",
                       headers=HEADERS)


async def _errors_as_events(body: AsyncIterator[bytes], error_event: bool) -> AsyncIterator[bytes]:
    try:
        async for chunk in body:
            yield chunk
    except ApiError as e:
        if error_event:
            err = e.body()["error"]
            yield event("error", {"type": "error", "code": err["code"],
                                  "message": err["message"], "param": err["param"]})
        else:
            yield data(e.body())
    finally:
        await body.aclose()  # type: ignore[attr-defined]


async def first_then_rest(replies: AsyncIterator[Any]) -> tuple[Any, AsyncIterator[Any]]:
    """Await the first item now (its error raises here, before any byte is sent)."""
    try:
        first = await replies.__anext__()
    except BaseException:
        await replies.aclose()  # type: ignore[attr-defined]
        raise
    return first, replies
