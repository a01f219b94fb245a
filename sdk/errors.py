"""The SDK's typed errors (``rl.BusyError``, ``rl.EngineDeadError``...).

The engine's errors, one class per protocol `ErrorCode` under `EngineError`, are the
neutral transport's (`radixlm.runtime.transport.errors`), which every client of the
engine shares; the SDK re-exports them and adds its own three: `EngineStartError`
(`rl.Engine` could not start the engine), `ProgramError` (a program misused the SDK) and
`UnsupportedError` (a part of SGLang's frontend radixlm refuses by design).
"""

from __future__ import annotations

from radixlm.runtime.transport import errors as _engine
from radixlm.runtime.transport.errors import *  # noqa: F403 - the engine's error classes
from radixlm.runtime.transport.errors import EngineDeadError
from radixlm.runtime.transport.errors import plain_errors as plain_errors  # for the SDK's modules

# The exception classes (`error_from_reply` and `plain_errors` are not ``rl.*`` names).
__all__ = sorted([*(n for n in _engine.__all__ if n.endswith("Error")), "EngineStartError",
                  "ProgramError", "UnsupportedError"])


class EngineStartError(EngineDeadError):
    """`rl.Engine` could not start the engine process (the message has its log tail)."""

    code = "engine_start"


class ProgramError(RuntimeError):
    """A program used the SDK in a way it cannot run (not an engine error)."""


class UnsupportedError(NotImplementedError):
    """A part of SGLang's frontend that radixlm does not provide by design (hosted API
    backends, image and video inputs); the message says what to use instead."""
