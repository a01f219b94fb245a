"""Running a Generate for a route: to its end, or streamed reply by reply.

A streamed generation is aborted in the engine when its consumer stops early (the HTTP
client disconnected: the server cancels the response's task), so nothing is left running.
A streamed chunk is read as the frontend read it (`parts`): its text outside tool calls
and the pieces of calls, in the order the model wrote them; the routes render these, and
nothing here parses the output again.
The time between a stream's tokens goes to the metrics here; the engine measures
every request's own timings (queue, first token, end to end) and finish reasons.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Union

from radixlm.runtime.http.context import HttpContext
from radixlm.runtime.http.errors import from_engine
from radixlm.runtime.protocol import CallDelta, Chunk, Done, Generate
from radixlm.runtime.transport.errors import EngineError


async def run(ctx: HttpContext, msg: Generate) -> list[Done]:
    """One Done per branch (by index); engine refusals become `ApiError`s."""
    try:
        return await ctx.link.run_generate(msg)
    except EngineError as e:
        raise from_engine(e) from None


async def replies(ctx: HttpContext, msg: Generate) -> AsyncIterator[Union[Chunk, Done]]:
    """The Chunks and Dones of a streamed Generate (``msg.stream`` must be set)."""
    last: Union[float, None] = None
    itl = ctx.metrics.itl.labels(ctx.model_name)
    try:
        req = ctx.link.request(msg)
    except EngineError as e:
        raise from_engine(e) from None
    try:
        while not req.finished:
            try:
                reply = await req.receive()
            except EngineError as e:
                raise from_engine(e) from None
            if type(reply) is Chunk:
                t = time.perf_counter()
                if last is not None:
                    itl.observe(t - last)
                last = t
            yield reply  # type: ignore[misc]
    finally:
        if not req.finished:
            ctx.metrics.aborted.inc()
        await req.aclose()  # aborts it in the engine if it has not finished


Part = Union[str, CallDelta]  # content text, or a piece of a call


def parts(chunk: Chunk) -> Iterator[Part]:
    """`chunk.content` cut where its call pieces sit (each at its `at`), in order. A chunk
    whose calls are not read (no `content`) is its text."""
    content = chunk.content
    if content is None:
        if chunk.text:
            yield chunk.text
        return
    pos = 0
    for piece in chunk.tool_calls or ():
        if piece.at > pos:
            yield content[pos:piece.at]
            pos = piece.at
        yield piece
    if pos < len(content):
        yield content[pos:]
