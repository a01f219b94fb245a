"""The start-up spinner draws only on a terminal, redraws one line in place, shows what
the status callback says, and erases itself; anywhere else it writes nothing."""

from __future__ import annotations

import io
import time

from radixlm.runtime.server.progress import Spinner, starting_label


class Terminal(io.StringIO):
    encoding = "utf-8"

    def isatty(self) -> bool:
        return True


def test_the_spinner_draws_on_a_terminal_and_erases_itself() -> None:
    out = Terminal()
    with Spinner(starting_label("/models/tiny-llama/"), stream=out, status=lambda: "loading"):
        deadline = time.monotonic() + 30
        while out.getvalue().count("\r") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    text = out.getvalue()
    assert "starting the engine (tiny-llama)" in text and "loading" in text
    assert "\n" not in text  # one line, redrawn in place
    assert text.endswith("\r\x1b[K")  # erased at the end


def test_the_spinner_is_silent_elsewhere() -> None:
    out = io.StringIO()  # a pipe, a log file: not a terminal
    with Spinner("starting", stream=out):
        time.sleep(0.3)
    assert out.getvalue() == ""
