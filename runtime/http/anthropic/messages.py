"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the engine.

A request with breakpoints, or streamed (its message_start counts the prompt before the
first token), is rendered and tokenized once (`prompt_cache.tokenize`: the engine's chat
template, with the tools) and the Generate carries those ids; its breakpoints' prefixes
are found in them, read from and written to the tenant's holds (`prompt_cache`). Any
other request sends its messages, as chat completions does. The reply is built from the
parts the frontend read (`reply.BlockWriter`). A non-streamed
reply with tools is read from the engine's stream too, so that text beside calls keeps
its place; without tools it is the Done's text.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from radixlm.runtime.http import generation, sse
from radixlm.runtime.http.anthropic import errors, prompt_cache
from radixlm.runtime.http.anthropic.convert import Converted, check_bounds, convert, sampling
from radixlm.runtime.http.anthropic.holds import Hold, common_prefix, pack
from radixlm.runtime.http.anthropic.prompt_cache import (
    CacheUsage,
    PromptCache,
    TenantCache,
    TokenizedPrompt,
)
from radixlm.runtime.http.anthropic.reply import BlockWriter, event, stop_reason
from radixlm.runtime.http.anthropic.schemas import MessagesRequest
from radixlm.runtime.http.anthropic.thinking import OPEN
from radixlm.runtime.http.context import HttpContext, request_body
from radixlm.runtime.http.errors import ApiError
from radixlm.runtime.http.tenants import Tenants
from radixlm.runtime.protocol import Chunk, Done, Generate, Input, Message
from radixlm.runtime.transport.errors import EngineError
from starlette.requests import Request
from starlette.responses import Response

_json = msgspec.json.Encoder()


class MessagesApi:
    """The routes, with the prompt cache they share (`cache`: every tenant's holds)."""

    def __init__(self, tenants: Tenants) -> None:
        self.cache = PromptCache(tenants)

    async def _forced_thinking(self, ctx: HttpContext) -> bool:
        """Whether the template's generation header opens a ``<think>`` block (the model
        then thinks from its first token): found once, from the header's text."""
        if self.cache.forced_thinking is None:
            probe = [Message(role="user", content="x")]
            with_header = await prompt_cache.tokens(ctx, probe, None, generation_prompt=True)
            without = await prompt_cache.tokens(ctx, probe, None, generation_prompt=False)
            header = with_header[common_prefix(pack(with_header), pack(without)):]
            try:
                text = await ctx.link.detokenize(header) if header else ""
            except EngineError:
                return False
            self.cache.forced_thinking = text.rstrip().endswith(OPEN)
        return self.cache.forced_thinking

    async def create(self, ctx: HttpContext, request: Request) -> Response:
        req = await request_body(ctx, request, MessagesRequest)
        ctx.check_model(req.model)
        check_bounds(req, ctx.config)
        conv = convert(req)
        params = sampling(req)
        tc = self.cache.of(ctx.tenant)
        forced = await self._forced_thinking(ctx)
        prompt: TokenizedPrompt | None = None
        found: list[Hold] = []
        inp = Input(messages=conv.prompt.messages)
        if req.stream or conv.breakpoints:  # (message_start counts the prompt before a token)
            prompt = await prompt_cache.tokenize(ctx, tc, req, conv)
            found = prompt_cache.candidates(tc, prompt)
            inp = Input(input_ids=prompt.ids)
        tools = conv.prompt.tools
        msg = Generate(rid=ctx.link.new_rid(), input=inp, sampling=params,
                       stream=bool(req.stream) or tools is not None, tools=tools,
                       tool_choice=conv.tool_choice, parallel_tool_calls=conv.parallel)
        turn = _Turn(ctx, tc, req, conv, prompt, found, forced)
        if req.stream:
            first, rest = await sse.first_then_rest(generation.replies(ctx, msg))
            return sse.EventStream(_errors_as_events(turn.stream(first, rest)),
                                   media_type="text/event-stream", headers=sse.HEADERS)
        writer = turn.writer(events=False)
        done = None
        if msg.stream:
            async with contextlib.aclosing(generation.replies(ctx, msg)) as replies:
                async for reply in replies:
                    if type(reply) is Chunk:
                        writer.feed(reply)
                    else:
                        done = reply
        else:
            done = (await generation.run(ctx, msg))[0]
            writer.feed_text(done.text)
        assert done is not None
        writer.finish(done)
        usage = await turn.settle(done)
        return Response(_json.encode(turn.message(writer.blocks, done, usage)),
                        media_type="application/json")

    async def count_tokens(self, ctx: HttpContext, request: Request) -> Response:
        """The prompt's tokens, as the chat template renders it with the tools (nothing
        is generated, nothing held)."""
        req = await request_body(ctx, request, MessagesRequest)
        ctx.check_model(req.model)
        check_bounds(req, ctx.config)
        prompt = convert(req).prompt
        ids = await prompt_cache.tokens(ctx, prompt.messages, prompt.tools,
                                        generation_prompt=True)
        return Response(_json.encode({"input_tokens": len(ids)}), media_type="application/json")


