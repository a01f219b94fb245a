"""radixlm: a runtime for agent programs and multi-turn chat on a radix prefix KV cache.

`import radixlm as rl` gives the SDK's public names (see `radixlm.sdk`). They load on
first use: the server's processes import ``radixlm.runtime`` through this package, and
the SDK (anyio, the client stack) and ``importlib.metadata`` would add about a second to
each one's start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlm.sdk import *  # noqa: F401,F403
    from radixlm.sdk import __all__  # noqa: F401

    __version__: str


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("radixlm")  # the installed package's, as ``radixlm --version`` prints
        except PackageNotFoundError:  # a source tree that was never installed
            found = "0+unknown"
        globals()["__version__"] = found
        return found
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
    sdk = importlib.import_module("radixlm.sdk")
    if name == "__all__":
        return sdk.__all__
    try:
        value = getattr(sdk, name)
    except AttributeError:
        raise AttributeError(f"module 'radixlm' has no attribute {name!r}") from None
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *importlib.import_module("radixlm.sdk").__all__})
