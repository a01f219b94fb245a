"""/v1/responses: OpenAI's Responses API on engine sessions.

A response's conversation is its messages -- the previous response's (with
``previous_response_id``), or a conversation's items (with ``conversation``), then its
own input -- under its own ``instructions``, which are never carried over from a previous
response. The turn continues the longest *held* history those messages start with
(`history.py`): the engine session of an earlier response whose conversation and
instructions (and tools) it shares. That session is forked and only the messages after
it are appended: nothing is re-rendered, re-tokenized or recomputed, and
``usage.input_tokens_details.cached_tokens`` counts the whole held history. This finds
the previous response of a chain that re-sends the same instructions, and the last turn
of a client that sends its whole history each time (openai-agents' sessions). Changed
instructions or tools find nothing held: the prompt is rendered in full with the new
system prompt. ``store: false`` keeps nothing. A response unused for ``--response-ttl``
seconds expires: its id then gets 404.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
from radixlm.runtime.http import convert, generation, sse, turns
from radixlm.runtime.http import items as item_lists
from radixlm.runtime.http.context import HttpContext, now, program_of, request_body
from radixlm.runtime.http.conversations import page
from radixlm.runtime.http.errors import invalid
from radixlm.runtime.http.history import MESSAGES_ONLY, chain_keys, root_key
from radixlm.runtime.http.items import items_of, stored_item, to_messages
from radixlm.runtime.http.schemas import InputItem, ResponsesRequest
from radixlm.runtime.http.store import Conversation, Stored
from radixlm.runtime.protocol import Chunk, Done, Generate, Input, Message, Tool
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


def function_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def output_items(done: Done, msg_id: str) -> list[dict[str, Any]]:
    if done.tool_calls:
        return [function_item(c.id, c.name, c.arguments, "completed") for c in done.tool_calls]
    return [message_item(msg_id, done.text, "completed")]


def message_item(msg_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Turn:
    """A response being made: its request's fields, its conversation, where it runs."""

    def __init__(self, ctx: HttpContext, req: ResponsesRequest, rid: str, max_tokens: int | None,
                 tools: list[Tool] | None, conversation: Conversation | None) -> None:
        self.ctx = ctx
        self.rid = rid
        self.conversation = conversation
        fmt = msgspec.to_builtins(req.text.format) if req.text and req.text.format else {"type": "text"}
        self.base = {
            "id": rid, "object": "response", "created_at": now(), "model": ctx.model_name,
            "instructions": req.instructions, "previous_response_id": req.previous_response_id,
            "max_output_tokens": max_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": msgspec.to_builtins(req.tool_choice) if req.tool_choice else "auto",
            "tools": [msgspec.to_builtins(t) for t in req.tools or []],
            "text": {"format": fmt}, "store": req.store is not False, "truncation": "disabled",
            "user": req.user, "error": None, "incomplete_details": None, "reasoning": None,
            "conversation": {"id": conversation.id} if conversation is not None else None,
        }
        self.root = root_key(req.instructions, tools)
        self.system = convert.system_prompt(req.instructions)

    def build(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              incomplete: str | None = None) -> dict[str, Any]:
        out = {**self.base, "status": status, "output": output, "usage": usage}
        if incomplete:
            out["incomplete_details"] = {"reason": incomplete}
        return out

    def final(self, done: Done, output: list[dict[str, Any]]) -> dict[str, Any]:
        calls = any(item["type"] == "function_call" for item in output)
        length = done.finish_reason == "length" and not calls
        return self.build("incomplete" if length else "completed", output, usage_json(done),
                          "max_output_tokens" if length else None)


