"""radixlm SDK: the public names re-exported as `radixlm` (``import radixlm as rl``).

SGLang's frontend vocabulary -- ``@rl.function``, ``rl.gen``, ``rl.select``, roles,
``s.fork()`` / ``join()``, ``run`` / ``run_batch`` -- running on engine sessions: every
call sends only what is new, forks share their prefix in the engine's radix cache.
"""

from radixlm.sdk import errors, lang, unsupported
from radixlm.sdk.backend import (
    flush_cache,
    get_default_backend,
    get_server_info,
    set_default_backend,
)
from radixlm.sdk.choices import ChoicesDecision, ChoicesSamplingMethod
from radixlm.sdk.client import AsyncClient
from radixlm.sdk.engine import Engine, Runtime
from radixlm.sdk.errors import *  # noqa: F403 - every typed error (errors.__all__)
from radixlm.sdk.global_config import GlobalConfig, global_config
from radixlm.sdk.lang import *  # noqa: F403 - the program vocabulary (lang.__all__)
from radixlm.sdk.program import Program, function
from radixlm.sdk.results import GenerateResult, StreamDelta
from radixlm.sdk.runtime_endpoint import RuntimeEndpoint
from radixlm.sdk.server_args import ServerArgs
from radixlm.sdk.state import ProgramState, ProgramStateGroup
from radixlm.sdk.sync import ChatSession, Client, SyncTextStream, connect
from radixlm.sdk.text_stream import TextStream
from radixlm.sdk.unsupported import *  # noqa: F403 - hosted backends, vision: clear errors

__all__ = [
    "AsyncClient",
    "ChatSession",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "Client",
    "Engine",
    "GenerateResult",
    "GlobalConfig",
    "Program",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "ServerArgs",
    "StreamDelta",
    "SyncTextStream",
    "TextStream",
    "connect",
    "flush_cache",
    "function",
    "get_default_backend",
    "get_server_info",
    "global_config",
    "set_default_backend",
]
__all__ += errors.__all__
__all__ += lang.__all__
__all__ += unsupported.__all__
