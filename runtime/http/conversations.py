"""/v1/conversations: OpenAI's Conversations API, on held engine sessions.

A conversation is a list of items (messages, function calls and their outputs). A
response made with ``conversation`` continues it -- its turn forks the held session of
the conversation's latest turn and appends only the new input -- and adds its input and
output items to it. Items added directly (``POST …/items``: openai-agents'
``OpenAIConversationsSession`` adds each turn's items so) make the conversation hold the
session of the response whose history they are, when there is one; a client that then
sends the whole conversation as ``input`` continues that session (`history.py`), so each
turn computes only its new tokens either way.
"""

from __future__ import annotations

from typing import Any

import msgspec
from radixlm.runtime.http import turns
from radixlm.runtime.http.context import HttpContext, request_body
from radixlm.runtime.http.errors import ApiError, invalid
from radixlm.runtime.http.items import stored_item, to_messages
from radixlm.runtime.http.schemas import (
    ConversationCreate,
    ConversationUpdate,
    InputItem,
    ItemsCreate,
)
from radixlm.runtime.http.store import Conversation
from starlette.requests import Request
from starlette.responses import Response

_json = msgspec.json.Encoder()
MAX_ITEMS_PER_REQUEST = 20  # as OpenAI's
MAX_METADATA = 16


def _ok(obj: Any) -> Response:
    return Response(_json.encode(obj), media_type="application/json")


def _items(ctx: HttpContext, raw: list[InputItem] | None, conv: Conversation | None) -> list[dict[str, Any]]:
    raw = raw or []
    if len(raw) > MAX_ITEMS_PER_REQUEST:
        raise invalid(f"at most {MAX_ITEMS_PER_REQUEST} items per request", "items")
    to_messages(raw, "items")  # refuses what is not a message, call or call output
    taken = {item["id"] for item in conv.items} if conv is not None else set()
    out = []
    for item in raw:
        out.append(stored_item(item, taken))
        taken.add(out[-1]["id"])
    return out


def _metadata(meta: dict[str, str] | None) -> dict[str, str]:
    meta = meta or {}
    if len(meta) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise invalid(f"metadata: at most {MAX_METADATA} keys of 64 characters, values of 512",
                      "metadata")
    return meta


def _conversation(ctx: HttpContext, request: Request) -> Conversation:
    cid = request.path_params["conversation_id"]
    conv = ctx.store.conversation(cid)
    if conv is None:
        raise turns.unknown("conversation", cid)
    return conv


async def create(ctx: HttpContext, request: Request) -> Response:
    req = await request_body(ctx, request, ConversationCreate, empty=b"{}")
    items = _items(ctx, req.items, None)
    conv = ctx.store.new_conversation(_metadata(req.metadata), items)
    await ctx.store.flush()  # on disk before its id is given out
    return _ok(conv.body())


async def get(ctx: HttpContext, request: Request) -> Response:
    return _ok(_conversation(ctx, request).body())


async def update(ctx: HttpContext, request: Request) -> Response:
    conv = _conversation(ctx, request)
    req = await request_body(ctx, request, ConversationUpdate)
    ctx.store.set_metadata(conv, _metadata(req.metadata))
    await ctx.store.flush()
    return _ok(conv.body())


async def delete(ctx: HttpContext, request: Request) -> Response:
    conv = _conversation(ctx, request)
    ctx.store.delete_conversation(conv.id)
    await ctx.store.flush()
    return _ok({"id": conv.id, "object": "conversation.deleted", "deleted": True})


async def add_items(ctx: HttpContext, request: Request) -> Response:
    conv = _conversation(ctx, request)
    req = await request_body(ctx, request, ItemsCreate)
    added = _items(ctx, req.items, conv)
    ctx.store.add_items(conv, added)
    await ctx.store.flush()
    return _ok(_list(added, has_more=False))


async def list_items(ctx: HttpContext, request: Request) -> Response:
    return page(request, _conversation(ctx, request).items)


async def get_item(ctx: HttpContext, request: Request) -> Response:
    conv = _conversation(ctx, request)
    item = _find(conv, request.path_params["item_id"])
    return _ok(conv.items[item])


async def delete_item(ctx: HttpContext, request: Request) -> Response:
    conv = _conversation(ctx, request)
    ctx.store.delete_item(conv, _find(conv, request.path_params["item_id"]))
    await ctx.store.flush()
    return _ok(conv.body())


def _find(conv: Conversation, item_id: str) -> int:
    for i, item in enumerate(conv.items):
        if item["id"] == item_id:
            return i
    raise ApiError(404, f"item '{item_id}' not found in conversation '{conv.id}'",
                   type="invalid_request_error", code="not_found")


def _list(items: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def page(request: Request, items: list[dict[str, Any]]) -> Response:
    """A page of `items` by the query's ``order`` (``desc`` by default), ``after`` (an
    item id) and ``limit`` (1-100, default 20)."""
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be 'asc' or 'desc'", "order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise invalid("limit must be an integer", "limit") from None
    if not 1 <= limit <= 100:
        raise invalid("limit must be in [1, 100]", "limit")
    seq = items if order == "asc" else items[::-1]
    start = 0
    after = q.get("after")
    if after is not None:
        ids = [item["id"] for item in seq]
        if after not in ids:
            raise invalid(f"after: no item '{after}'", "after")
        start = ids.index(after) + 1
    chosen = seq[start:start + limit]
    return _ok(_list(chosen, has_more=start + limit < len(seq)))
