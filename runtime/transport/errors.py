"""Typed engine errors: one exception class per protocol `ErrorCode`, all under `EngineError`.

The engine's ``Error`` reply carries a stable ``code``; `error_from_reply` turns it into
the matching class so callers can ``except rl.BusyError`` instead of comparing strings.
`EngineDeadError` is the client side's own: the engine stopped answering (or its process
exited). Every client of the engine (the SDK, which re-exports these as ``rl.*Error``,
and the HTTP server) raises these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

from radixlm.runtime.protocol import Error, ErrorCode

__all__ = [
    "BadMessageError",
    "BusyError",
    "CapacityError",
    "DuplicateIdError",
    "EmptyPromptError",
    "EngineDeadError",
    "EngineError",
    "EngineUnavailableError",
    "ForbiddenError",
    "HandshakeRequiredError",
    "InternalError",
    "InvalidParamsError",
    "NoServerError",
    "NoTemplateError",
    "NotFoundError",
    "TooLongError",
    "UnknownTypeError",
    "UnsupportedVersionError",
    "error_from_reply",
    "plain_errors",
]


class EngineError(Exception):
    """An error the engine reported (or, for `EngineDeadError`, the engine's absence).

    ``code`` is the protocol's stable `ErrorCode` string; ``rid`` the request it answers.
    """

    code: ClassVar[str] = "engine_error"

    def __init__(self, message: str, *, rid: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.rid = rid

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class BadMessageError(EngineError):
    """A message the engine could not decode (not msgpack, or not a valid message)."""

    code = ErrorCode.BAD_MESSAGE


class UnknownTypeError(EngineError):
    """A message ``type`` this engine does not know (a newer client?)."""

    code = ErrorCode.UNKNOWN_TYPE


class UnsupportedVersionError(EngineError):
    """The engine speaks another protocol version than this client."""

    code = ErrorCode.UNSUPPORTED_VERSION


class HandshakeRequiredError(EngineError):
    """A request sent before the ``Hello`` / ``Welcome`` handshake."""

    code = ErrorCode.HANDSHAKE_REQUIRED


class InvalidParamsError(EngineError, ValueError):
    """A value out of range: sampling options, ``n``, lengths, session
    arguments. The message names the value."""

    code = ErrorCode.INVALID_PARAMS


class EmptyPromptError(EngineError, ValueError):
    """A generation with nothing to start from (empty text and history)."""

    code = ErrorCode.EMPTY_PROMPT


class TooLongError(EngineError, ValueError):
    """Prompt plus ``max_tokens`` beyond the model's context, more than the KV pool
    could ever hold, or a request larger than the server's message size limit."""

    code = ErrorCode.TOO_LONG


class NotFoundError(EngineError, LookupError):
    """An unknown (or closed, or another client's) session, pin or request id."""

    code = ErrorCode.NOT_FOUND


class DuplicateIdError(EngineError):
    """A request id already in flight, or a pin name already taken."""

    code = ErrorCode.DUPLICATE_ID


class BusyError(EngineError):
    """The session already has a request in flight: one turn at a time."""

    code = ErrorCode.BUSY


class CapacityError(EngineError):
    """The retention cap is reached (sessions and pins hold too much), or the
    pool cannot fit the request next to what they hold."""

    code = ErrorCode.CAPACITY


class NoTemplateError(EngineError):
    """Chat messages given, but the model has no chat template."""

    code = ErrorCode.NO_TEMPLATE


class InternalError(EngineError):
    """A fault inside the engine; the engine keeps serving other requests."""

    code = ErrorCode.INTERNAL


class ForbiddenError(EngineError, PermissionError):
    """Not allowed on this server (e.g. flushing the cache of a server shared by tenants)."""

    code = ErrorCode.FORBIDDEN


class EngineDeadError(EngineError, ConnectionError):
    """The engine stopped answering, its process exited, or the client was closed."""

    code = "engine_dead"


class NoServerError(EngineDeadError):
    """Nothing listens at the endpoint: no server runs there. Reported at once (a
    client looks before it waits), with where the endpoint came from and what to do."""

    code = "no_server"


class EngineUnavailableError(EngineDeadError):
    """The server's frontend answers, but its engine process stopped answering (frozen,
    stopped, or stuck); the request was failed by the frontend."""

    code = ErrorCode.ENGINE_UNAVAILABLE


_BY_CODE: dict[str, type[EngineError]] = {
    cls.code: cls
    for cls in (
        BadMessageError, UnknownTypeError, UnsupportedVersionError, HandshakeRequiredError,
        InvalidParamsError, EmptyPromptError, TooLongError, NotFoundError, DuplicateIdError,
        BusyError, CapacityError, NoTemplateError, InternalError, EngineUnavailableError,
        ForbiddenError,
    )
}


class _UnknownCodeError(EngineError):
    """An error code this client does not know (a newer engine): the code is kept as given."""

    def __init__(self, code: str, message: str, *, rid: str | None = None) -> None:
        super().__init__(message, rid=rid)
        self.code = code  # type: ignore[misc]  # instance attribute shadows the ClassVar


def error_from_reply(err: Error) -> EngineError:
    """The typed exception for an engine ``Error`` reply."""
    cls = _BY_CODE.get(err.code)
    if cls is None:
        return _UnknownCodeError(err.code, err.message, rid=err.rid)
    return cls(err.message, rid=err.rid)


try:  # Python 3.11+
    _BaseExceptionGroup = BaseExceptionGroup  # type: ignore[name-defined]
except NameError:  # pragma: no cover - Python 3.10 (anyio depends on the backport there)
    from exceptiongroup import BaseExceptionGroup as _BaseExceptionGroup


@contextlib.contextmanager
def plain_errors() -> Iterator[None]:
    """Around an anyio task group: raise its first real error as itself (an `EngineError`
    stays typed for the caller) rather than as an ``ExceptionGroup``."""
    try:
        yield
    except _BaseExceptionGroup as group:
        leaf = _first_leaf(group)
        if leaf is None:
            raise
        raise leaf from None


def _first_leaf(exc: BaseException) -> BaseException | None:
    """The first plain ``Exception`` in a (nested) group; cancellations are not errors."""
    if isinstance(exc, _BaseExceptionGroup):
        for inner in exc.exceptions:
            leaf = _first_leaf(inner)
            if leaf is not None:
                return leaf
        return None
    return exc if isinstance(exc, Exception) else None
