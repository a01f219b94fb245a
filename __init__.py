"""radixlm: a runtime for agent programs and multi-turn chat on a radix prefix KV cache.

`import radixlm as rl` gives the SDK's public names (see `radixlm.sdk`).
"""

from importlib.metadata import PackageNotFoundError, version

from radixlm.sdk import *  # noqa: F401,F403
from radixlm.sdk import __all__  # noqa: F401

try:
    __version__ = version("radixlm")
    """The installed package's version (as ``radixlm --version`` prints it)."""
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
del PackageNotFoundError, version
