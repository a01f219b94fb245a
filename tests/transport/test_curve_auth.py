"""CurveZMQ on the client endpoint: `radixlm keys` makes zmq.auth certificates, `serve
--auth-dir` accepts only authorized client keys (libzmq's CURVE, zmq.auth's ZAP
handler), the SDK connects with its keys, and a public TCP endpoint needs keys or
--insecure. Port 0: the bound port is what the endpoint file and the log report."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import radixlm as rl
import zmq.auth

CLI = [sys.executable, "-m", "radixlm.runtime.cli"]
NODE = shutil.which("node")
NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node-client"
START_TIMEOUT_S = 240.0


def make_keys(directory: Path, *clients: str) -> subprocess.CompletedProcess[str]:
    args = [a for name in clients for a in ("--client", name)]
    return subprocess.run([*CLI, "keys", str(directory), *args], capture_output=True, text=True,
                          timeout=60, check=True)


@contextlib.contextmanager
def serve(workdir: Path, model_dir: Path, *flags: str) -> Iterator[tuple[str, Path]]:
    """``radixlm serve`` with `flags`; yields (the endpoint it wrote, its log)."""
    endpoint_file, log_path = workdir / "endpoint", workdir / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*CLI, "serve", "--model", str(model_dir), "--device", "cpu", "--kv-tokens", "1024",
             "--threads", "1", "--endpoint-file", str(endpoint_file), *flags],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not endpoint_file.exists():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        yield endpoint_file.read_text().strip(), log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_keys_layout_is_zmq_auth_certificates(tmp_path: Path) -> None:
    auth = tmp_path / "auth"
    out = make_keys(auth, "alice", "bob").stdout
    assert "alice.key_secret" in out and "bob.key_secret" in out
    assert stat.S_IMODE(auth.stat().st_mode) == 0o700
    server_public, server_secret = zmq.auth.load_certificate(auth / "server.key_secret")
    assert len(server_public) == 40 and len(server_secret) == 40  # Z85 of 32-byte keys
    assert stat.S_IMODE((auth / "server.key_secret").stat().st_mode) == 0o600
    for name in ("alice", "bob"):
        public, secret = zmq.auth.load_certificate(auth / "clients" / f"{name}.key_secret")
        assert secret and zmq.auth.load_certificate(auth / "authorized_clients" /
                                                    f"{name}.key")[0] == public
    # Run again: the server key stays, a new client is added.
    make_keys(auth, "carol")
    assert zmq.auth.load_certificate(auth / "server.key_secret")[0] == server_public
    assert (auth / "authorized_clients" / "carol.key").exists()


def test_client_keys_are_read_by_one_loader(tmp_path: Path) -> None:
    """`load_curve_keys` (the SDK's `server_key`/`client_key`, the CLI's --server-key /
    --client-key) reads zmq.auth's files: both halves of the client's pair and the
    server's public key; each wrong input is a ValueError naming it, in the caller's terms."""
    from radixlm.runtime.transport.curve import load_curve_keys

    auth = tmp_path / "auth"
    make_keys(auth, "alice")
    server_key, secret_key = auth / "server.key", auth / "clients" / "alice.key_secret"
    keys = load_curve_keys(server_key, secret_key)
    assert keys is not None
    server_public, _ = zmq.auth.load_certificate(auth / "server.key_secret")
    public, secret = zmq.auth.load_certificate(secret_key)
    assert keys.socket_options() == {zmq.CURVE_SERVERKEY: server_public,
                                     zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}
    assert load_curve_keys(None, None) is None
    with pytest.raises(ValueError, match="needs both server_key .* and client_key"):
        load_curve_keys(server_key, None)
    with pytest.raises(ValueError, match="--client-key"):
        load_curve_keys(server_key, None, names=("--server-key", "--client-key"))
    with pytest.raises(ValueError, match="holds no secret key"):  # the public half only
        load_curve_keys(server_key, auth / "clients" / "alice.key")
    with pytest.raises(ValueError, match="cannot read the CurveZMQ keys"):
        load_curve_keys(tmp_path / "missing.key", secret_key)


def test_public_tcp_without_auth_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    proc = subprocess.run([*CLI, "serve", "--model", str(tiny_model_dir), "--endpoint",
                           "tcp://x@*:5555"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "user part" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([*CLI, "serve", "--model", str(tiny_model_dir), "--endpoint",
                           "tcp://0:5555"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "--auth-dir" in proc.stderr and "--insecure" in proc.stderr


@pytest.fixture(scope="module")
def curve_server(tmp_path_factory: pytest.TempPathFactory,
                 tiny_model_dir: Path) -> Iterator[tuple[str, Path, Path]]:
    """A server with --auth-dir on tcp://0.0.0.0:0: (client address, auth dir, its log)."""
    tmp = tmp_path_factory.mktemp("curve")
    auth = tmp / "auth"
    make_keys(auth, "alice")
    with serve(tmp, tiny_model_dir, "--auth-dir", str(auth), "--endpoint",
               "tcp://0.0.0.0:0") as (endpoint, log):
        port = int(endpoint.rsplit(":", 1)[1])
        assert endpoint == f"tcp://0.0.0.0:{port}" and port > 0  # port 0: the bound port
        yield f"tcp://127.0.0.1:{port}", auth, log


