"""`LoopEntry`: the way into the event loop a client was opened on, from other threads.

A program's threads hand results to the client's loop with `post`: on asyncio one
``call_soon_threadsafe`` (one wake-up of the loop, not a round trip), on trio anyio's
``from_thread.run_sync`` with the loop's token. Apart from client.py because it is about
the loop, not the connection: it knows nothing of requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
from anyio.from_thread import run_sync as run_sync_from_thread
from anyio.lowlevel import EventLoopToken, current_token
from radixlm.sdk.errors import EngineDeadError, ProgramError

__all__ = ["LoopEntry"]


class LoopEntry:
    """The loop `bind` was called in (none before: `post` refuses)."""

    def __init__(self, not_bound: str) -> None:
        self._not_bound = not_bound  # what `post` says before `bind`
        self._aloop: asyncio.AbstractEventLoop | None = None  # the loop, if asyncio
        self._token: EventLoopToken | None = None

    def bind(self) -> None:
        """Remember the running loop (call it from that loop)."""
        self._token = current_token()
        try:
            self._aloop = asyncio.get_running_loop()
        except RuntimeError:  # trio
            self._aloop = None

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in the loop soon, from another thread; on asyncio without
        waiting for it. `EngineDeadError` once the loop is closed."""
        if self._aloop is not None:
            try:
                self._aloop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed
                raise EngineDeadError("the client is closed") from None
            return
        if self._token is None:
            raise ProgramError(self._not_bound)
        try:
            run_sync_from_thread(fn, *args, token=self._token)
        except anyio.RunFinishedError:
            raise EngineDeadError("the client is closed") from None
