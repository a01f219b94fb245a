"""Shared fixtures: tiny models and real servers in subprocesses.

Fixture API (any test file may use these; nothing here imports torch at collection time):

- ``tiny_tokenizer_dir`` (session, str): a directory with only the tiny byte-level BPE
  tokenizer of tests/tiny_models.py (ChatML template; ``<|im_end|>`` = 2 is EOS). Fast:
  no model weights; for tokenizer/frontend unit tests.
- ``tiny_model_dir`` (session, Path): a complete tiny random Llama checkpoint
  (tests/tiny_models.py, context 256 tokens) with that tokenizer.
- ``server`` (session, `ServerHandle`): ``radixlm serve`` running in a subprocess on
  ``tiny_model_dir`` (CPU, float32, KV pool `SERVER_KV_TOKENS`, page size 1), on the
  default endpoint (an ipc socket in a private 0700 runtime directory), found through
  ``--endpoint-file``. Shared by every test of the session; stopped (SIGTERM) at the end,
  and the stop is checked: no child process of it may survive.
  ``ServerHandle``: ``endpoint``, ``welcome`` (the server's `Welcome`), ``model_dir``,
  ``pid``, ``child_pids``, ``log()`` (its output so far), ``client(**kw)`` (a new
  handshaken `RawClient`), ``stop()``.
- ``wire_server`` / ``wire_endpoint``: the same shared server (and its endpoint).
- ``raw_client`` (function, `RawClient`): a handshaken client of the shared server; at
  teardown it closes and the pool invariant is checked (see ``assert_pool_clean``).
- ``pool_integrity`` (function): checks the shared server's pool after the test, from a
  fresh client. Enable it for a whole module with
  ``pytestmark = pytest.mark.usefixtures("pool_integrity")``.
- ``check_pool`` (function): returns ``assert_pool_clean`` for tests to call themselves.
- ``fuzz_server`` / ``fuzz_endpoint`` / ``fuzz_server_log`` (module): a server of its own
  (own process group) for tests that try to break one; ``fuzz_server_log()`` is its log.
- ``start_test_server(workdir, model_dir, *flags)``: start one more server (a context
  manager yielding a `ServerHandle`), for tests that need their own (shutdown, flags).

``assert_pool_clean(client)`` waits until nothing runs, then asserts the engine's own
invariant flag, ``private == 0``, and ``free + evictable + protected == capacity``
recomputed here from the reported sizes.

Isolation (set as this module loads, inherited by every process a test starts): the
radixlm directory, where the default server's socket lives, is a private temporary one
(``$RADIXLM_RUNTIME_DIR``), and ``$RADIXLM_ENDPOINT`` is unset, so no test ever finds or
takes the user's real default server; servers start with ``--no-http`` unless a test
asks for HTTP (never the fixed default port). ``import triton`` is made to fail where no
GPU driver is present (torch imports it when installed; nothing on CPU uses it, and at
exit it prints ~40 lines of nanobind leak reports).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from radixlm.runtime.protocol import StatsReply, Welcome
from radixlm.runtime.server.environment import keep_triton_out
from radixlm.runtime.transport.raw_client import RawClient

keep_triton_out()


def _isolate_runtime_dir() -> None:
    """A radixlm directory of this test run's own (this module may be imported twice: as
    conftest and as tests.conftest; the first import sets it up)."""
    os.environ.pop("RADIXLM_ENDPOINT", None)
    if "RADIXLM_TEST_RUNTIME_DIR" in os.environ:
        os.environ["RADIXLM_RUNTIME_DIR"] = os.environ["RADIXLM_TEST_RUNTIME_DIR"]
        return
    root = tempfile.mkdtemp(prefix="rlm-test-", dir="/tmp")  # short: ipc paths are short
    os.environ["RADIXLM_TEST_RUNTIME_DIR"] = os.environ["RADIXLM_RUNTIME_DIR"] = root
    # `radixlm serve` keeps state by default: never in the user's own state directory.
    os.environ["RADIXLM_STATE_DIR"] = os.path.join(root, "state")
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(root, ignore_errors=True))


_isolate_runtime_dir()
HTTP_FLAGS = ("--http", "--port", "--host", "--no-http")

pytest.register_assert_rewrite("toy_stub")  # fixtures shared by the SDK's stub tests

SERVER_KV_TOKENS = 4096
SERVER_START_TIMEOUT_S = 240.0
SERVER_STOP_TIMEOUT_S = 20.0
IDLE_TIMEOUT_S = 30.0


# -- pool integrity ----------------------------------------------------------------------------


def assert_pool_clean(client: RawClient, timeout_s: float = IDLE_TIMEOUT_S) -> StatsReply:
    """Wait until no request runs or waits, then check the KV pool accounting."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        idle = stats.running == 0 and stats.waiting == 0 and stats.private == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert stats.running == 0 and stats.waiting == 0, f"requests still running: {stats}"
    assert stats.invariant_ok, f"the engine reports a broken pool invariant: {stats}"
    assert stats.private == 0, f"private KV left after every request ended: {stats}"
    assert stats.free + stats.evictable + stats.protected == stats.capacity, stats
    return stats


