"""POST /v1/chat/completions: OpenAI chat completions, streamed or not, with radixlm's
``session`` extension (a conversation held in the engine between calls)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from radixlm.runtime.http import convert, generation, sse, turns
from radixlm.runtime.http.context import HttpContext, now, program_of, request_body
from radixlm.runtime.http.errors import invalid
from radixlm.runtime.http.logprobs import chat_content
from radixlm.runtime.http.schemas import ChatCompletionRequest
from radixlm.runtime.http.store import Stored, new_id
from radixlm.runtime.protocol import Chunk, Done, Generate, Input
from starlette.requests import Request
from starlette.responses import Response

_json = msgspec.json.Encoder()


def finish_reason(done: Done) -> str:
    if done.tool_calls:
        return "tool_calls"
    return "length" if done.finish_reason == "length" else "stop"


def tool_calls_json(done: Done) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in done.tool_calls or []]


def usage_json(dones: list[Done]) -> dict[str, Any]:
    u = dones[0].usage
    completion = sum(d.usage.completion_tokens for d in dones)
    details: dict[str, Any] = {"cached_tokens": u.cached_tokens}
    if u.recomputed_tokens:
        details["recomputed_tokens"] = u.recomputed_tokens
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
            "total_tokens": u.prompt_tokens + completion, "prompt_tokens_details": details}


def session_json(entry: Stored | None) -> dict[str, Any] | None:
    return None if entry is None else {"id": entry.id, "length": entry.length}


async def chat_completions(ctx: HttpContext, request: Request) -> Response:
    req = await request_body(ctx, request, ChatCompletionRequest)
    ctx.check_model(req.model)
    n = convert.n_of(req.n)
    if req.top_logprobs and not req.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    if req.session is not None and n != 1:
        raise invalid("n > 1 cannot be combined with session", "n")
    tools, tool_choice = convert.chat_tools(req.tools, req.tool_choice)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = convert.sampling(
        req, max_tokens=convert.max_tokens_of(max_tokens, ctx.default_max_tokens(), "max_tokens"),
        stop=convert.stop_list(req.stop), logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0, json_schema=convert.chat_json_schema(req.response_format))
    messages = convert.chat_messages(req.messages)
    parallel = req.parallel_tool_calls is not False
    spec = req.session
    turn = turns.Turn(None, keep=False)
    if spec is not None:
        turn = await turns.begin(ctx, spec.id, fork=spec.fork, keep=True, kind="session",
                                 messages=messages)
        messages = [*turn.replay, *messages]  # (the stored ones again: the engine lost them)
    msg = Generate(rid=ctx.link.new_rid(), input=Input(messages=messages), sampling=sampling,
                   stream=bool(req.stream), session=turn.session, n=n, tools=tools,
                   tool_choice=tool_choice, parallel_tool_calls=parallel,
                   logprob_texts=bool(req.logprobs), program=program_of(request))
    cid = f"chatcmpl-{secrets.token_hex(12)}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            first, rest = await sse.first_then_rest(generation.replies(ctx, msg))
        except BaseException:
            turns.finish(ctx, turn, None, "")
            raise
        return sse.response(_stream(ctx, cid, first, rest, n, include_usage, turn))
    done = None
    try:
        dones = await generation.run(ctx, msg)
        done = dones[0]
    finally:
        entry = turns.finish(ctx, turn, done, new_id("sess"))
    if spec is not None:
        await ctx.store.flush()  # the session's turn is on disk before the reply says so
    body = {
        "id": cid, "object": "chat.completion", "created": now(), "model": ctx.model_name,
        "choices": [_choice(ctx, d, bool(req.logprobs)) for d in dones],
        "usage": usage_json(dones),
    }
    if spec is not None:
        body["session"] = session_json(entry)
    return Response(_json.encode(body), media_type="application/json")


def _choice(ctx: HttpContext, done: Done, logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": done.text}
    if done.tool_calls:
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls_json(done)}
    lp = None
    if logprobs:
        lp = {"content": chat_content(done.token_texts, done.token_ids, done.logprobs,
                                      done.top_logprobs)}
    return {"index": done.index, "message": message, "logprobs": lp,
            "finish_reason": finish_reason(done)}


async def _stream(ctx: HttpContext, cid: str, first: Chunk | Done, rest: AsyncIterator[Any],
                  n: int, include_usage: bool, turn: turns.Turn) -> AsyncIterator[bytes]:
    """OpenAI chunks: a role delta per choice, content deltas, a finish chunk per choice,
    then (include_usage) a usage chunk, then [DONE]. With tools, content and calls come as
    the frontend read them (`generation.parts`): the text outside calls, and each call as
    ``delta.tool_calls`` -- its index, id and name first, then fragments of its arguments."""
    head = {"id": cid, "object": "chat.completion.chunk", "created": now(),
            "model": ctx.model_name}
    # Content chunks are by far the most frequent: their JSON is assembled around the text.
    prefix = b"data: " + _json.encode(head)[:-1] + b',"choices":[{"index":'
    tail = b',"logprobs":null,"finish_reason":null}]' + (b',"usage":null' if include_usage else b"") + b"}\n\n"
    extra = {"usage": None} if include_usage else {}

    def chunk(choice: dict[str, Any], **more: Any) -> bytes:
        return sse.data({**head, "choices": [choice], **extra, **more})

    def delta(index: int, d: dict[str, Any], logprobs: Any = None) -> bytes:
        return chunk({"index": index, "delta": d, "logprobs": logprobs, "finish_reason": None})

    called: set[int] = set()  # choices that streamed a call

    def deltas(reply: Chunk, logprobs: Any) -> list[bytes]:
        """The reply's parts as deltas; its logprobs ride with the first."""
        index = reply.index
        out = []
        for part in generation.parts(reply):
            if type(part) is str:
                out.append(delta(index, {"content": part}, logprobs))
                logprobs = None
                continue
            if part.name is not None:
                called.add(index)
                out.append(delta(index, {"tool_calls": [{
                    "index": part.index, "id": part.id, "type": "function",
                    "function": {"name": part.name, "arguments": ""}}]}, logprobs))
                logprobs = None
            if part.arguments:
                out.append(delta(index, {"tool_calls": [{
                    "index": part.index, "function": {"arguments": part.arguments}}]}, logprobs))
                logprobs = None
        if logprobs is not None:  # its text is held back: the logprobs go now
            out.append(delta(index, {}, logprobs))
        return out

    dones: list[Done] = []
    entry = None
    try:
        for i in range(n):
            yield delta(i, {"role": "assistant", "content": ""})
        reply = first
        while True:
            if type(reply) is Chunk:
                lp = None
                if reply.logprobs is not None:
                    lp = {"content": chat_content(reply.token_texts, reply.token_ids,
                                                  reply.logprobs, reply.top_logprobs)}
                if reply.content is None and lp is None:
                    if reply.text:
                        yield (prefix + str(reply.index).encode() + b',"delta":{"content":'
                               + _json.encode(reply.text) + b"}" + tail)
                else:
                    for data in deltas(reply, lp):
                        yield data
            else:
                dones.append(reply)
                if len(dones) == n:
                    entry = turns.finish(ctx, turn, reply, new_id("sess"))
                    if turn.session:
                        await ctx.store.flush()
                reason = "tool_calls" if reply.index in called else (
                    "length" if reply.finish_reason == "length" else "stop")
                more = {"session": session_json(entry)} if turn.session else {}
                yield chunk({"index": reply.index, "delta": {}, "logprobs": None,
                             "finish_reason": reason}, **more)
            try:
                reply = await rest.__anext__()
            except StopAsyncIteration:
                break
        if include_usage and dones:
            yield sse.data({**head, "choices": [], "usage": usage_json(sorted(
                dones, key=lambda d: d.index))})
        yield sse.DONE
    finally:
        if len(dones) < n:
            turns.finish(ctx, turn, None, "")
        await rest.aclose()  # type: ignore[attr-defined]
