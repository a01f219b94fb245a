"""radixlm SDK: the public names re-exported as `radixlm` (``import radixlm as rl``).

SGLang's frontend vocabulary -- ``@rl.function``, ``rl.gen``, ``rl.select``, roles,
``s.fork()`` / ``join()``, ``run`` / ``run_batch`` -- running on engine sessions: every
call sends only what is new, forks share their prefix in the engine's radix cache.
"""

from radixlm.sdk import errors, lang
from radixlm.sdk.client import AsyncClient, TextStream
from radixlm.sdk.engine import Engine, Runtime
from radixlm.sdk.errors import *  # noqa: F403 - every typed error (errors.__all__)
from radixlm.sdk.lang import *  # noqa: F403 - the program vocabulary (lang.__all__)
from radixlm.sdk.program import (
    Program,
    flush_cache,
    function,
    get_default_backend,
    set_default_backend,
)
from radixlm.sdk.results import GenerateResult, StreamDelta
from radixlm.sdk.state import ProgramState, ProgramStateGroup
from radixlm.sdk.sync import ChatSession, Client, SyncTextStream, connect

RuntimeEndpoint = connect  # SGLang's sgl.RuntimeEndpoint(...): attach to a running engine

__all__ = [
    "AsyncClient",
    "ChatSession",
    "Client",
    "Engine",
    "GenerateResult",
    "Program",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "StreamDelta",
    "SyncTextStream",
    "TextStream",
    "connect",
    "flush_cache",
    "function",
    "get_default_backend",
    "set_default_backend",
]
__all__ += errors.__all__
__all__ += lang.__all__
