"""What every route needs, passed explicitly: config, engine link, store, metrics."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from radixlm.runtime.http.bounds import check_request
from radixlm.runtime.http.config import HttpConfig
from radixlm.runtime.http.engine_link import EngineLink
from radixlm.runtime.http.errors import ApiError
from radixlm.runtime.http.metrics import Metrics
from radixlm.runtime.http.store import ConversationStore
from radixlm.runtime.http.tenants import Tenant, Tenants
from radixlm.runtime.protocol import Welcome
from starlette.requests import Request

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)


@dataclass
class HttpContext:
    """Shared by every request; `tenant` is the request's own (set by the route wrapper:
    `link` and `store` are that tenant's)."""

    config: HttpConfig
    tenants: Tenants
    metrics: Metrics
    tenant: Tenant | None = None

    def for_tenant(self, tenant: Tenant) -> HttpContext:
        return dataclasses.replace(self, tenant=tenant)

    @property
    def link(self) -> EngineLink:
        assert self.tenant is not None
        return self.tenant.link

    @property
    def store(self) -> ConversationStore:
        assert self.tenant is not None
        return self.tenant.store

    @property
    def welcome(self) -> Welcome:
        welcome = self.tenants.control.link.welcome
        assert welcome is not None
        return welcome

    @property
    def model_name(self) -> str:
        """--served-model-name, else the engine's model name (a path's last component)."""
        if self.config.served_model_name:
            return self.config.served_model_name
        model = self.welcome.model
        return os.path.basename(model.rstrip("/")) or model

    @property
    def context_length(self) -> int:
        return self.welcome.context_length

    def model_names(self) -> tuple[str, ...]:
        """The names requests may use: the model's id, or the engine's name for it."""
        engine_name = self.welcome.model
        return (self.model_name, engine_name, os.path.basename(engine_name.rstrip("/")))

    def check_model(self, name: str | None) -> None:
        """Requests name the served model (or no model: there is one)."""
        if name is not None and name not in self.model_names():
            raise ApiError(404, f"The model '{name}' does not exist (this server serves "
                                f"'{self.model_name}')", type="invalid_request_error",
                           param="model", code="model_not_found")

    def default_max_tokens(self) -> int | None:
        """When a request names no limit: --default-max-tokens, else what is left of the
        context after the prompt (None: the engine works it out, as vLLM does)."""
        return self.config.default_max_tokens


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (checked while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the limit of {limit} bytes "
                         "(--max-body-bytes)", code="request_too_large")


def decode_body(body: bytes, kind: type[T]) -> T:
    """Parse and type-check a JSON body; a 400 naming the field otherwise."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.split("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise ApiError(400, f"invalid request: {text}", param=param, code="invalid_type") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the body nests JSON arrays or objects too deeply",
                       code="invalid_json") from None


async def request_body(ctx: HttpContext, request: Request, kind: type[S], *,
                       empty: bytes | None = None) -> S:
    """A route's body: read (413 past --max-body-bytes), parsed and type-checked, and
    within the request bounds (`bounds.check_request`); `empty`: the body to assume when
    none is sent."""
    body = await read_body(request, ctx.config.max_body_bytes)
    req = decode_body(empty if not body and empty is not None else body, kind)
    check_request(req, ctx.config)
    return req


PROGRAM_HEADER = "x-radixlm-program"
MAX_PROGRAM_CHARS = 256


def program_of(request: Request) -> str | None:
    """The program a request says it is part of (`x-radixlm-program`: `Generate.program`,
    scheduled together by `--schedule-policy program`); None without the header."""
    value = request.headers.get(PROGRAM_HEADER)
    if value is None:
        return None
    if not value or len(value) > MAX_PROGRAM_CHARS:
        raise ApiError(400, f"the {PROGRAM_HEADER} header must be 1-{MAX_PROGRAM_CHARS} "
                            "characters", param=PROGRAM_HEADER, code="invalid_value")
    return value


def now() -> int:
    return int(time.time())
