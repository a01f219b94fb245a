"""examples/node-client against a live engine: the protocol from another language.

Runs `node demo.js ENDPOINT --json` (open a session, two streamed turns, a fork, one
constrained tool call) and checks the cached-token counts it reports (each turn after
the first is served its whole history from the cache) and the call's arguments. Skips, with the reason, when node or the client's installed
node_modules (`npm install` in examples/node-client; `make test` does it) are missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CLIENT_DIR = Path(__file__).resolve().parents[2] / "examples" / "node-client"
NODE = shutil.which("node")
MISSING = [
    name for name in ("zeromq", "@msgpack/msgpack")
    if not (CLIENT_DIR / "node_modules" / name / "package.json").exists()
]  # fmt: skip

pytestmark = [
    pytest.mark.skipif(NODE is None, reason="node is not installed"),
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"examples/node-client/node_modules lacks {MISSING}: run `npm install` there "
        "(make test does when npm exists)",
    ),
]


def history_in_cache(turn: dict, page_size: int) -> int:
    """A turn's history as the next turn finds it cached: all of it, in whole pages."""
    n_tokens = turn["session_length"]
    return n_tokens - n_tokens % page_size


def test_node_demo_sessions_and_fork(wire_server) -> None:
    assert NODE is not None
    proc = subprocess.run(
        [NODE, "demo.js", wire_server.endpoint, "--json", "--ignore-eos", "--max-tokens", "4"],
        cwd=CLIENT_DIR, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"demo.js failed:\n{proc.stdout}\n{proc.stderr}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    page = wire_server.welcome.page_size
    first, second, forked = summary["first"], summary["second"], summary["forked"]
    for turn in (first, second, forked):
        usage = turn["usage"]
        assert turn["session_length"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] == 4  # --ignore-eos: a fixed length
    # The second turn and the fork's turn get their whole history from the cache.
    assert second["usage"]["cached_tokens"] == history_in_cache(first, page)
    assert forked["usage"]["cached_tokens"] == history_in_cache(second, page)
    assert forked["usage"]["prompt_tokens"] > second["session_length"]
    # What streamed is what the turn returned (the demo prints chunks as they come).
    for turn in (first, second, forked):
        assert turn["text"] in proc.stdout
    # The constrained call: a call of the named tool whose arguments fit its schema.
    call = summary["tool_call"]
    args = json.loads(call["arguments"])
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F")
    assert re.fullmatch("[A-Z][a-z]{1,15}", args["city"]), args
