"""The ASGI application: routes, the API key (and so the tenant) of each request,
OpenAI-shaped errors, the access log, and the lifespan that holds the engine
connections and expires stored objects."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
from radixlm.runtime.http import (
    anthropic,
    chat,
    completions,
    conversations,
    responses,
    tokenize,
    turns,
)
from radixlm.runtime.http.config import HttpConfig
from radixlm.runtime.http.context import HttpContext, now
from radixlm.runtime.http.engine_link import EngineLink
from radixlm.runtime.http.errors import ApiError, from_engine
from radixlm.runtime.http.metrics import Metrics
from radixlm.runtime.http.store import ConversationStore
from radixlm.runtime.http.tenants import Tenant, Tenants, tenant_name
from radixlm.runtime.transport.curve import load_curve_keys
from radixlm.runtime.transport.errors import EngineDeadError, EngineError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

log = logging.getLogger("radixlm.http")
access_log = logging.getLogger("radixlm.http.access")
_json = msgspec.json.Encoder()
Handler = Callable[[HttpContext, Request], Awaitable[Response]]
Render = Callable[[Request, ApiError], Response]  # an error in the route's API's shape
SWEEP_INTERVAL_S = 30.0


def _json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def _unauthorized() -> ApiError:
    return ApiError(401, "Incorrect API key provided (send Authorization: Bearer <key>, or "
                         "x-api-key: <key>)", type="invalid_request_error", code="invalid_api_key")


def _tenant(tenants: Tenants, request: Request) -> Tenant | None:
    """The tenant of the request's key: ``Authorization: Bearer``, or Anthropic's
    ``x-api-key``."""
    headers = request.headers
    tenant = tenants.of(headers.get("authorization", ""))
    key = headers.get("x-api-key")
    if tenant is None and key is not None:
        tenant = tenants.of(f"Bearer {key}")
    return tenant


def _openai_error(request: Request, e: ApiError) -> Response:
    return e.response()


def _anthropic_when_asked(request: Request, e: ApiError) -> Response:
    """Anthropic's error shape for its clients (an ``anthropic-version`` header) and its
    routes, OpenAI's otherwise."""
    if anthropic.asks_anthropic(request) or request.url.path.startswith("/v1/messages"):
        return anthropic.error_response(e)
    return e.response()