async def create(ctx: HttpContext, request: Request) -> Response:
    req = await request_body(ctx, request, ResponsesRequest)
    ctx.check_model(req.model)
    keep = req.store is not False
    own_items = item_lists.input_items(req.input)
    own = to_messages(own_items)
    tools, tool_choice = convert.response_tools(req.tools, req.tool_choice)
    fmt = req.text.format if req.text else None
    if req.top_logprobs:
        raise invalid("top_logprobs is not supported on /v1/responses (use chat completions)",
                      "top_logprobs")
    max_tokens = convert.max_tokens_of(req.max_output_tokens, ctx.default_max_tokens(),
                                       "max_output_tokens")
    sampling = convert.sampling(req, max_tokens=max_tokens, stop=[],
                                json_schema=convert.text_json_schema(fmt))
    prior, conversation = _prior(ctx, req)
    rid, msg_id = f"resp_{secrets.token_hex(16)}", f"msg_{secrets.token_hex(12)}"
    turn_info = _Turn(ctx, req, rid, max_tokens, tools, conversation)
    messages = prior + own
    keys = chain_keys(turn_info.root, messages)
    turn, held_len = await turns.continue_held(ctx, keys, len(messages), keep=keep)
    send = messages[held_len:] if held_len else turn_info.system + messages
    parallel = req.parallel_tool_calls is not False
    msg = Generate(rid=ctx.link.new_rid(), input=Input(messages=send), sampling=sampling,
                   stream=bool(req.stream), session=turn.session, tools=tools,
                   tool_choice=tool_choice, parallel_tool_calls=parallel,
                   program=program_of(request))
    if conversation is not None:
        conversation.busy = True
    if req.stream:
        try:
            first, rest = await sse.first_then_rest(generation.replies(ctx, msg))
        except BaseException:
            _settle(turn_info, turn, None, messages, own_items)
            raise
        return sse.response(_stream(turn_info, msg_id, first, rest, turn, messages, own_items),
                            error_event=True)
    done = None
    body: dict[str, Any] | None = None
    try:
        done = (await generation.run(ctx, msg))[0]
        body = turn_info.final(done, output_items(done, msg_id))
    finally:
        _settle(turn_info, turn, done, messages, own_items, body)
    if keep or conversation is not None:
        await ctx.store.flush()  # stored (and in its conversation) before the reply says so
    return Response(_json.encode(body), media_type="application/json")


def _prior(ctx: HttpContext, req: ResponsesRequest) -> tuple[list[Message], Conversation | None]:
    """The messages before this response's input, and its conversation (if any)."""
    conv_ref = req.conversation
    if conv_ref is not None and req.previous_response_id is not None:
        raise invalid("give previous_response_id or conversation, not both", "conversation")
    if req.previous_response_id is not None:
        entry = ctx.store.get(req.previous_response_id)
        if entry is None or entry.body is None:
            raise turns.unknown("response", req.previous_response_id)
        return list(entry.history), None
    if conv_ref is not None:
        cid = conv_ref if isinstance(conv_ref, str) else conv_ref.id
        conv = ctx.store.conversation(cid)
        if conv is None:
            raise turns.unknown("conversation", cid)
        return conv.messages(), conv
    return [], None


def _settle(info: _Turn, turn: turns.Turn, done: Done | None, messages: list[Message],
            own_items: list[InputItem], body: dict[str, Any] | None = None) -> None:
    """After the turn: hold its session under its whole history, store the response, and
    add its items to its conversation; on failure, close what it opened."""
    ctx = info.ctx
    conv = info.conversation
    if conv is not None:
        conv.busy = False
    if body is None or done is None:
        turns.hold(ctx, turn, None, b"", b"")
        return
    output = items_of(body["output"])
    history = messages + to_messages(output, "output")
    held = turns.hold(ctx, turn, done, chain_keys(info.root, history)[-1],
                      chain_keys(MESSAGES_ONLY, history)[-1])
    if conv is not None:
        taken = {item["id"] for item in conv.items}
        added = []
        for item in [*own_items, *output]:
            added.append(stored_item(item, taken))
            taken.add(added[-1]["id"])
        ctx.store.add_items(conv, added, held)
    if held is not None:
        ctx.store.put_response(info.rid, held, history, body,
                               [stored_item(i) for i in own_items])