class _Turn:
    """One request being answered: what its reply and usage are made from."""

    def __init__(self, ctx: HttpContext, tc: TenantCache, req: MessagesRequest,
                 conv: Converted, prompt: TokenizedPrompt | None, found: list[Hold],
                 forced: bool) -> None:
        self.ctx, self.tc, self.req, self.conv = ctx, tc, req, conv
        self.prompt, self.found, self.forced = prompt, found, forced
        self.id = f"msg_{secrets.token_hex(12)}"

    def writer(self, *, events: bool) -> BlockWriter:
        return BlockWriter(forced_thinking=self.forced, show_thinking=self.conv.thinking_shown,
                           events=events)

    async def settle(self, done: Done) -> CacheUsage:
        if self.prompt is None:  # no breakpoint: nothing read or written
            return CacheUsage(done.usage.prompt_tokens, 0)
        return await prompt_cache.settle(self.tc, self.prompt, self.found,
                                         done.usage.cached_tokens)

    def _stop(self, done: Done) -> tuple[str, str | None]:
        assert self.req.max_tokens is not None
        return stop_reason(done, self.req.stop_sequences or [], self.req.max_tokens)

    def message(self, blocks: list[dict[str, Any]], done: Done | None,
                usage: dict[str, Any] | CacheUsage) -> dict[str, Any]:
        reason, sequence = self._stop(done) if done is not None else (None, None)
        if isinstance(usage, CacheUsage):
            usage = usage.json(done.usage.completion_tokens if done is not None else 0)
        return {"id": self.id, "type": "message", "role": "assistant", "content": blocks,
                "model": self.ctx.model_name, "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage}

    async def stream(self, first: Chunk | Done, rest: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        """Anthropic's events: message_start (the usage the read and writes will have),
        ping, each block's start / deltas / stop, message_delta (the stop reason, and the
        usage as it turned out), message_stop."""
        writer = self.writer(events=True)
        assert self.prompt is not None
        try:
            start = self.message([], None, prompt_cache.predict(self.prompt, self.found))
            yield event("message_start", {"message": start})
            yield event("ping", {})
            reply: Any = first
            done = None
            while True:
                if type(reply) is Chunk:
                    for data in writer.feed(reply):
                        yield data
                else:
                    done = reply
                try:
                    reply = await rest.__anext__()
                except StopAsyncIteration:
                    break
            assert done is not None
            for data in writer.finish(done):
                yield data
            usage = (await self.settle(done)).json(done.usage.completion_tokens)
            del usage["cache_creation"], usage["service_tier"]
            reason, sequence = self._stop(done)
            yield event("message_delta", {"delta": {"stop_reason": reason,
                                                    "stop_sequence": sequence}, "usage": usage})
            yield event("message_stop", {})
        finally:
            await rest.aclose()  # type: ignore[attr-defined]


async def _errors_as_events(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An error after the first event (the engine went away) as Anthropic's error event."""
    try:
        async for data in body:
            yield data
    except ApiError as e:
        yield errors.event(e)
    finally:
        await body.aclose()  # type: ignore[attr-defined]
