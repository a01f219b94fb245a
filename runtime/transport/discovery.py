"""Finding a user's radixlm server without copying paths: the default server.

Every user has one radixlm directory (`runtime_root`): ``$RADIXLM_RUNTIME_DIR`` when set,
else ``$XDG_RUNTIME_DIR/radixlm``, else ``<tmp>/radixlm.<uid>``; made 0700 and refused
when it is not the user's own. In it:

- ``default.sock``: the client socket of the **default server**, the one ``radixlm
  serve`` run without ``--endpoint`` (`DEFAULT_SOCKET`);
- ``default.lock``: held (``flock``) by that server for as long as it runs, with what it
  serves (pid, endpoint, HTTP URL, whether it is ready) as JSON (`DefaultServer`).

The first server to take the lock is the default for as long as it runs: a second
``radixlm serve`` never touches the first one's socket; it serves on a private socket of
its own and says where (`claim_default` returns None to it). The lock goes with the
process that held it (even on SIGKILL), so the next server to start takes over.

Clients (`client_endpoint`, `find_server`): the endpoint given, else
``$RADIXLM_ENDPOINT``, else the default server's socket, probed at once (probe.py), so
that no server is reported in milliseconds with what to do. Standard library only: the
SDK imports it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from radixlm.runtime.transport.probe import NoServerError, probe_endpoint

__all__ = [
    "DEFAULT_SOCKET",
    "ENDPOINT_ENV",
    "RUNTIME_DIR_ENV",
    "DefaultClaim",
    "DefaultServer",
    "RuntimeDirError",
    "claim_default",
    "client_endpoint",
    "default_endpoint",
    "default_server",
    "find_server",
    "runtime_root",
]

ENDPOINT_ENV = "RADIXLM_ENDPOINT"
RUNTIME_DIR_ENV = "RADIXLM_RUNTIME_DIR"
DEFAULT_SOCKET = "default.sock"
_LOCK_FILE = "default.lock"
_CLAIM_TRIES, _CLAIM_PAUSE_S = 20, 0.01


class RuntimeDirError(OSError):
    """The per-user radixlm directory cannot be used (the message says why)."""


@dataclass(frozen=True)
class DefaultServer:
    """What the default server wrote into its lock file."""

    pid: int
    endpoint: str
    http: str = ""  # its OpenAI-compatible base URL, "" without HTTP
    ready: bool = False  # False while its model loads


def runtime_root(*, create: bool = True) -> Path:
    """This user's radixlm directory (see the module doc); made 0700 when `create`."""
    given = os.environ.get(RUNTIME_DIR_ENV)
    if given:
        root = Path(given).expanduser()
    else:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
            root = Path(xdg) / "radixlm"
        else:
            root = Path(tempfile.gettempdir()) / f"radixlm.{os.getuid()}"
    if create:
        try:
            root.mkdir(mode=0o700, parents=bool(given), exist_ok=True)
        except OSError as e:
            raise RuntimeDirError(f"cannot make the radixlm directory {root}: {e.strerror} "
                                  f"(set {RUNTIME_DIR_ENV} to a directory of yours)") from None
    if root.exists():
        _check_private(root)
    return root


def _check_private(root: Path) -> None:
    """Refuse a directory another user could have planted (a shared /tmp)."""
    st = root.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise RuntimeDirError(f"{root} is not a directory (set {RUNTIME_DIR_ENV} to one of yours)")
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"{root} belongs to another user (set {RUNTIME_DIR_ENV} to a "
                              "directory of yours)")
    if st.st_mode & 0o077:
        root.chmod(0o700)


def default_endpoint(root: Path | None = None) -> str:
    """The default server's client endpoint."""
    return f"ipc://{(root or runtime_root(create=False)) / DEFAULT_SOCKET}"


def client_endpoint(given: str | None = None) -> tuple[str, str]:
    """(endpoint, where it came from) for a client: `given`, else ``$RADIXLM_ENDPOINT``,
    else the default server's socket. The second item names the source for messages."""
    if given:
        return given, "given"
    env = os.environ.get(ENDPOINT_ENV, "").strip()
    if env:
        return env, f"${ENDPOINT_ENV}"
    return default_endpoint(), "the default server"


def find_server(given: str | None = None, *, flag: str = "--endpoint") -> str:
    """The endpoint of the running server a client talks to (`client_endpoint`), checked:
    raises `NoServerError` at once when nothing listens there, naming where the endpoint
    came from and what to do (`flag`: how this client is given an endpoint)."""
    endpoint, source = client_endpoint(given)
    hint = f"start one with `radixlm serve`, or give the endpoint it printed ({flag})"
    try:
        probe_endpoint(endpoint, hint=hint)
    except NoServerError as e:
        if source == "the default server":
            raise NoServerError(f"no radixlm server is running (nothing at the default "
                                f"server's socket, {endpoint}); {hint}") from None
        if source != "given":
            raise NoServerError(f"{source}: {e.message}") from None
        raise
    return endpoint


def default_server(root: Path | None = None) -> DefaultServer | None:
    """The running default server's record, None when no server holds the lock."""
    path = (root or runtime_root(create=False)) / _LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: a server runs
            with os.fdopen(os.dup(fd), encoding="utf-8") as f:
                text = f.read()
            try:
                return DefaultServer(**json.loads(text))
            except (ValueError, TypeError):  # being written this instant
                return DefaultServer(pid=0, endpoint=default_endpoint(root))
        return None  # nobody holds it: what it says is stale
    finally:
        os.close(fd)


class DefaultClaim:
    """The default role, held by one server (its lock file descriptor stays open)."""

    def __init__(self, root: Path, fd: int) -> None:
        self.root = root
        self._fd = fd
        self.endpoint = default_endpoint(root)

    def publish(self, record: DefaultServer) -> None:
        """Say what this server serves (rewritten as it starts, then once ready)."""
        data = json.dumps(asdict(record)).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        """Give the role up (the socket file must be gone first). The lock file stays:
        removing it would let two servers lock two different files."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = -1


def claim_default(root: Path | None = None) -> DefaultClaim | DefaultServer:
    """Become the default server: a `DefaultClaim`, or the `DefaultServer` already holding
    the role (this server then serves elsewhere)."""
    root = root or runtime_root()
    fd = os.open(root / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    # A client reading the record holds a shared lock for a moment: try a few times
    # before concluding that a server holds it.
    for attempt in range(_CLAIM_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == _CLAIM_TRIES - 1:
                os.close(fd)
                holder = default_server(root)
                return holder or DefaultServer(pid=0, endpoint=default_endpoint(root))
            time.sleep(_CLAIM_PAUSE_S)
    claim = DefaultClaim(root, fd)
    claim.publish(DefaultServer(pid=os.getpid(), endpoint=claim.endpoint))
    return claim
