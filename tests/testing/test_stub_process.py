"""``python -m radixlm.testing``: the stub serving in a process of its own (how the SDK
overhead benchmark runs it) answers a client as the in-thread `StubServer` does; the
expected reply is recomputed from the toy model, independently of the stub."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import radixlm as rl
from toy_stub import chars, text_of, toy_generate


def test_the_stub_command_serves_a_client(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'stub.sock'}"
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.testing", "--endpoint", endpoint],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"stub serving at {endpoint}"
        with rl.connect(endpoint) as client:
            result = client.generate("Hello", max_tokens=7, ignore_eos=True)
            assert result.text == text_of(toy_generate(chars("Hello"), 7, ignore_eos=True))
            assert client.get_model_name() == "stub-toy"
    finally:
        proc.kill()
        proc.wait(timeout=10)
