"""Keeping a server's processes up: a child that dies is started again.

`radixlm serve` runs `supervise(server)` until it is stopped (``serve --replicas``: a
`watch_replicas` thread over each replica). When a child exits:

- the **frontend**: a new one is started on the same listening socket (the launcher kept
  its copy), says hello to the engine, which forgets the old frontend's clients (their
  requests aborted, their sessions closed, durable ones detached) and answers with its
  `EngineReady`; clients reconnect (ZeroMQ redials by itself; the SDK says hello again)
  and resume their durable sessions;
- the **engine**: a new one is started with the same spec; it reads the durable sessions
  and pins back from the state directory; the frontend, seeing another engine's
  `EngineReady`, fails what the old one was running with a message that says so;
- the **HTTP** process: a new one on the same HTTP socket (`respawn` given by serve).

A role that dies more than `MAX_RESTARTS` times within `WINDOW_S` is not started again:
the server stops, naming the role and how it ended (a crash loop is a bug or a broken
setup, and restarting it for ever would hide that); a replica under ``serve --replicas``
stays down instead, and the router serves with the others.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from radixlm.runtime.server.exits import how_it_ended
from radixlm.runtime.server.launcher import RunningServer

log = logging.getLogger("radixlm.serve")

MAX_RESTARTS = 3
WINDOW_S = 60.0
POLL_S = 0.5  # how often `watch_replicas` looks at each replica

Respawn = Callable[[], subprocess.Popen[bytes]]


class Supervisor:
    """One server's restart decisions: who died when, and who is started again."""

    def __init__(self, server: RunningServer, respawn: dict[str, Respawn] | None = None,
                 clock: Callable[[], float] = time.monotonic, name: str = "") -> None:
        self.server = server
        self.respawn = respawn or {}
        self.clock = clock
        self.name = name  # "replica 2 " in its log lines; "" for the one server
        self._deaths: dict[str, deque[float]] = {}

    def on_exit(self, role: str, code: int) -> bool:
        """`role` exited with `code`: start it again (True), or not: it died too often,
        or nothing knows how (False)."""
        now = self.clock()
        recent = self._deaths.setdefault(role, deque())
        recent.append(now)
        while recent and now - recent[0] > WINDOW_S:
            recent.popleft()
        start = self.respawn.get(role)
        if start is None and self.server.spawn is not None and role in ("engine", "frontend"):
            start = functools.partial(self.server.spawn, role)
        if start is None:
            return False
        if len(recent) > MAX_RESTARTS:
            log.error("%sthe %s process %s, %d times in %.0f s: not restarting it", self.name,
                      role, how_it_ended(code), len(recent), WINDOW_S)
            return False
        log.warning("%sthe %s process %s; starting it again", self.name, role, how_it_ended(code))
        self.server.processes[role] = start()
        return True


def supervise(server: RunningServer, respawn: dict[str, Respawn] | None = None,
              clock: Callable[[], float] = time.monotonic) -> tuple[str, int]:
    """Restart whatever child dies, until one dies too often: returns that (role, exit
    code). `respawn`: how to start roles the launcher did not (the HTTP process)."""
    keeper = Supervisor(server, respawn, clock)
    while True:
        role, code = server.wait()
        if not keeper.on_exit(role, code):
            return role, code


def watch_replicas(servers: Sequence[RunningServer]) -> threading.Thread:
    """A daemon thread that reaps and restarts the replicas' processes for as long as
    this process runs (it starts them, so they die with it: PR_SET_PDEATHSIG follows the
    thread that started a child, and this one never ends before the process)."""
    keepers = [Supervisor(s, name=f"replica {i}: ") for i, s in enumerate(servers)]
    down: set[int] = set()

    def watch() -> None:
        while True:
            for i, keeper in enumerate(keepers):
                if i in down:
                    continue
                exited = keeper.server.poll()
                if exited is not None and not keeper.on_exit(*exited):
                    down.add(i)
            time.sleep(POLL_S)

    thread = threading.Thread(target=watch, name="replica-supervisor", daemon=True)
    thread.start()
    return thread
