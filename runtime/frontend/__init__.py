"""radixlm.runtime.frontend: the process between clients and the engine (tokenize,
render chat templates, detokenize, stop strings, client routing). Entry: `run_frontend`.

`run_frontend` loads on first use: `radixlm serve` imports small pieces of this package
(the gateway token's name) and must not pay for the tokenizer stack to do so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlm.runtime.frontend.main import run_frontend

__all__ = ["run_frontend"]


def __getattr__(name: str) -> Any:
    if name == "run_frontend":
        from radixlm.runtime.frontend.main import run_frontend

        return run_frontend
    raise AttributeError(f"module 'radixlm.runtime.frontend' has no attribute {name!r}")
