"""Keeping a server's processes up: a child that dies is started again.

`radixlm serve` runs `supervise(server)` until it is stopped. When a child exits:

- the **frontend**: a new one is started on the same listening socket (the launcher kept
  its copy), says hello to the engine, which forgets the old frontend's clients (their
  requests aborted, their sessions closed, durable ones detached) and answers with its
  `EngineReady`; clients reconnect (ZeroMQ redials by itself; the SDK says hello again)
  and resume their durable sessions;
- the **engine**: a new one is started with the same spec; it reads the durable sessions
  and pins back from the state directory; the frontend, seeing another engine's
  `EngineReady`, fails what the old one was running with a message that says so;
- the **HTTP** process: a new one on the same HTTP socket (`respawn` given by serve).

A role that dies `MAX_RESTARTS` times within `WINDOW_S` is not started again: the server
stops, naming the role and how it ended (a crash loop is a bug or a broken setup,
and restarting it for ever would hide that).
"""

from __future__ import annotations

import functools
import logging
import subprocess
import time
from collections import deque
from collections.abc import Callable

from radixlm.runtime.server.exits import how_it_ended
from radixlm.runtime.server.launcher import RunningServer

log = logging.getLogger("radixlm.serve")

MAX_RESTARTS = 3
WINDOW_S = 60.0

Respawn = Callable[[], subprocess.Popen[bytes]]


def supervise(server: RunningServer, respawn: dict[str, Respawn] | None = None,
              clock: Callable[[], float] = time.monotonic) -> tuple[str, int]:
    """Restart whatever child dies, until one dies too often: returns that (role, exit
    code). `respawn`: how to start roles the launcher did not (the HTTP process)."""
    deaths: dict[str, deque[float]] = {}
    while True:
        role, code = server.wait()
        now = clock()
        recent = deaths.setdefault(role, deque())
        recent.append(now)
        while recent and now - recent[0] > WINDOW_S:
            recent.popleft()
        start = (respawn or {}).get(role)
        if start is None and server.spawn is not None and role in ("engine", "frontend"):
            start = functools.partial(server.spawn, role)
        if start is None or len(recent) > MAX_RESTARTS:
            if start is not None:
                log.error("the %s process %s, %d times in %.0f s: not restarting it",
                          role, how_it_ended(code), len(recent), WINDOW_S)
            return role, code
        log.warning("the %s process %s; starting it again", role, how_it_ended(code))
        server.processes[role] = start()
