"""A program on a pseudo-terminal, driven as a person at a keyboard would: Ctrl-C is the
byte ``\\x03`` typed into the terminal, which the kernel turns into SIGINT for the
terminal's foreground process group (not a signal the test sends to a chosen pid).

    with PtySession([sys.executable, "-m", "radixlm.runtime.cli", "chat"]) as term:
        term.expect("> ")
        term.type("hello\\r")
        term.type(CTRL_C)

Also: the processes a program started (`descendants`), found from /proc.
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import signal
import time
from collections.abc import Sequence

from conftest import child_cmdlines

CTRL_C = "\x03"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")


class PtySession:
    """`argv` as the session leader of a new pseudo-terminal (its controlling terminal)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        env = dict(os.environ if env is None else env)
        env.setdefault("TERM", "xterm")
        pid, fd = pty.fork()
        if pid == 0:  # the child: exec at once (nothing else runs after a fork)
            try:
                if cwd is not None:
                    os.chdir(cwd)
                # A program started at a terminal's prompt has SIGINT at its default; a
                # test run from a background job inherits it ignored (exec keeps SIG_IGN),
                # and Ctrl-C would then reach nothing.
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execvpe(argv[0], list(argv), env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self.output = ""  # everything read so far, escape sequences removed
        self._seen = 0  # `expect` looks from here on
        self.returncode: int | None = None

    def _read(self, timeout_s: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout_s)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the program closed the terminal (it exited)
            return False
        if not data:
            return False
        self.output += _ANSI.sub("", data.decode("utf-8", errors="replace"))
        return True

    def expect(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        """Wait for `pattern` (a regex) in the output after the last match; returns it."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            match = regex.search(self.output, self._seen)
            if match is not None:
                self._seen = match.end()
                return match
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.5)):
                match = regex.search(self.output, self._seen)
                if match is not None:
                    self._seen = match.end()
                    return match
                raise AssertionError(f"{pattern!r} not seen within {timeout_s} s; output:\n"
                                     f"{self.output}")

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout_s: float = 60.0) -> int:
        """The exit code, once the program has exited (reading what it still writes)."""
        deadline = time.monotonic() + timeout_s
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            assert time.monotonic() < deadline, f"still running; output:\n{self.output}"
            self._read(0.1)
        while self._read(0):  # what it wrote just before exiting
            if not select.select([self.fd], [], [], 0)[0]:
                break
        return self.returncode

    def close(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.wait(30)
        os.close(self.fd)

    def __enter__(self) -> PtySession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def descendants(pid: int) -> dict[int, list[str]]:
    """Every process below `pid`, with its command line."""
    out: dict[int, list[str]] = {}
    todo = [pid]
    while todo:
        for child, cmdline in child_cmdlines(todo.pop()).items():
            out[child] = [os.fsdecode(a) for a in cmdline if a]
            todo.append(child)
    return out


def engine_role_of(pid: int, timeout_s: float = 60.0) -> tuple[int, int, str]:
    """(`radixlm serve`'s pid, its engine process's pid, its client endpoint) for the
    server started, somewhere below `pid`, by ``rl.Engine`` or ``radixlm chat``."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs = descendants(pid)
        serve = next((p for p, argv in procs.items() if "serve" in argv), None)
        engine = next((p for p, argv in procs.items()
                       if "radixlm.runtime.server.child" in argv and "engine" in argv), None)
        if serve is not None and engine is not None:
            argv = procs[serve]
            return serve, engine, argv[argv.index("--endpoint") + 1]
        assert time.monotonic() < deadline, f"no engine below {pid}: {procs}"
        time.sleep(0.05)
