"""radixlm SDK: the public names re-exported as `radixlm` (``import radixlm as rl``).

SGLang's frontend vocabulary -- ``@rl.function``, ``rl.gen``, ``rl.select``, roles,
``s.fork()`` / ``join()``, ``run`` / ``run_batch`` -- running on engine sessions: every
call sends only what is new, forks share their prefix in the engine's radix cache.
"""

from radixlm.sdk.client import AsyncClient, TextStream
from radixlm.sdk.engine import Engine, Runtime
from radixlm.sdk.errors import (
    BadMessageError,
    BusyError,
    CapacityError,
    DuplicateIdError,
    EmptyPromptError,
    EngineDeadError,
    EngineError,
    EngineStartError,
    EngineUnavailableError,
    ForbiddenError,
    HandshakeRequiredError,
    InternalError,
    InvalidParamsError,
    NoTemplateError,
    NotFoundError,
    ProgramError,
    TooLongError,
    UnknownTypeError,
    UnsupportedVersionError,
)
from radixlm.sdk.lang import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    greedy_token_selection,
    select,
    sum_logprobs,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    user,
    user_begin,
    user_end,
)
from radixlm.sdk.program import Program, function, get_default_backend, set_default_backend
from radixlm.sdk.results import GenerateResult, StreamDelta
from radixlm.sdk.state import ProgramState, ProgramStateGroup
from radixlm.sdk.sync import ChatSession, Client, SyncTextStream, connect

RuntimeEndpoint = connect  # SGLang's sgl.RuntimeEndpoint(...): attach to a running engine

__all__ = [
    "AsyncClient",
    "BadMessageError",
    "BusyError",
    "CapacityError",
    "ChatSession",
    "Client",
    "DuplicateIdError",
    "EmptyPromptError",
    "Engine",
    "EngineDeadError",
    "EngineError",
    "EngineStartError",
    "EngineUnavailableError",
    "ForbiddenError",
    "GenerateResult",
    "HandshakeRequiredError",
    "InternalError",
    "InvalidParamsError",
    "NoTemplateError",
    "NotFoundError",
    "Program",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "StreamDelta",
    "SyncTextStream",
    "TextStream",
    "TooLongError",
    "UnknownTypeError",
    "UnsupportedVersionError",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "connect",
    "function",
    "gen",
    "get_default_backend",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "sum_logprobs",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "user",
    "user_begin",
    "user_end",
]
