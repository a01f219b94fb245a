"""The frontend processes (the protocol frontend and the HTTP one) must not import torch:
they only tokenize, validate and route, and torch costs seconds of CPU at every start."""

from __future__ import annotations

import subprocess
import sys

# What the launcher's frontend role imports (launcher.child_main -> run_frontend).
_FRONTEND_IMPORTS = """
import sys
import radixlm.runtime.launcher
from radixlm.runtime.frontend import run_frontend
from radixlm.runtime.frontend import clients, frames, main, prepare, server, streams, validate
# The HTTP frontend is a protocol client like the SDK: it builds its app without them too.
from radixlm.runtime.http.app import build_app
from radixlm.runtime.http.config import HttpConfig
from radixlm.runtime.http import launch
build_app(HttpConfig(engine_endpoint="ipc:///nonexistent"))
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(",".join(heavy))
"""


def test_frontend_imports_no_torch() -> None:
    result = subprocess.run([sys.executable, "-c", _FRONTEND_IMPORTS], capture_output=True,
                            text=True, timeout=120, check=True)
    assert result.stdout.strip() == "", f"the frontend imported: {result.stdout.strip()}"


def test_sampling_reexports_the_torch_free_validation() -> None:
    from radixlm.runtime import sampling, sampling_params

    assert sampling.validate_sampling is sampling_params.validate_sampling
    assert sampling.MAX_TOP_LOGPROBS == sampling_params.MAX_TOP_LOGPROBS
