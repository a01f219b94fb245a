"""How the HTTP process gets its settings: `radixlm serve` gives its child one typed spec
on stdin (no flags, and its API key in neither its argv nor its environment), and a user
still attaches one to a running server with flags."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from conftest import child_cmdlines
from http_helpers import API_KEY, HttpServer, free_port
from radixlm.runtime.http.launch import wait_ready
from radixlm.runtime.http.main import SPEC_FLAG


def _http_child(server: HttpServer) -> int:
    for pid, argv in child_cmdlines(server.server.pid).items():
        if b"radixlm.runtime.http" in argv:
            return pid
    raise AssertionError("no HTTP process under the server")


def test_serve_gives_its_http_process_one_typed_spec(http_server: HttpServer) -> None:
    pid = _http_child(http_server)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    assert argv[1:] == [b"-m", b"radixlm.runtime.http", SPEC_FLAG.encode()]
    assert API_KEY.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    # Its settings came in the spec: the server was started with --max-body-bytes 65536.
    status, body = http_server.request("POST", "/v1/chat/completions", b" " * 70_000)
    assert status == 413, body


def test_a_user_attaches_an_http_process_to_a_running_server(http_server: HttpServer) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixlm.runtime.http", "--engine", http_server.server.endpoint,
         "--http", f"127.0.0.1:{port}", "--max-tools", "1", "--served-model-name", "mine"],
        stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_ready("127.0.0.1", port, proc, 60)
        attached = HttpServer(http_server.server, f"http://127.0.0.1:{port}", "mine",
                              http_server.model_dir, api_key="")
        status, body = attached.request("GET", "/v1/models", key=None)
        assert status == 200 and [m["id"] for m in body["data"]] == ["mine"], body
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        status, body = attached.request("POST", "/v1/chat/completions", json.dumps({
            "model": "mine", "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool, tool]}).encode(), key=None)
        assert status == 400 and "--max-tools" in body["error"]["message"], body
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
