"""GET /v1/models and /v1/models/{id} in Anthropic's shape, for a request that names an
``anthropic-version`` (as Anthropic's SDKs always do); OpenAI's shape otherwise."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from radixlm.runtime.http.context import HttpContext
from radixlm.runtime.http.errors import ApiError
from starlette.requests import Request
from starlette.responses import Response

_json = msgspec.json.Encoder()
Handler = Callable[[HttpContext, Request], Awaitable[Response]]
CREATED_AT = "1970-01-01T00:00:00Z"  # a served model has no release date


def asks_anthropic(request: Request) -> bool:
    return "anthropic-version" in request.headers


def _model(ctx: HttpContext) -> dict[str, Any]:
    return {"type": "model", "id": ctx.model_name, "display_name": ctx.model_name,
            "created_at": CREATED_AT}


def models_or(openai: Handler) -> Handler:
    """The list: Anthropic's page shape when asked, else `openai`'s."""

    async def handler(ctx: HttpContext, request: Request) -> Response:
        if not asks_anthropic(request):
            return await openai(ctx, request)
        name = ctx.model_name
        return Response(_json.encode({"data": [_model(ctx)], "has_more": False,
                                      "first_id": name, "last_id": name}),
                        media_type="application/json")

    return handler


def model_or(openai: Handler) -> Handler:
    """One model: Anthropic's shape when asked, else `openai`'s."""

    async def handler(ctx: HttpContext, request: Request) -> Response:
        if not asks_anthropic(request):
            return await openai(ctx, request)
        name = request.path_params["model"]
        if name not in ctx.model_names():
            raise ApiError(404, f"model: {name} (this server serves '{ctx.model_name}')",
                           type="not_found_error", param="model", code="model_not_found")
        return Response(_json.encode(_model(ctx)), media_type="application/json")

    return handler
