"""Fan-outs: one client request sent to several replicas, their replies merged into one.

Stats, session listings, cache flushes and unpins go to every live replica (or every
holder); closing sessions homed on several replicas sends each its part. Each part is one
of the router's own requests (its own rid); the merged reply (merge.py) goes to the
client once every part has answered. A fan-out waits `replica_timeout_s` at most: a
replica that has not answered by then is left out of a stats or listing reply (an
``engine_unavailable`` error for the others), so a fan-out never hangs on a replica that
went quiet, died unnoticed or is coming back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from radixlm.runtime import protocol as wire
from radixlm.runtime.router.host import Host
from radixlm.runtime.router.merge import merge_replies
from radixlm.runtime.router.records import Client

__all__ = ["FanOut", "Gather"]

log = logging.getLogger("radixlm.router")

View = Callable[[int, wire.SessionInfo], "wire.SessionInfo | None"]


@dataclass(eq=False)
class Gather:
    """A fanned-out request: one reply per replica, merged for the client."""

    client: Client
    rid: str
    waiting: dict[int, str]  # replica -> internal rid still unanswered
    replies: list[tuple[int, wire.ServerMessage]] = field(default_factory=list)
    on_done: Callable[[wire.ServerMessage], None] | None = None
    started: float = 0.0  # monotonic: a replica silent past the timeout is left out
    reads: bool = True  # stats, listings: a silent replica's part is left out (else: an error)


class FanOut:
    """The fan-outs under way, oldest first. `view` puts a listed session in the client's
    terms (`SessionTable.view`)."""

    def __init__(self, host: Host, view: View) -> None:
        self.host = host
        self.view = view
        self.gathers: dict[Gather, None] = {}

    def start(self, client: Client, rid: str, parts: dict[int, wire.ClientMessage], *,
              reads: bool, on_done: Callable[[wire.ServerMessage], None] | None = None) -> None:
        """Send each replica its part (`parts`: replica -> message, its rid replaced); the
        client gets the merged reply under `rid`, and `on_done` sees it first."""
        gather = Gather(client, rid, {}, on_done=on_done, started=time.monotonic(), reads=reads)
        self.gathers[gather] = None
        for replica, msg in parts.items():
            inner = self.host.internal_rid()
            gather.waiting[replica] = inner
            self.host.jobs[inner] = gather
            self.host.send(client, replica, msgspec.structs.replace(msg, rid=inner))

    def reply(self, job: Gather, replica: int, rid: str, msg: wire.ServerMessage) -> None:
        del self.host.jobs[rid]
        job.waiting.pop(replica, None)
        job.replies.append((replica, msg))
        self._check(job)

    def expire(self, now: float) -> None:
        """Replicas that have not answered a fan-out in `replica_timeout_s` are left out
        of it: a stats call never hangs on a replica that went quiet, restarted or is
        rejoining (one silent that long is taken out anyway, by its control probes)."""
        timeout = self.host.config.replica_timeout_s
        for job in list(self.gathers):  # oldest first
            if now - job.started <= timeout:
                break
            self._expired(job, now)

    def _expired(self, job: Gather, now: float) -> None:
        for replica, rid in job.waiting.items():
            self.host.jobs.pop(rid, None)
            quiet = now - job.started
            log.warning("replica %d did not answer a fan-out in %.1f s: left out of it",
                        replica, quiet)
            if not job.reads:
                job.replies.append((replica, wire.Error(
                    rid=job.rid, code=wire.ErrorCode.ENGINE_UNAVAILABLE,
                    message=f"replica {replica} did not answer in {quiet:.1f} s")))
        job.waiting.clear()
        self._check(job)

    def _check(self, job: Gather) -> None:
        if job.waiting:
            return
        self.gathers.pop(job, None)
        merged = merge_replies(job.rid, [m for _, m in job.replies], self.view,
                               [i for i, _ in job.replies])
        if job.on_done is not None:
            job.on_done(merged)
        if job.client.ident in self.host.clients:
            self.host.reply(job.client, merged)

    def replica_gone(self, replica: int) -> None:
        """`replica` is down: the fan-outs waiting for it go on without it."""
        jobs = self.host.jobs
        for rid, job in list(jobs.items()):
            if isinstance(job, Gather) and job.waiting.get(replica) == rid:  # its own rid only
                del jobs[rid]
                del job.waiting[replica]
                self._check(job)

    def client_gone(self, client: Client) -> None:
        """A client left: its fan-outs are dropped."""
        jobs = self.host.jobs
        for rid, job in list(jobs.items()):
            if isinstance(job, Gather) and job.client is client:
                del jobs[rid]
                self.gathers.pop(job, None)
