"""The files a server keeps in its private runtime directory, besides the sockets.

- ``owner``: the pid and start time of the process that made the directory. A directory
  whose owner is gone (a ``radixlm serve`` killed with SIGKILL cannot clean up) is stale,
  and the next server to start removes it (`remove_stale`). Several servers of the same
  user may run at once: a directory is removed only when its owner is certainly dead
  (no such pid, or the pid now belongs to a process started at another time).
- ``ready``: written by the frontend once its client socket is bound: the endpoint it is
  bound to (with the port the system picked for port 0) and the `Welcome` it sends
  clients. The launcher waits for it instead of connecting as a client, which also works
  when clients must authenticate (``--auth-dir``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import msgspec
from radixlm.runtime.protocol import Welcome

__all__ = ["OWNER_FILE", "READY_FILE", "Ready", "read_ready", "remove_stale", "write_owner",
           "write_ready"]

log = logging.getLogger("radixlm.rundir")

OWNER_FILE = "owner"
READY_FILE = "ready"


class Ready(msgspec.Struct, frozen=True):
    endpoint: str
    welcome: Welcome


def process_start_time(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (Linux), None if it does not run
    (a zombie counts as gone) or cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return fields[19]  # field 22 of /proc/PID/stat, counted after the command name


def _owner_text(pid: int) -> str:
    return f"{pid} {process_start_time(pid) or '?'}\n"


def write_owner(directory: Path, pid: int | None = None) -> None:
    """Record which process owns `directory` (default: this one)."""
    _write_atomic(directory / OWNER_FILE, _owner_text(pid or os.getpid()).encode())


def _owner_is_dead(directory: Path) -> bool:
    try:
        pid_text, started = (directory / OWNER_FILE).read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return False  # no owner file yet (being created) or unreadable: not ours to judge
    if not Path("/proc").is_dir():  # not Linux: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    now = process_start_time(pid)
    # Gone, a zombie, or the pid reused by a process started at another time.
    return now is None or (started != "?" and now != started)


def remove_stale(parent: Path, prefix: str = "radixlm-") -> list[Path]:
    """Remove this user's runtime directories under `parent` whose owner is dead; returns
    the ones removed."""
    removed = []
    uid = os.getuid()
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            if not entry.name.startswith(prefix):
                continue
            try:
                st = entry.lstat()
            except OSError:
                continue
            if st.st_uid != uid or not entry.is_dir() or entry.is_symlink():
                continue
            if _owner_is_dead(entry):
                shutil.rmtree(entry, ignore_errors=True)
                log.debug("removed the stale runtime directory %s (its server is gone)", entry)
                removed.append(entry)
    return removed


def write_ready(directory: Path, endpoint: str, welcome: Welcome) -> None:
    _write_atomic(directory / READY_FILE, msgspec.msgpack.encode(Ready(endpoint, welcome)))


def read_ready(directory: Path) -> Ready | None:
    try:
        data = (directory / READY_FILE).read_bytes()
    except FileNotFoundError:
        return None
    return msgspec.msgpack.decode(data, type=Ready)


def _write_atomic(path: Path, data: bytes) -> None:
    """Readers never see a half-written file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
