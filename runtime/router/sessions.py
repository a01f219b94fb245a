"""The router's session table: each session the client knows (by the id it uses, the
`vid`), where it lives (its home replica, its id there), how many sessions each replica
holds, and each record kept up to date from the replies that change a session (a turn's
``done``, an open, a fork, a truncate).

A replica makes session ids at random, so two replicas may make the same one: the
client then gets another id for the second (`adopt`), and listings and replies are put
back in the client's terms (`view`).
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
from radixlm.runtime import protocol as wire
from radixlm.runtime.router.records import (
    Appended,
    Client,
    Cut,
    Opened,
    Pending,
    Produced,
    SessionRecord,
)
from radixlm.runtime.router.routing import Routing

__all__ = ["SessionTable", "session_named", "with_session"]


class SessionTable:
    def __init__(self, routing: Routing, replicas: int) -> None:
        self.routing = routing
        self.records: dict[str, SessionRecord] = {}  # by vid
        self.by_inner: dict[tuple[int, str], str] = {}  # (home, inner id) -> vid
        self.homed = [0] * replicas  # sessions each replica holds (opens counted at once)

    def adopt(self, client: Client, replica: int, inner: str, log: list[Any], length: int,
              key: str, counted: bool = False) -> SessionRecord:
        """A session a replica made (opened, forked, branched): the client sees `inner`,
        unless that id is already another session's here (ids are random per replica)."""
        vid = inner
        while vid in self.records:
            vid = secrets.token_hex(16)
        record = SessionRecord(vid, client.ident, client.tenant, replica, inner, length, key,
                               log)
        self.records[vid] = record
        if not counted:  # (an open was counted when it was routed)
            self.homed[replica] += 1
        self.by_inner[(replica, inner)] = vid
        return record

    def forget(self, vid: str) -> None:
        record = self.records.pop(vid, None)
        if record is not None:
            self.by_inner.pop((record.home, record.inner), None)
            self.homed[record.home] -= 1

    def forget_owner(self, ident: bytes) -> None:
        """A client left: its sessions went with its links."""
        for vid in [v for v, s in self.records.items() if s.owner == ident]:
            self.forget(vid)

    def moved(self, record: SessionRecord, target: int, inner: str, recomputed: int) -> None:
        """`record` was rebuilt on `target` as `inner` (failover.py)."""
        self.homed[record.home] -= 1
        self.homed[target] += 1
        record.home, record.inner = target, inner
        record.recomputed += recomputed
        record.rehoming = False
        self.by_inner[(target, inner)] = record.vid
        self.routing.tree.insert(record.key, target)

    def view(self, replica: int, info: wire.SessionInfo) -> wire.SessionInfo | None:
        """A listed session in the client's terms."""
        vid = self.by_inner.get((replica, info.session))
        if vid is None:  # another client's (an 8-hex prefix with `all`) or not ours
            return info
        return info if vid == info.session else msgspec.structs.replace(info, session=vid)

    # -- replies that change a session ---------------------------------------------------------

    def done(self, client: Client, replica: int, p: Pending, done: wire.Done) -> wire.Done:
        """A turn's ``done``: its session's log, length and key grow; a branch of an
        ``n > 1`` turn is a new session. Returned in the client's terms."""
        record = self.records.get(p.session) if p.session else None
        if record is None and p.session is None and isinstance(p.msg, wire.Generate):
            if p.msg.input.messages is not None and p.n == 1:  # the next turn resends it
                self.routing.tree.insert(p.input_key + "\x1eassistant\x1f" + done.text, replica)
            return done
        if record is None or p.msg is None or not isinstance(p.msg, wire.Generate):
            return done
        turn = p.msg
        if done.finish_reason == "abort" and done.session is None:
            return done
        if turn.n == 1:
            if done.session_length is not None:
                record.log += [Appended(turn.input, turn.tools), Produced(list(done.token_ids))]
                record.length = done.session_length
                record.key += p.input_key + done.text
                self.routing.tree.insert(record.key, replica)
            done = _report_recomputed(record, done)
            return msgspec.structs.replace(done, session=record.vid) if done.session else done
        # n > 1: the parent grows by the input; each branch is a new session there.
        if p.dones == 1:
            record.log.append(Appended(turn.input, turn.tools))
            record.key += p.input_key
            if done.session_length is not None:
                record.length = done.session_length - len(done.token_ids)
            done = _report_recomputed(record, done)
        if done.session is None:
            return done
        branch = self.adopt(client, replica, done.session, record.log + [
            Produced(list(done.token_ids))], done.session_length or 0, record.key + done.text)
        return msgspec.structs.replace(done, session=branch.vid)

    def opened(self, client: Client, replica: int, p: Pending, opened: wire.SessionOpened,
               key: str) -> wire.SessionOpened:
        """A new session (`key`: its routing key), in the client's terms."""
        assert isinstance(p.msg, wire.OpenSession)
        record = self.adopt(client, replica, opened.session, [Opened(p.msg)], opened.length,
                            key, counted=True)
        if key:
            self.routing.tree.insert(key, replica)
        return msgspec.structs.replace(opened, session=record.vid)

    def forked(self, client: Client, replica: int, p: Pending,
               forked: wire.SessionsForked) -> wire.SessionsForked:
        parent = self.records.get(p.session or "")
        if parent is None:
            return forked
        vids = [self.adopt(client, replica, inner, list(parent.log), parent.length,
                           parent.key).vid for inner in forked.sessions]
        return msgspec.structs.replace(forked, sessions=vids)

    def truncated(self, p: Pending) -> None:
        record = self.records.get(p.session or "")
        if record is not None:
            record.length = p.length
            record.log.append(Cut(p.length))


def _report_recomputed(record: SessionRecord, done: wire.Done) -> wire.Done:
    """A session's first turn after it was re-homed reports the tokens recomputed."""
    if not record.recomputed:
        return done
    extra, record.recomputed = record.recomputed, 0
    usage = msgspec.structs.replace(
        done.usage, recomputed_tokens=done.usage.recomputed_tokens + extra,
        cached_tokens=max(0, done.usage.cached_tokens - extra))
    return msgspec.structs.replace(done, usage=usage)


def session_named(msg: wire.ClientMessage) -> str | None:
    """The one session `msg` is about (its vid), if any."""
    if isinstance(msg, (wire.Generate, wire.ForkSession, wire.TruncateSession)):
        return msg.session
    if isinstance(msg, wire.CloseSession):
        ids = msg.ids()
        return ids[0] if len(ids) == 1 else None
    return None


def with_session(msg: Any, inner: str) -> Any:
    """`msg` naming its session by `inner`, its id on its home replica."""
    if isinstance(msg, wire.CloseSession):
        return msgspec.structs.replace(msg, session=inner, sessions=None)
    return msgspec.structs.replace(msg, session=inner)
