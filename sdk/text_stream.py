"""`TextStream`: one streamed generation, read delta by delta (``client.stream(...)``).

Apart from client.py because a stream is its own object with its own life (iterated,
closed early, its results kept once it ends); the client only starts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from radixlm.runtime.protocol import Chunk, Done, Generate
from radixlm.runtime.transport.connection import Request
from radixlm.sdk.results import GenerateResult, StreamDelta, result_from_done

if TYPE_CHECKING:
    from radixlm.sdk.client import AsyncClient

__all__ = ["TextStream"]


class TextStream:
    """A streamed generation: iterate it for `StreamDelta`s; afterwards ``result`` (and
    ``results`` when ``n > 1``) hold the finished generation.

    Use it as an async context manager (``async with client.stream(...) as s``) so that
    leaving early aborts the generation in the engine.
    """

    def __init__(
        self,
        client: AsyncClient,
        msg: Generate,
        on_finish: Callable[[list[GenerateResult]], None] | None = None,
    ) -> None:
        self._client = client
        self._msg = msg
        self._on_finish = on_finish
        self._req: Request | None = None
        self._dones: list[Done] = []
        self._results: list[GenerateResult] | None = None

    @property
    def results(self) -> list[GenerateResult]:
        """Every branch's finished generation, by branch index (once the stream ended)."""
        if self._results is None:
            raise RuntimeError("the stream has not finished yet")
        return self._results

    @property
    def result(self) -> GenerateResult:
        """The finished generation (branch 0), once the stream ended."""
        return self.results[0]

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self._req is None:
            self._req = self._client.request(self._msg)
        req = self._req
        while not req.finished:
            try:
                reply = await req.receive()
            except BaseException:
                await self.aclose()
                raise
            if isinstance(reply, Chunk):
                return StreamDelta(reply.text, reply.token_ids, reply.index, reply.logprobs)
            if isinstance(reply, Done):
                self._dones.append(reply)
        if self._results is None:
            latency = time.perf_counter() - req.started_at
            self._dones.sort(key=lambda d: d.index)
            self._results = [result_from_done(d, latency) for d in self._dones]
            await self.aclose()
            if self._on_finish is not None:
                self._on_finish(self._results)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop the stream: a generation still running is aborted in the engine."""
        if self._req is not None:
            await self._req.aclose()

    async def __aenter__(self) -> TextStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