# -- servers in subprocesses ----------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid:
            children.append(int(entry.name))
    return children


def child_cmdlines(pid: int) -> dict[int, list[bytes]]:
    """Direct children of `pid` with their command lines; a child that exits between the
    listing and the read is left out (it is gone, not an error)."""
    out: dict[int, list[bytes]] = {}
    for child in children_of(pid):
        try:
            out[child] = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
    return out


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def pid_from_file(path: Path, proc: subprocess.Popen, timeout_s: float, what: str) -> int:
    """The pid written to `path` by `proc` (or a process it starts), once it is there."""
    deadline = time.monotonic() + timeout_s
    while not path.exists() or not path.read_text():
        assert proc.poll() is None, f"{what}: its starter exited first"
        assert time.monotonic() < deadline, f"{what} never started"
        time.sleep(0.05)
    return int(path.read_text())


def wait_until_gone(pids: list[int], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while any(process_alive(p) for p in pids):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@dataclass
class ServerHandle:
    endpoint: str
    welcome: Welcome
    model_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    endpoint_file: Path
    child_pids: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def client(self, **kwargs: object) -> RawClient:
        return RawClient(self.endpoint, **kwargs)  # type: ignore[arg-type]

    def stop(self) -> int:
        """SIGTERM the server and wait for it; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def survivors(self, wait_s: float = 5.0) -> list[int]:
        """Child processes still alive after `stop` (waits up to `wait_s` for them)."""
        deadline = time.monotonic() + wait_s
        while (alive := [p for p in self.child_pids if process_alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return alive


@contextlib.contextmanager
def start_test_server(workdir: Path, model_dir: Path, *flags: str) -> Iterator[ServerHandle]:
    """``radixlm serve`` on `model_dir` (CPU) in its own process group, without HTTP
    unless `flags` name it; stopped on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    endpoint_file = workdir / "endpoint"
    log_path = workdir / "server.log"
    no_http = [] if any(f in HTTP_FLAGS for f in flags) else ["--no-http"]
    # No state unless a test asks for it: test servers never touch the user's directory.
    no_state = [] if "--state-dir" in flags else ["--no-state"]
    command = [
        sys.executable, "-m", "radixlm.runtime.cli", "serve", "--model", str(model_dir),
        "--device", "cpu", "--dtype", "float32", "--kv-tokens", str(SERVER_KV_TOKENS),
        "--threads", "1", "--endpoint-file", str(endpoint_file), *no_http, *no_state, *flags,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                   start_new_session=True)
    handle = None
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not endpoint_file.exists():
            if process.poll() is not None:
                raise RuntimeError(f"radixlm serve exited with {process.returncode}:\n"
                                   f"{log_path.read_text(errors='replace')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"radixlm serve not ready in {SERVER_START_TIMEOUT_S} s:\n"
                                   f"{log_path.read_text(errors='replace')}")
            time.sleep(0.05)
        endpoint = endpoint_file.read_text().strip()
        with RawClient(endpoint, timeout_s=30) as probe:
            assert probe.welcome is not None
            welcome = probe.welcome
        handle = ServerHandle(endpoint, welcome, model_dir, process, log_path, endpoint_file,
                              child_pids=children_of(process.pid))
        yield handle
    finally:
        if handle is not None:
            handle.stop()
        elif process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# -- fixtures ----------------------------------------------------------------------------------


def _tiny_models():  # noqa: ANN202 - the module, imported lazily (it imports torch)
    import tiny_models

    return tiny_models


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    _tiny_models().make_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_models().make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"), "llama")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerHandle]:
    with start_test_server(tmp_path_factory.mktemp("server"), tiny_model_dir) as handle:
        yield handle
        code = handle.stop()
        assert code == 0, f"radixlm serve exited with {code} on SIGTERM:\n{handle.log()}"
        assert not handle.survivors(), f"server children outlived it: {handle.survivors()}"


@pytest.fixture(scope="session")
def wire_server(server: ServerHandle) -> ServerHandle:
    return server


@pytest.fixture(scope="session")
def wire_endpoint(server: ServerHandle) -> str:
    return server.endpoint


@pytest.fixture
def check_pool() -> Callable[..., StatsReply]:
    return assert_pool_clean


@pytest.fixture
def raw_client(server: ServerHandle) -> Iterator[RawClient]:
    with server.client(timeout_s=60) as client:
        yield client
        assert_pool_clean(client)


@pytest.fixture
def pool_integrity(server: ServerHandle) -> Iterator[None]:
    yield
    with server.client(timeout_s=60) as client:
        assert_pool_clean(client)


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerHandle]:
    with start_test_server(tmp_path_factory.mktemp("fuzz-server"), tiny_model_dir) as handle:
        yield handle


@pytest.fixture(scope="module")
def fuzz_endpoint(fuzz_server: ServerHandle) -> str:
    return fuzz_server.endpoint


@pytest.fixture(scope="module")
def fuzz_server_log(fuzz_server: ServerHandle) -> Callable[[], str]:
    return fuzz_server.log