def _route(ctx: HttpContext, name: str, handler: Handler, *, public: bool = False,
           errors: Render = _openai_error) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint: the key's tenant, errors in the route's shape (OpenAI's
    unless `errors` says otherwise), request counting and the access log (logger
    ``radixlm.http.access``, level info)."""
    requests = ctx.metrics.requests
    tenants = ctx.tenants

    async def endpoint(request: Request) -> Response:
        started = time.perf_counter()
        tenant = _tenant(tenants, request)
        try:
            if tenant is None and not public:
                raise _unauthorized()
            response = await handler(ctx.for_tenant(tenant or tenants.control), request)
        except ApiError as e:
            response = errors(request, e)
        except EngineError as e:
            response = errors(request, from_engine(e))
        except Exception:
            log.exception("unexpected error in %s", name)
            response = errors(request, ApiError(500, "internal server error (see the server log)",
                                                type="server_error", code="internal"))
        requests.labels(name, str(response.status_code)).inc()
        if access_log.isEnabledFor(logging.INFO):
            client = request.client
            access_log.info('%s "%s %s" %d %.1fms tenant=%s', client.host if client else "-",
                            request.method, request.url.path, response.status_code,
                            (time.perf_counter() - started) * 1000,
                            tenant.name if tenant is not None else "-")
        return response

    return endpoint


def _model_json(ctx: HttpContext) -> dict[str, Any]:
    return {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "radixlm",
            "context_length": ctx.context_length, "max_model_len": ctx.context_length}


async def _models(ctx: HttpContext, request: Request) -> Response:
    return _json_response({"object": "list", "data": [_model_json(ctx)]})


async def _model(ctx: HttpContext, request: Request) -> Response:
    name = request.path_params["model"]
    if name not in ctx.model_names():
        raise ApiError(404, f"The model '{name}' does not exist (this server serves "
                            f"'{ctx.model_name}')", type="invalid_request_error",
                       param="model", code="model_not_found")
    return _json_response(_model_json(ctx))


async def _model_info(ctx: HttpContext, request: Request) -> Response:
    """SGLang's native ``/get_model_info``, plus the engine's protocol endpoint, which
    ``rl.RuntimeEndpoint("http://...")`` connects programs to (they run on sessions)."""
    return _json_response({"model_path": ctx.welcome.model, "served_model_name": ctx.model_name,
                           "is_generation": True, "radixlm_endpoint": ctx.config.engine_endpoint})


async def _health(ctx: HttpContext, request: Request) -> Response:
    """200 once the engine itself answers (a stats request, which the engine serves even
    mid-step) within --health-timeout; 503 otherwise -- a frozen engine included."""
    link = ctx.tenants.control.link
    ok = False
    if link.alive:
        with anyio.move_on_after(ctx.config.health_timeout_s):
            try:
                await link.stats()
                ok = True
            except EngineDeadError:  # unreachable, or its frontend gave up on it
                pass
            except EngineError:  # it answered, if with a refusal
                ok = True
    if not ok:
        raise ApiError(503, "the engine is not answering", type="server_error",
                       code="engine_unavailable")
    return _json_response({"status": "ok", "model": ctx.model_name})


async def _metrics(ctx: HttpContext, request: Request) -> Response:
    if not ctx.config.metrics_public and ctx.tenants.of(
            request.headers.get("authorization", "")) is None:
        raise _unauthorized()
    link = ctx.tenants.control.link
    stats = None
    if link.alive:
        with anyio.move_on_after(ctx.config.health_timeout_s), contextlib.suppress(EngineError):
            stats = await link.stats()
    stored = sum(len(t.store) for t in ctx.tenants)
    return Response(ctx.metrics.render(stats, stored, ctx.model_name),
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


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path, encoding="ascii") as f:
        return f.read().strip()


def build_app(config: HttpConfig) -> Starlette:
    token = _read_token(config.gateway_token_file)
    curve = load_curve_keys(config.server_key, config.client_key)

    def make_tenant(key: str | None) -> Tenant:
        name = "local" if key is None else tenant_name(key)
        link = EngineLink(config.engine_endpoint, tenant=None if key is None else name,
                          gateway_token=token, curve=curve,
                          heartbeat_timeout=config.link_timeout_s)
        store = ConversationStore(config.response_ttl_s, link.close_sessions_unawaited)
        return Tenant(name, link, store)

    tenants = Tenants(config.api_keys, make_tenant)
    ctx = HttpContext(config, tenants, Metrics())
    messages = anthropic.MessagesApi(tenants)

    def route(path: str, name: str, handler: Handler, methods: list[str], public: bool = False,
              errors: Render = _openai_error) -> Route:
        return Route(path, _route(ctx, name, handler, public=public, errors=errors),
                     methods=methods)

    def anthropic_route(path: str, name: str, handler: Handler) -> Route:
        return route(path, name, handler, ["POST"],
                     errors=lambda request, e: anthropic.error_response(e))

    routes = [  # (matched in order: the generation routes first)
        route("/v1/chat/completions", "chat", chat.chat_completions, ["POST"]),
        anthropic_route("/v1/messages", "messages", messages.create),
        anthropic_route("/v1/messages/count_tokens", "messages_count_tokens",
                        messages.count_tokens),
        route("/v1/completions", "completions", completions.completions, ["POST"]),
        route("/v1/responses", "responses", responses.create, ["POST"]),
        route("/v1/responses/{response_id}", "responses_get", responses.get, ["GET"]),
        route("/v1/responses/{response_id}", "responses_delete", responses.delete, ["DELETE"]),
        route("/v1/responses/{response_id}/input_items", "responses_input_items",
              responses.input_items, ["GET"]),
        route("/v1/conversations", "conversations_create", conversations.create, ["POST"]),
        route("/v1/conversations/{conversation_id}", "conversations_get", conversations.get,
              ["GET"]),
        route("/v1/conversations/{conversation_id}", "conversations_update",
              conversations.update, ["POST"]),
        route("/v1/conversations/{conversation_id}", "conversations_delete",
              conversations.delete, ["DELETE"]),
        route("/v1/conversations/{conversation_id}/items", "conversation_items_list",
              conversations.list_items, ["GET"]),
        route("/v1/conversations/{conversation_id}/items", "conversation_items_create",
              conversations.add_items, ["POST"]),
        route("/v1/conversations/{conversation_id}/items/{item_id}", "conversation_items_get",
              conversations.get_item, ["GET"]),
        route("/v1/conversations/{conversation_id}/items/{item_id}",
              "conversation_items_delete", conversations.delete_item, ["DELETE"]),
        route("/v1/sessions/{session_id}", "sessions_get", _get_session, ["GET"]),
        route("/v1/sessions/{session_id}", "sessions_delete", _delete_session, ["DELETE"]),
        route("/v1/models", "models", anthropic.models_or(_models), ["GET"],
              errors=_anthropic_when_asked),
        route("/v1/models/{model:path}", "model", anthropic.model_or(_model), ["GET"],
              errors=_anthropic_when_asked),
        route("/get_model_info", "model_info", _model_info, ["GET"]),
        route("/v1/tokenize", "tokenize", tokenize.tokenize, ["POST"]),
        route("/v1/detokenize", "detokenize", tokenize.detokenize, ["POST"]),
        route("/tokenize", "tokenize", tokenize.tokenize, ["POST"]),
        route("/detokenize", "detokenize", tokenize.detokenize, ["POST"]),
        route("/health", "health", _health, ["GET"], public=True),
        route("/metrics", "metrics", _metrics, ["GET"], public=True),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            for tenant in tenants:
                await tenant.link.open(tg, config.connect_timeout_s)
            tg.start_soon(_sweep, [t.store for t in tenants])
            tg.start_soon(messages.cache.sweep_forever)
            log.info("HTTP frontend for %s on http://%s:%d/v1 (%d tenant%s)", ctx.model_name,
                     config.host, config.port, len(list(tenants)),
                     "" if len(list(tenants)) == 1 else "s")
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
        for tenant in tenants:
            tenant.link.close()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _anthropic_when_asked(request, ApiError(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


async def _sweep(stores: list[ConversationStore]) -> None:
    interval = min(SWEEP_INTERVAL_S, max(stores[0].ttl_s / 4, 0.05))
    while True:
        await anyio.sleep(interval)
        expired = sum(store.sweep() for store in stores)
        if expired:
            log.debug("expired %d stored objects", expired)


__all__ = ["build_app", "now"]
