"""A multi-turn chat REPL on one engine session (also `radixlm chat`).

    python examples/chat.py                       # the embedded SmolLM2-135M-Instruct
    python examples/chat.py --message "Hi" --message "Tell me more" --max-tokens 32

Every turn appends only the new message to the session: the status line shows the share
of the prompt the engine served from its cache (the whole previous conversation).
"""

from __future__ import annotations

import sys

from radixlm.sdk.repl import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
