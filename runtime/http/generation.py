"""Running a Generate for a route: to its end, or streamed reply by reply.

A streamed generation is aborted in the engine when its consumer stops early (the HTTP
client disconnected: the server cancels the response's task), so nothing is left running.
Latency (end to end; first token and between tokens when streamed) and finish reasons
go to the metrics here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Union

from radixlm.runtime.http.context import HttpContext
from radixlm.runtime.http.errors import from_engine
from radixlm.runtime.protocol import Chunk, Done, Generate
from radixlm.runtime.transport.errors import EngineError


def count(ctx: HttpContext, dones: list[Done], started: float) -> None:
    """A generation's end: its latency and finish reasons (the token counters are the
    engine's own, read at each scrape)."""
    if not dones:
        return
    m, model = ctx.metrics, ctx.model_name
    m.e2e.labels(model).observe(time.perf_counter() - started)
    for d in dones:
        m.finished.labels(model, d.finish_reason).inc()


async def run(ctx: HttpContext, msg: Generate) -> list[Done]:
    """One Done per branch (by index); engine refusals become `ApiError`s."""
    started = time.perf_counter()
    try:
        dones = await ctx.link.generate(msg)
    except EngineError as e:
        raise from_engine(e) from None
    count(ctx, dones, started)
    return dones


async def replies(ctx: HttpContext, msg: Generate) -> AsyncIterator[Union[Chunk, Done]]:
    """The Chunks and Dones of a streamed Generate (``msg.stream`` must be set)."""
    started = last = time.perf_counter()
    first = True
    ttft, itl = ctx.metrics.ttft.labels(ctx.model_name), ctx.metrics.itl.labels(ctx.model_name)
    try:
        req = ctx.link.start(msg)
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
                if first:
                    ttft.observe(t - started)
                    first = False
                else:
                    itl.observe(t - last)
                last = t
            yield reply  # type: ignore[misc]
        count(ctx, req.dones, started)
    finally:
        if not req.finished:
            ctx.metrics.aborted.inc()
        await req.aclose()  # aborts it in the engine if it has not finished
