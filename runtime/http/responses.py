"""/v1/responses: OpenAI's Responses API on engine sessions.

Each stored response is an engine session holding that response's whole history (input
and output) token-exactly. ``previous_response_id`` forks that session and appends only
the new input: nothing is re-rendered or re-tokenized and the whole history is a
prefix-cache hit (``usage.input_tokens_details.cached_tokens``). Any number of responses
may continue the same previous one. ``store: false`` keeps nothing. A response unused
for ``--response-ttl`` seconds expires (its session is closed): its id then gets 404.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from radixlm.runtime.http import convert, generation, sse, turns
from radixlm.runtime.http.context import HttpContext, decode_body, now, read_body
from radixlm.runtime.http.errors import invalid
from radixlm.runtime.http.schemas import ResponsesRequest
from radixlm.runtime.protocol import Chunk, Done, Generate, Input
from starlette.requests import Request
from starlette.responses import Response

_json = msgspec.json.Encoder()


def usage_json(done: Done) -> dict[str, Any]:
    u = done.usage
    details: dict[str, Any] = {"cached_tokens": u.cached_tokens}
    if u.recomputed_tokens:  # a demoted history, partly evicted, was computed again
        details["recomputed_tokens"] = u.recomputed_tokens
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": details,
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def output_items(done: Done, msg_id: str) -> list[dict[str, Any]]:
    if done.tool_calls:
        return [{"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": c.id,
                 "name": c.name, "arguments": c.arguments, "status": "completed"}
                for c in done.tool_calls]
    return [message_item(msg_id, done.text, "completed")]


def message_item(msg_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Shape:
    """The fields of a response object that come from its request."""

    def __init__(self, ctx: HttpContext, req: ResponsesRequest, rid: str, max_tokens: int) -> None:
        self.base = {
            "id": rid, "object": "response", "created_at": now(), "model": ctx.model_name,
            "instructions": req.instructions, "previous_response_id": req.previous_response_id,
            "max_output_tokens": max_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": True, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": "auto", "tools": [msgspec.to_builtins(t) for t in req.tools or []],
            "text": {"format": msgspec.to_builtins(req.text.format) if req.text and req.text.format
                     else {"type": "text"}},
            "store": req.store is not False, "truncation": "disabled", "user": req.user,
            "error": None, "incomplete_details": None, "reasoning": None,
        }

    def build(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              incomplete: str | None = None) -> dict[str, Any]:
        out = {**self.base, "status": status, "output": output, "usage": usage}
        if incomplete:
            out["incomplete_details"] = {"reason": incomplete}
        return out

    def final(self, done: Done, msg_id: str) -> dict[str, Any]:
        length = done.finish_reason == "length" and not done.tool_calls
        return self.build("incomplete" if length else "completed", output_items(done, msg_id),
                          usage_json(done), "max_output_tokens" if length else None)


async def create(ctx: HttpContext, request: Request) -> Response:
    req = decode_body(await read_body(request, ctx.config.max_body_bytes), ResponsesRequest)
    ctx.check_model(req.model)
    keep = req.store is not False
    messages = convert.response_input(req.input, req.instructions)
    tools, tool_choice = convert.response_tools(req.tools, req.tool_choice)
    fmt = req.text.format if req.text else None
    if req.top_logprobs:
        raise invalid("top_logprobs is not supported on /v1/responses (use chat completions)",
                      "top_logprobs")
    max_tokens = convert.max_tokens_of(req.max_output_tokens, ctx.default_max_tokens(),
                                       "max_output_tokens")
    sampling = convert.sampling(req, max_tokens=max_tokens, stop=[],
                                json_schema=convert.text_json_schema(fmt))
    turn = await turns.begin(ctx, req.previous_response_id, fork=True, keep=keep, kind="response")
    rid, msg_id = f"resp_{secrets.token_hex(16)}", f"msg_{secrets.token_hex(12)}"
    shape = _Shape(ctx, req, rid, max_tokens)
    msg = Generate(rid=ctx.link.rid(), input=Input(messages=messages), sampling=sampling,
                   stream=bool(req.stream), session=turn.session, tools=tools,
                   tool_choice=tool_choice)
    if req.stream:
        try:
            first, rest = await sse.first_then_rest(generation.replies(ctx, msg))
        except BaseException:
            turns.finish(ctx, turn, None, rid)
            raise
        return sse.response(_stream(ctx, shape, msg_id, first, rest, turn, tools is not None),
                            error_event=True)
    done = None
    try:
        done = (await generation.run(ctx, msg))[0]
    finally:
        entry = turns.finish(ctx, turn, done, rid)
    body = shape.final(done, msg_id)
    if entry is not None:
        entry.body = body
    return Response(_json.encode(body), media_type="application/json")


async def _stream(ctx: HttpContext, shape: _Shape, msg_id: str, first: Chunk | Done,
                  rest: AsyncIterator[Any], turn: turns.Turn, tools: bool) -> AsyncIterator[bytes]:
    """The Responses API's streaming events, from response.created to response.completed.
    With tools the text is held back until it is known to be a reply or function calls."""
    seq = 0

    def emit(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return sse.event(kind, {"type": kind, "sequence_number": seq - 1, **fields})

    done = None
    try:
        yield emit("response.created", response=shape.build("in_progress", [], None))
        yield emit("response.in_progress", response=shape.build("in_progress", [], None))
        if not tools:
            yield emit("response.output_item.added", output_index=0,
                       item=message_item(msg_id, None, "in_progress"))
            yield emit("response.content_part.added", item_id=msg_id, output_index=0,
                       content_index=0, part=_text_part(""))
        reply = first
        while True:
            if type(reply) is Chunk:
                if not tools and reply.text:
                    yield emit("response.output_text.delta", item_id=msg_id, output_index=0,
                               content_index=0, delta=reply.text, logprobs=[])
            else:
                done = reply
            try:
                reply = await rest.__anext__()
            except StopAsyncIteration:
                break
        assert done is not None
        final = shape.final(done, msg_id)
        entry = turns.finish(ctx, turn, done, shape.base["id"])
        if entry is not None:
            entry.body = final
        for index, item in enumerate(final["output"]):
            if tools:
                yield emit("response.output_item.added", output_index=index,
                           item={**item, "status": "in_progress"})
            if item["type"] == "message":
                if tools:
                    yield emit("response.content_part.added", item_id=msg_id, output_index=index,
                               content_index=0, part=_text_part(""))
                    yield emit("response.output_text.delta", item_id=msg_id, output_index=index,
                               content_index=0, delta=done.text, logprobs=[])
                yield emit("response.output_text.done", item_id=msg_id, output_index=index,
                           content_index=0, text=done.text, logprobs=[])
                yield emit("response.content_part.done", item_id=msg_id, output_index=index,
                           content_index=0, part=_text_part(done.text))
            else:
                yield emit("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, arguments=item["arguments"], name=item["name"])
            yield emit("response.output_item.done", output_index=index, item=item)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield emit(kind, response=final)
    finally:
        if done is None:
            turns.finish(ctx, turn, None, "")
        await rest.aclose()  # type: ignore[attr-defined]


async def get(ctx: HttpContext, request: Request) -> Response:
    rid = request.path_params["response_id"]
    entry = ctx.store.get(rid)
    if entry is None or entry.body is None:
        raise turns.unknown("response", rid)
    return Response(_json.encode(entry.body), media_type="application/json")


async def delete(ctx: HttpContext, request: Request) -> Response:
    rid = request.path_params["response_id"]
    entry = ctx.store.get(rid)
    if entry is None or entry.body is None or not ctx.store.delete(rid):
        raise turns.unknown("response", rid)
    return Response(_json.encode({"id": rid, "object": "response", "deleted": True}),
                    media_type="application/json")
