"""Failover: what the router does when a replica dies or stops answering.

Requests it had that sent nothing to the client yet are sent again elsewhere; the rest
fail with ``engine_unavailable``. Each of its sessions is rebuilt on another replica from
its log (**re-homing**, replay.py): the session's open, then each step of its history,
one after another as the router's own requests (a `Rehome`); messages for the session
wait meanwhile (`SessionRecord.waiting`) and are dispatched once it is home, and its next
turn reports the recomputed tokens. A session whose pin is not on the new home waits for
the pin's placement first; one that cannot be rebuilt is lost, and what waited for it
fails.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
from radixlm.runtime import protocol as wire
from radixlm.runtime.frontend.frames import FrameError, decode_frame
from radixlm.runtime.router.fanout import FanOut
from radixlm.runtime.router.host import Host
from radixlm.runtime.router.pins import PinPlacement
from radixlm.runtime.router.records import Client, Pending, SessionRecord
from radixlm.runtime.router.replay import replay_steps
from radixlm.runtime.router.replicas import NoCredential
from radixlm.runtime.router.sessions import SessionTable, with_session

__all__ = ["Failover", "Rehome"]

log = logging.getLogger("radixlm.router")

_UNAVAILABLE = wire.ErrorCode.ENGINE_UNAVAILABLE


@dataclass(eq=False)
class Rehome:
    """A session being rebuilt on `target` from its log."""

    record: SessionRecord
    target: int
    steps: list[wire.ClientMessage]
    rid: str = ""
    inner: str = ""
    recomputed: int = 0


class Failover:
    def __init__(self, host: Host, sessions: SessionTable, pins: PinPlacement,
                 fanout: FanOut) -> None:
        self.host = host
        self.sessions = sessions
        self.pins = pins
        self.fanout = fanout

    def replica_down(self, replica: int) -> None:
        """`replica` went down (its links are closed): its requests are retried or fail,
        its pins and fan-out parts are cut off, its sessions are re-homed."""
        retry: list[tuple[Client, str, Pending]] = []
        for client in self.host.clients.values():
            for rid, p in list(client.pending.items()):
                if p.replica == replica:
                    del client.pending[rid]
                    retry.append((client, rid, p))
        self.pins.replica_gone(replica)
        again = [s for s in self.sessions.records.values()
                 if s.home == replica and not s.rehoming]
        self.fanout.replica_gone(replica)
        jobs = self.host.jobs
        for rid, job in list(jobs.items()):
            if isinstance(job, Rehome) and job.target == replica:
                del jobs[rid]
                again.append(job.record)  # started again below, elsewhere
        for record in again:
            self.start_rehome(record)
        for client, rid, p in retry:
            self._retry(client, rid, p)

    def _retry(self, client: Client, rid: str, p: Pending) -> None:
        """A request its replica died on: sent again if the client saw nothing of it."""
        if p.kind == "open":
            self.sessions.homed[p.replica] -= 1
        record = self.sessions.records.get(p.session) if p.session else None
        if p.streamed or p.dones or p.kind == "abort":
            self.host.error(client, rid, _UNAVAILABLE, "the replica serving this request "
                            "stopped (the session, if any, is kept: it is being rebuilt "
                            "elsewhere)")
        elif record is not None and record.rehoming:
            record.waiting.append(p.frame)
        else:
            self.host.dispatch(client, p.frame)

    # -- re-homing ------------------------------------------------------------------------

    def start_rehome(self, record: SessionRecord) -> None:
        live = self.host.live()
        client = self.host.clients.get(record.owner)
        if not live or client is None:
            self.lose(record, "no replica is up to rebuild it on")
            return
        self.sessions.by_inner.pop((record.home, record.inner), None)
        target, _ = self.host.routing.place(record.key, live, None, 0)
        opening, steps = replay_steps(record.log)
        record.rehoming = True
        job = Rehome(record, target, steps)
        log.info("re-homing session %s (%d tokens) on replica %d", record.vid[:8],
                 record.length, target)
        try:
            self._open(client, job, opening)
        except NoCredential as e:
            self.lose(record, str(e))

    def _open(self, client: Client, job: Rehome, opening: wire.OpenSession) -> None:
        target, record = job.target, job.record
        first = msgspec.structs.replace(opening, rid="")
        pin = self.pins.get(record.tenant, opening.pinned) if opening.pinned else None
        if pin is None or target in pin.holders:
            self._send(client, job, first)
            return
        if target not in pin.placing:
            self.pins.place(client, pin, target)

        def go(held: bool, error: wire.Error | None) -> None:
            if record.vid not in self.sessions.records:
                return
            if held:
                self._send(client, job, first)
            elif error is None:
                self.start_rehome(record)  # its target died: another one
            else:
                self.lose(record, f"placing its pin failed: {error.message}")

        self.pins.when_held(pin, target, go)

    def _send(self, client: Client, job: Rehome, msg: wire.ClientMessage) -> None:
        job.rid = self.host.internal_rid()
        self.host.jobs[job.rid] = job
        if not isinstance(msg, wire.OpenSession):
            msg = with_session(msg, job.inner)
        self.host.send(client, job.target, msgspec.structs.replace(msg, rid=job.rid))

    def reply(self, job: Rehome, msg: wire.ServerMessage) -> None:
        """A replica answered a step of a re-homing: the next step, or the session is
        home (and what waited for it is dispatched)."""
        if isinstance(msg, wire.Chunk):
            return
        del self.host.jobs[job.rid]
        record = job.record
        client = self.host.clients.get(record.owner)
        if client is None:
            return
        if isinstance(msg, wire.Error):
            self.lose(record, f"rebuilding it failed: {msg.code}: {msg.message}")
            return
        if isinstance(msg, wire.SessionOpened):
            job.inner = msg.session
            job.recomputed += msg.length - msg.cached_tokens
        elif isinstance(msg, wire.Done):
            job.recomputed += msg.usage.prompt_tokens - msg.usage.cached_tokens
        if job.steps:
            self._send(client, job, job.steps.pop(0))
            return
        self.sessions.moved(record, job.target, job.inner, job.recomputed)
        log.info("session %s re-homed on replica %d: %d tokens recomputed", record.vid[:8],
                 job.target, job.recomputed)
        while record.waiting and not record.rehoming and record.vid in self.sessions.records:
            self.host.dispatch(client, record.waiting.popleft())

    def lose(self, record: SessionRecord, why: str) -> None:
        log.error("session %s lost: %s", record.vid[:8], why)
        client = self.host.clients.get(record.owner)
        self.sessions.forget(record.vid)
        while record.waiting and client is not None:
            msg = decode_frame(record.waiting.popleft())
            if not isinstance(msg, FrameError):
                self.host.error(client, msg.rid, _UNAVAILABLE, f"session {record.vid!r} {why}")

    def client_gone(self, ident: bytes) -> None:
        """A client left: the re-homing of its sessions stops."""
        jobs = self.host.jobs
        for rid, job in list(jobs.items()):
            if isinstance(job, Rehome) and job.record.owner == ident:
                del jobs[rid]

