"""``rl.global_config``: SGLang's process-wide frontend settings (``sgl.global_config``).

SGLang's API needs this one piece of process-wide state (`set_default_backend` writes
``global_config.default_backend``); nothing else in the SDK is global.

- ``default_backend``: what programs run on when no ``backend=`` is given (an
  `rl.Engine`, `rl.connect(...)` client, `rl.RuntimeEndpoint` or `AsyncClient`).
- ``verbosity``: 2 or more prints a program's whole text when its run finishes.
- ``enable_precache_with_tracing``: `run_batch` of more than one program first prefills
  the program's constant prefix (found by tracing it) when it is over 64 characters, so
  every program of the batch finds it cached, as SGLang does.
- ``skip_special_tokens_in_output``, ``spaces_between_special_tokens_in_out``,
  ``enable_parallel_encoding``: kept for SGLang programs that set them; radixlm's engine
  always decodes without special tokens, and ``join("concate_and_append")`` always
  appends the forks' text (the engine has no KV concatenation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["GlobalConfig", "global_config"]


@dataclass
class GlobalConfig:
    verbosity: int = 0
    default_backend: Any = None
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True
    enable_precache_with_tracing: bool = True
    enable_parallel_encoding: bool = True


global_config = GlobalConfig()
