"""The SDK's typed errors (``rl.BusyError``, ``rl.EngineDeadError``...).

The engine's errors, one class per protocol `ErrorCode` under `EngineError`, are the
neutral transport's (`radixlm.runtime.transport.errors`), which every client of the
engine shares; the SDK re-exports them and adds its own two: `EngineStartError`
(`rl.Engine` could not start the engine) and `ProgramError` (a program misused the SDK).
"""

from __future__ import annotations

from radixlm.runtime.transport.errors import (
    BadMessageError,
    BusyError,
    CapacityError,
    DuplicateIdError,
    EmptyPromptError,
    EngineDeadError,
    EngineError,
    EngineUnavailableError,
    ForbiddenError,
    HandshakeRequiredError,
    InternalError,
    InvalidParamsError,
    NoTemplateError,
    NotFoundError,
    TooLongError,
    UnknownTypeError,
    UnsupportedVersionError,
)
from radixlm.runtime.transport.errors import plain_errors as plain_errors  # for the SDK's modules

__all__ = [
    "BadMessageError",
    "BusyError",
    "CapacityError",
    "DuplicateIdError",
    "EmptyPromptError",
    "EngineDeadError",
    "EngineError",
    "EngineStartError",
    "EngineUnavailableError",
    "ForbiddenError",
    "HandshakeRequiredError",
    "InternalError",
    "InvalidParamsError",
    "NoTemplateError",
    "NotFoundError",
    "ProgramError",
    "TooLongError",
    "UnknownTypeError",
    "UnsupportedVersionError",
]


class EngineStartError(EngineDeadError):
    """`rl.Engine` could not start the engine process (the message has its log tail)."""

    code = "engine_start"


class ProgramError(RuntimeError):
    """A program used the SDK in a way it cannot run (not an engine error)."""
