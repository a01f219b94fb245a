"""radixlm.runtime.cli: the `radixlm` commands (``radixlm = radixlm.runtime.cli:main``;
``python -m radixlm.runtime.cli`` works too).

- `commands`: the parser of every command and `main`;
- `engine_flags`: the engine's flags (generated from `EngineConfig`'s declarations) and
  `config_from_args`; `state_flags`: serve's state-directory flags and `with_state`;
- `serve`, `generate`, `top`: the commands that need more than a few lines;
- `common`: what they share (logging, SIGTERM, finding the server).
"""

from radixlm.runtime.cli.commands import build_parser, main
from radixlm.runtime.cli.engine_flags import config_from_args

__all__ = ["build_parser", "config_from_args", "main"]
