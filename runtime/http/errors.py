"""Errors in OpenAI's JSON shape, with the HTTP status each kind deserves.

Every bad request gets ``{"error": {"message", "type", "param", "code"}}`` and a 4xx;
engine refusals are mapped by their protocol code (see `from_engine`).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from radixlm.runtime.transport.errors import EngineDeadError, EngineError
from starlette.responses import Response

_json = msgspec.json.Encoder()

# protocol error code -> (HTTP status, OpenAI error type)
_ENGINE_STATUS: dict[str, tuple[int, str]] = {
    "invalid_params": (400, "invalid_request_error"),
    "bad_message": (400, "invalid_request_error"),
    "empty_prompt": (400, "invalid_request_error"),
    "no_template": (400, "invalid_request_error"),
    "too_long": (400, "invalid_request_error"),
    "not_found": (404, "not_found_error"),
    "busy": (409, "conflict_error"),
    "capacity": (503, "server_overloaded"),
    "engine_dead": (503, "server_error"),
    "engine_unavailable": (503, "server_error"),
    "forbidden": (403, "permission_error"),
}
# protocol code -> the code OpenAI's own servers use for the same refusal
_OPENAI_CODE = {"too_long": "context_length_exceeded", "invalid_params": "invalid_value"}


class ApiError(Exception):
    """An error answered to the HTTP client (raised anywhere below a route)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        headers = {"retry-after": "1"} if self.status in (429, 503) else None
        return Response(_json.encode(self.body()), status_code=self.status,
                        media_type="application/json", headers=headers)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


# The server's internal endpoints and file paths, which HTTP clients have no use for.
_PARENS = re.compile(r" ?\((?:[a-z]+://|/)[^()\s]*\)")
_AT_ENDPOINT = re.compile(r" at [a-z]+://[^\s):,;]+(?::\d+)?")
_ENDPOINT = re.compile(r"[a-z]+://[^\s):,;]+(?::\d+)?")
_PATH = re.compile(r"(?<![\w/:.])/(?:[\w.@+-]+/)*[\w.@+-]+")


def public_message(message: str) -> str:
    """`message` without the endpoints and paths of the server's processes."""
    message = _AT_ENDPOINT.sub("", _PARENS.sub("", message))
    return _PATH.sub("(a path)", _ENDPOINT.sub("the server", message))


def from_engine(err: EngineError) -> ApiError:
    """The HTTP error for an engine refusal (or for a dead engine, said without the
    server's internal endpoints)."""
    dead = isinstance(err, EngineDeadError)
    code = "engine_dead" if dead else err.code
    status, kind = _ENGINE_STATUS.get(code, (500, "server_error"))
    message = f"the engine is not available: {public_message(err.message)}" if dead else err.message
    return ApiError(status, message, type=kind, code=_OPENAI_CODE.get(code, code))
