"""Errors in Anthropic's shape: ``{"type": "error", "error": {"type", "message"},
"request_id"}`` with the status Anthropic gives each kind (its SDKs pick the exception
class by status: 400 `BadRequestError`, 401 `AuthenticationError`, 404 `NotFoundError`,
413, 429, 529 `OverloadedError`, ...).

Every route raises the same `ApiError` as the OpenAI routes; only its rendering differs,
so the checks (and their messages) are shared.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
from radixlm.runtime.http.errors import ApiError
from starlette.responses import Response

_json = msgspec.json.Encoder()

# HTTP status -> Anthropic's error type
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 529: "overloaded_error"}
OVERLOADED = 529  # Anthropic's status for "try again later": the engine at capacity


def status_of(e: ApiError) -> int:
    """The engine at capacity is Anthropic's 529 (its SDKs retry it); the rest keep theirs."""
    return OVERLOADED if e.code == "capacity" else e.status


def request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


class DetailedError(ApiError):
    """An error whose ``error.details`` Anthropic's SDKs act on (its ``error_code`` picks
    the exception class; a thread refusal makes a tool runner send the whole history)."""

    def __init__(self, status: int, message: str, details: dict[str, Any], *,
                 param: str | None = None) -> None:
        super().__init__(status, message, param=param, code=details.get("error_code"))
        self.details = details


def body(e: ApiError, rid: str) -> dict[str, Any]:
    status = status_of(e)
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    error: dict[str, Any] = {"type": kind, "message": e.message}
    if isinstance(e, DetailedError):
        error["details"] = e.details
    return {"type": "error", "error": error, "request_id": rid}


def response(e: ApiError) -> Response:
    rid = request_id()
    status = status_of(e)
    headers = {"request-id": rid}
    if status in (429, 503, OVERLOADED):
        headers["retry-after"] = "1"
    return Response(_json.encode(body(e, rid)), status_code=status,
                    media_type="application/json", headers=headers)


def event(e: ApiError) -> bytes:
    """An error after the stream began (its status can no longer change): Anthropic's
    ``error`` event."""
    return b"event: error\ndata: " + _json.encode(body(e, request_id())) + b"\n\n"
