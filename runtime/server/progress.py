"""A one-line spinner for waits a person watches (an engine starting), on a terminal only.

    with Spinner("starting the engine (default)", status=latest_log_line):
        ...                      # the line shows the label, the seconds, the status

Drawn on `stream` (stderr) from a daemon thread, redrawn in place (``\\r``), erased when
the wait ends; where `stream` is not a terminal (a pipe, a log file, a test) it prints
nothing at all. Standard library only (the CLI and the SDK's `rl.Engine` use it).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Spinner", "starting_label"]

_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
_ASCII_FRAMES = "|/-\\"
_INTERVAL_S = 0.1
_STATUS_EVERY = 5  # frames between two questions to `status`


def starting_label(model: str) -> str:
    """What a spinner says while the engine for `model` (a name or a path) starts."""
    return f"starting the engine ({os.path.basename(model.rstrip('/')) or model})"


class Spinner:
    """``label``, a turning frame, the seconds waited and what `status()` says (asked
    about twice a second)."""

    def __init__(self, label: str, stream: TextIO | None = None,
                 status: Callable[[], str] | None = None) -> None:
        self.label = label
        self._status = status
        self._stream = stream if stream is not None else sys.stderr
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()
        encoding = (getattr(self._stream, "encoding", None) or "").lower()
        self._frames = _FRAMES if encoding.startswith("utf") else _ASCII_FRAMES

    @property
    def active(self) -> bool:
        """Whether it draws (its stream is a terminal)."""
        try:
            return self._stream.isatty()
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            return False

    def start(self) -> None:
        """Start drawing (on a terminal; idempotent)."""
        self._started = time.monotonic()
        if self.active and self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="radixlm-spinner",
                                            daemon=True)
            self._thread.start()

    def __enter__(self) -> Spinner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop and erase the line (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._write("\r\x1b[K")

    def _run(self) -> None:
        turn, status = 0, ""
        while not self._stop.wait(_INTERVAL_S if turn else 0):
            if self._status is not None and turn % _STATUS_EVERY == 0:
                try:
                    status = self._status()
                except Exception:  # noqa: BLE001 - a status is decoration; never fail on it
                    status = ""
            width = shutil.get_terminal_size((80, 24)).columns
            elapsed = time.monotonic() - self._started
            frame = self._frames[turn % len(self._frames)]
            line = f"{frame} {self.label} {elapsed:.0f}s"
            if status:
                line += f"  {status}"
            self._write("\r" + line[: max(width - 1, 10)] + "\x1b[K")
            turn += 1

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # the terminal went away
            self._stop.set()
