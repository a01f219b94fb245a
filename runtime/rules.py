"""The one exception type for requests the runtime refuses (engine and frontend)."""

from __future__ import annotations


class RequestError(Exception):
    """A refused request: `code` is a protocol ErrorCode, `message` says why (both go to
    the client in an `Error`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
