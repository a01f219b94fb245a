"""The state directory: where a server keeps what must outlive its processes.

``radixlm serve --state-dir DIR`` (by default `default_state_dir`: ``$RADIXLM_STATE_DIR``,
else ``$XDG_STATE_HOME/radixlm``, else ``~/.local/state/radixlm``; ``--no-state``: none).
It is made 0700 and must be the user's own; its files are made 0600. One server uses it
at a time: the process that starts the server holds an exclusive ``flock`` on
``DIR/lock`` for as long as it runs (the lock goes with its holder, even on SIGKILL), so a
second server on the same directory gets one clear line and serves without state.

Everything model-specific lives under ``DIR/models/<fingerprint>/`` (`model_dir`):
sessions, pins and the disk KV tier of the engine, the HTTP API's stored responses and
conversations. State of another model stays where it is, unused, until that model is
served again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

ENV = "RADIXLM_STATE_DIR"
LOCK_FILE = "lock"
MODELS = "models"
DIR_MODE = 0o700
FILE_MODE = 0o600


class StateDirError(Exception):
    """The state directory cannot be used; the message is one line for the log."""


def default_state_dir() -> Path:
    """``$RADIXLM_STATE_DIR``, else ``$XDG_STATE_HOME/radixlm``, else ``~/.local/state/radixlm``."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "state"
    return base / "radixlm"


def make_private_dir(path: Path) -> Path:
    """`path` as a directory of this user's, mode 0700 (made with its parents if missing);
    `StateDirError` when it cannot be."""
    try:
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as e:
        raise StateDirError(f"state directory {path}: {_why(e)}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StateDirError(f"state directory {path}: not a directory")
    if st.st_uid != os.getuid():
        raise StateDirError(f"state directory {path}: owned by uid {st.st_uid}, not by this "
                            f"user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        try:
            path.chmod(DIR_MODE)  # ours: others have no business in it
        except OSError as e:
            raise StateDirError(f"state directory {path}: {_why(e)}") from None
    return path


def _why(e: OSError) -> str:
    if e.errno in (errno.EROFS,):
        return "read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if e.errno == errno.ENOSPC:
        return "no space left on the device"
    return e.strerror or str(e)


@dataclass
class StateDir:
    """An open, locked state directory (`open_state_dir`). Close it (or let its process
    end) to let another server use it."""

    path: Path
    lock_fd: int = field(repr=False)

    def model_dir(self, fingerprint: str) -> Path:
        """``DIR/models/<fingerprint>``, made 0700 if missing."""
        return make_private_dir(self.path / MODELS / fingerprint)

    def other_models(self, fingerprint: str) -> list[str]:
        """Fingerprints of the other models whose state this directory keeps (unused)."""
        with contextlib.suppress(OSError):
            return sorted(p.name for p in (self.path / MODELS).iterdir()
                          if p.is_dir() and p.name != fingerprint)
        return []

    def close(self) -> None:
        if self.lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)  # releases the flock
            self.lock_fd = -1


def open_state_dir(path: str | os.PathLike[str]) -> StateDir:
    """Make (if missing), check and lock the state directory at `path`.

    Raises `StateDirError` (one line) when it is not usable: not a directory, not this
    user's, not writable (read-only, permissions, a full disk), or locked by another
    running server (named by its pid)."""
    root = make_private_dir(Path(path).expanduser().absolute())
    lock_path = root / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        raise StateDirError(f"state directory {root}: {_why(e)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        who = f"pid {holder}" if holder else "another process"
        raise StateDirError(f"state directory {root} is in use by another radixlm server "
                            f"({who}); give another --state-dir, or --no-state") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        probe = root / f".probe-{os.getpid()}"
        probe.write_bytes(b"")  # writable (not a read-only mount, not a full inode table)
        probe.unlink()
    except OSError as e:
        os.close(fd)
        raise StateDirError(f"state directory {root}: {_why(e)}") from None
    return StateDir(root, fd)


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    return None
