"""How a process ended, in words: an exit code, or the signal that stopped or killed it
(a negative code from `subprocess`; 128 + N from radixlm's own processes, which exit so
on SIGTERM and SIGINT)."""

from __future__ import annotations

import signal

__all__ = ["how_it_ended"]


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def how_it_ended(code: int) -> str:
    """``"was killed by signal 9 (SIGKILL)"``, ``"stopped on SIGTERM (exit code 143)"``,
    ``"exited with code 1"``: what follows "the engine process"."""
    if code < 0:
        return f"was killed by signal {-code} ({_name(-code)})"
    if code - 128 in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        return f"stopped on {_name(code - 128)} (exit code {code})"
    return f"exited with code {code}"