async def _stream(info: _Turn, msg_id: str, first: Chunk | Done, rest: AsyncIterator[Any],
                  turn: turns.Turn, messages: list[Message],
                  own_items: list[InputItem]) -> AsyncIterator[bytes]:
    """The Responses API's streaming events, from response.created to response.completed:
    a message item whose text streams as it comes, and for each call the frontend read
    (`generation.parts`) a function_call item whose arguments stream in fragments."""
    seq = 0

    def emit(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return sse.event(kind, {"type": kind, "sequence_number": seq - 1, **fields})

    output: list[dict[str, Any]] = []
    text: list[str] = []  # of the open message item
    open_msg: dict[str, Any] | None = None
    call_item: dict[str, Any] | None = None
    call_args: list[str] = []  # of the open function_call item

    def open_message() -> list[bytes]:
        nonlocal open_msg
        open_msg = message_item(msg_id, None, "in_progress")
        index = len(output)
        output.append(open_msg)
        return [emit("response.output_item.added", output_index=index, item=open_msg),
                emit("response.content_part.added", item_id=msg_id, output_index=index,
                     content_index=0, part=_text_part(""))]

    def close_message() -> list[bytes]:
        nonlocal open_msg
        if open_msg is None:
            return []
        index = output.index(open_msg)
        full = "".join(text)
        done_item = message_item(msg_id, full, "completed")
        output[index] = done_item
        open_msg = None
        return [emit("response.output_text.done", item_id=msg_id, output_index=index,
                     content_index=0, text=full, logprobs=[]),
                emit("response.content_part.done", item_id=msg_id, output_index=index,
                     content_index=0, part=_text_part(full)),
                emit("response.output_item.done", output_index=index, item=done_item)]

    def close_call() -> list[bytes]:
        nonlocal call_item
        if call_item is None:
            return []
        arguments = "".join(call_args)
        done_item = {**call_item, "arguments": arguments, "status": "completed"}
        output[-1] = done_item
        call_item = None
        return [emit("response.function_call_arguments.done", item_id=done_item["id"],
                     output_index=len(output) - 1, arguments=arguments, name=done_item["name"]),
                emit("response.output_item.done", output_index=len(output) - 1,
                     item=done_item)]

    def events(chunk_parts: Iterator[generation.Part]) -> list[bytes]:
        nonlocal call_item
        out: list[bytes] = []
        for part in chunk_parts:
            if type(part) is str:
                out += close_call()
                if open_msg is None:
                    out += open_message()
                text.append(part)
                out.append(emit("response.output_text.delta", item_id=msg_id,
                                output_index=output.index(open_msg), content_index=0,
                                delta=part, logprobs=[]))
                continue
            if part.name is not None:
                out += close_call()
                out += close_message()
                call_item = function_item(part.id or "", part.name, "", "in_progress")
                call_args.clear()
                output.append(call_item)
                out.append(emit("response.output_item.added", output_index=len(output) - 1,
                                item=call_item))
            if call_item is None:
                continue
            if part.arguments:
                call_args.append(part.arguments)
                out.append(emit("response.function_call_arguments.delta",
                                item_id=call_item["id"], output_index=len(output) - 1,
                                delta=part.arguments))
            if part.done:
                out += close_call()
        return out

    done = None
    body = None
    try:
        yield emit("response.created", response=info.build("in_progress", [], None))
        yield emit("response.in_progress", response=info.build("in_progress", [], None))
        if type(first) is not Chunk or first.content is None:  # no calls read: text only
            for data in open_message():
                yield data
        reply = first
        while True:
            if type(reply) is Chunk:
                for data in events(generation.parts(reply)):
                    yield data
            else:
                done = reply
                for data in close_call():  # a call the output ended inside, as it stands
                    yield data
            try:
                reply = await rest.__anext__()
            except StopAsyncIteration:
                break
        assert done is not None
        if not output:  # no text and no call: an empty message, as a non-streamed reply has
            for data in open_message():
                yield data
        for data in close_message():
            yield data
        body = info.final(done, output)
        _settle(info, turn, done, messages, own_items, body)
        if turn.keep or info.conversation is not None:
            await info.ctx.store.flush()
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield emit(kind, response=body)
    finally:
        if body is None:
            _settle(info, turn, None, messages, own_items)
        await rest.aclose()  # type: ignore[attr-defined]


async def get(ctx: HttpContext, request: Request) -> Response:
    entry = _stored(ctx, request)
    return Response(_json.encode(entry.body), media_type="application/json")


async def delete(ctx: HttpContext, request: Request) -> Response:
    entry = _stored(ctx, request)
    ctx.store.delete(entry.id)
    await ctx.store.flush()
    return Response(_json.encode({"id": entry.id, "object": "response", "deleted": True}),
                    media_type="application/json")


async def input_items(ctx: HttpContext, request: Request) -> Response:
    """GET /v1/responses/{id}/input_items: this response's own input items (newest first
    unless ``order=asc``), paged like a conversation's items."""
    entry = _stored(ctx, request)
    return page(request, entry.input_items)


def _stored(ctx: HttpContext, request: Request) -> Stored:
    rid = request.path_params["response_id"]
    entry = ctx.store.get(rid)
    if entry is None or entry.body is None:
        raise turns.unknown("response", rid)
    return entry
