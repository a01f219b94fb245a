"""radixlm: a runtime for agent programs and multi-turn chat on a radix prefix KV cache.

`import radixlm as rl` gives the SDK's public names (see `radixlm.sdk`).
"""

from radixlm.sdk import *  # noqa: F401,F403
from radixlm.sdk import __all__  # noqa: F401

__version__ = "0.1.0"