def test_curve_server_accepts_only_authorized_keys(curve_server: tuple[str, Path, Path],
                                                   tmp_path: Path) -> None:
    address, auth, log = curve_server
    assert "EVERY network interface" in log.read_text()  # the loud wildcard warning
    stranger = tmp_path / "stranger"
    make_keys(stranger, "mallory")  # a key pair the server never authorized
    with rl.connect(address, server_key=auth / "server.key",
                    client_key=auth / "clients" / "alice.key_secret") as client:
        assert client.generate("hi", max_tokens=2, temperature=0).text is not None
    with pytest.raises(rl.EngineDeadError, match="authorized"):
        rl.connect(address, connect_timeout=3, server_key=auth / "server.key",
                   client_key=stranger / "clients" / "mallory.key_secret")
    with pytest.raises(rl.EngineDeadError):  # no keys at all: no CURVE handshake
        rl.connect(address, connect_timeout=3)


def test_cli_clients_take_the_keys(curve_server: tuple[str, Path, Path]) -> None:
    """`radixlm generate --endpoint` and `radixlm sessions` reach an --auth-dir server with
    --server-key / --client-key, and say what is missing without them."""
    address, auth, _ = curve_server
    keys = ["--server-key", str(auth / "server.key"),
            "--client-key", str(auth / "clients" / "alice.key_secret")]
    gen = subprocess.run([*CLI, "generate", "hi", "--endpoint", address, "--max-tokens", "2",
                          *keys], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    listed = subprocess.run([*CLI, "sessions", "--endpoint", address, *keys],
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and "SESSION" in listed.stdout, listed.stderr
    chat = subprocess.run([*CLI, "chat", "--endpoint", address, "--message", "hi",
                           "--max-tokens", "2", *keys], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert chat.returncode == 0 and "tokens in" in chat.stdout, chat.stderr
    half = subprocess.run([*CLI, "sessions", "--endpoint", address, keys[0], keys[1]],
                          capture_output=True, text=True, timeout=60)
    assert half.returncode == 2 and "--client-key" in half.stderr
    keyless = subprocess.run([*CLI, "sessions", "--endpoint", address, "--timeout", "2"],
                             capture_output=True, text=True, timeout=60)
    assert keyless.returncode == 1 and "radixlm sessions:" in keyless.stderr


@pytest.mark.skipif(NODE is None or not (NODE_DIR / "node_modules" / "zeromq").exists(),
                    reason="node or examples/node-client/node_modules missing")
def test_node_client_with_keys(curve_server: tuple[str, Path, Path]) -> None:
    address, auth, _ = curve_server
    assert NODE is not None
    demo = [NODE, "demo.js", address, "--json", "--max-tokens", "2"]
    keys = ["--server-key", str(auth / "server.key"),
            "--client-key", str(auth / "clients" / "alice.key_secret")]
    ok = subprocess.run([*demo, *keys], cwd=NODE_DIR, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.strip().splitlines()[-1])["second"]["usage"]["cached_tokens"] > 0


def test_loopback_port_zero_becomes_ready(tmp_path: Path, tiny_model_dir: Path) -> None:
    with serve(tmp_path, tiny_model_dir, "--endpoint", "tcp://127.0.0.1:0") as (endpoint, _):
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        with rl.connect(endpoint) as client:
            assert client.generate("hi", max_tokens=1, temperature=0).text is not None
