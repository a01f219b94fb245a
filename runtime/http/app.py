"""The ASGI application: routes, API-key check, OpenAI-shaped errors, and the lifespan
that holds the engine connection and expires stored conversations."""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
from radixlm.runtime.http import chat, completions, responses, turns
from radixlm.runtime.http.config import HttpConfig
from radixlm.runtime.http.context import HttpContext, TokenTexts, now
from radixlm.runtime.http.engine_link import EngineLink
from radixlm.runtime.http.errors import ApiError, from_engine
from radixlm.runtime.http.metrics import Metrics
from radixlm.runtime.http.store import ConversationStore
from radixlm.runtime.transport.errors import EngineError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

log = logging.getLogger("radixlm.http")
_json = msgspec.json.Encoder()
Handler = Callable[[HttpContext, Request], Awaitable[Response]]
SWEEP_INTERVAL_S = 30.0


def _json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def _authorized(config: HttpConfig, request: Request) -> bool:
    if config.api_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              config.api_key.encode())


def _route(ctx: HttpContext, name: str, handler: Handler, *, public: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint: key check, errors in OpenAI's shape, request counting."""
    requests = ctx.metrics.requests

    async def endpoint(request: Request) -> Response:
        try:
            if not public and not _authorized(ctx.config, request):
                raise ApiError(401, "Incorrect API key provided (send Authorization: Bearer "
                                    "<key>)", type="invalid_request_error", code="invalid_api_key")
            response = await handler(ctx, request)
        except ApiError as e:
            response = e.response()
        except EngineError as e:
            response = from_engine(e).response()
        except Exception:
            log.exception("unexpected error in %s", name)
            response = ApiError(500, "internal server error (see the server log)",
                                type="server_error", code="internal").response()
        requests.labels(name, str(response.status_code)).inc()
        return response

    return endpoint


async def _models(ctx: HttpContext, request: Request) -> Response:
    assert ctx.link.welcome is not None
    return _json_response({"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": 0, "owned_by": "radixlm",
        "context_length": ctx.link.welcome.context_length}]})


async def _health(ctx: HttpContext, request: Request) -> Response:
    if not ctx.link.alive:
        raise ApiError(503, "the engine is not reachable", type="server_error", code="engine_dead")
    return _json_response({"status": "ok", "model": ctx.model_name})


async def _metrics(ctx: HttpContext, request: Request) -> Response:
    stats = await ctx.link.stats() if ctx.link.alive else None
    return Response(ctx.metrics.render(stats, len(ctx.store)),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


async def _get_session(ctx: HttpContext, request: Request) -> Response:
    sid = request.path_params["session_id"]
    entry = ctx.store.get(sid)
    if entry is None or entry.body is not None:
        raise turns.unknown("session", sid)
    return _json_response({"id": sid, "object": "session", "length": entry.length})


async def _delete_session(ctx: HttpContext, request: Request) -> Response:
    sid = request.path_params["session_id"]
    entry = ctx.store.get(sid)
    if entry is None or entry.body is not None or entry.busy or not ctx.store.delete(sid):
        raise turns.unknown("session", sid)
    return _json_response({"id": sid, "object": "session", "deleted": True})


def build_app(config: HttpConfig) -> Starlette:
    link = EngineLink(config.engine_endpoint)
    store = ConversationStore(config.response_ttl_s, link.close_sessions)
    ctx = HttpContext(config, link, store, Metrics(), TokenTexts(config.tokenizer_dir))

    def route(path: str, name: str, handler: Handler, methods: list[str], public: bool = False) -> Route:
        return Route(path, _route(ctx, name, handler, public=public), methods=methods)

    routes = [
        route("/v1/chat/completions", "chat", chat.chat_completions, ["POST"]),
        route("/v1/completions", "completions", completions.completions, ["POST"]),
        route("/v1/responses", "responses", responses.create, ["POST"]),
        route("/v1/responses/{response_id}", "responses_get", responses.get, ["GET"]),
        route("/v1/responses/{response_id}", "responses_delete", responses.delete, ["DELETE"]),
        route("/v1/sessions/{session_id}", "sessions_get", _get_session, ["GET"]),
        route("/v1/sessions/{session_id}", "sessions_delete", _delete_session, ["DELETE"]),
        route("/v1/models", "models", _models, ["GET"]),
        route("/health", "health", _health, ["GET"], public=True),
        route("/metrics", "metrics", _metrics, ["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            await link.open(tg, config.connect_timeout_s)
            tg.start_soon(_sweep, store)
            log.info("HTTP frontend for %s on http://%s:%d/v1", ctx.model_name, config.host,
                     config.port)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
        link.close()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        type=kind).response()

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


async def _sweep(store: ConversationStore) -> None:
    interval = min(SWEEP_INTERVAL_S, max(store.ttl_s / 4, 0.05))
    while True:
        await anyio.sleep(interval)
        expired = store.sweep()
        if expired:
            log.debug("expired %d stored conversations", expired)


__all__ = ["build_app", "now"]
