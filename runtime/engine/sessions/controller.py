"""The scheduler's one door to sessions: turns, tails, pins, session commands, retention.

The scheduler knows requests, the cache and the model; everything about sessions goes
through the hooks of `SessionController`, called at fixed points of a request's life:

- intake: `begin_generate` (a Generate naming a session: its full prompt is history +
  the rendering of the input picked for that history), `begin_open` (OpenSession),
  `begin_pin` (Pin), `command` (fork, truncate, close, unpin, list: commands.py), and
  `defer`/`take_ready` (messages held while a turn runs its tail: `HeldMessages`);
- admission: `restore` (copy back history the host tier kept) and `on_admit` (usage);
- the last sampled token: `needs_tail` / `report_early`;
- endings: `on_finish` (the branch's tokens are in the tree: settle its turn or pin),
  `on_abort`, `on_ended` (the tail is done), `on_group_done` (every branch ended);
- the pool: `make_room` (demote idle soft sessions), `tick` (idle TTL, prefetches of
  tool-paused histories as their results near), `poll` (every pass of the loop: the
  prefetches clients asked for), `unreclaimable_tokens` (what pins and hard sessions
  hold), `client_gone`.

A turn that carried tools and ends in calls of them leaves its session waiting on them
(`on_finish`, read by calls.py: tool_waits.py says what follows from that).

A session's view (its length, last token, and whether its last turn is an open
assistant turn) is the engine's alone: an append arrives rendered for each way a history
may end (`AppendVariants`) and `begin_generate` picks the rendering for this history.
Replies report the resulting length (`Done.session_length`, `SessionOpened.length`,
`SessionsForked.length`).

A session request's own state lives in its group's `Turn`, which only this module reads
and writes. Without a SessionManager every session or pin request gets a clear error.

Turn protocol with the manager (docs/architecture.md): `begin_turn` at intake;
`Tiers.restore` after the match is locked; `recomputed_tokens` at first admission. At
finish, after the insert: `end_turn(session, prompt + output)` (n == 1) or, per branch of
an n > 1 turn, `branch(session, prompt + output_i)` and, once every branch is done,
`end_turn(session, prompt)` (the history grows by the input only). On abort or error:
`abort_turn`.

Tails (`HeldMessages`): an n == 1 session turn reports its Done as soon as it samples its
last token; that token's KV is computed by one more decode row (the *tail*) before the
turn ends, so the next turn hits the whole history. A client that answers the Done at
once must not see `busy` for that one step (nor an old length): messages naming the
session (its next Generate, a fork, a truncate, a close, and an abort of a held
Generate) and the client's session listings wait and are replayed in arrival order once
the tail is done (dropped if the turn did not finish: its client is gone).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from radixlm.runtime.engine.request import Request, RequestGroup, RequestKind
from radixlm.runtime.engine.sessions.calls import CallNames
from radixlm.runtime.engine.sessions.commands import answer, is_session_command
from radixlm.runtime.engine.sessions.disk_backup import DiskLoad
from radixlm.runtime.engine.sessions.manager import SessionManager
from radixlm.runtime.engine.wire import (
    EngineAbort,
    EngineCommand,
    EngineGenerate,
    EngineOpenSession,
    EnginePin,
)
from radixlm.runtime.protocol import (
    CloseSession,
    Error,
    ErrorCode,
    GetStats,
    ListSessions,
    Pinned,
    SessionOpened,
    Struct,
)
from radixlm.runtime.rules import RequestError

log = logging.getLogger(__name__)

Reply = Callable[[bytes, Struct], None]


@dataclass(frozen=True)
class Committed:
    """A reply held until its state-directory write is committed: the writer thread
    posts it into the loop's queue (`SessionController.post`), and the scheduler answers
    with `make_reply(saved)` on its own thread (saved: the write succeeded)."""

    client: bytes
    write: Future[None]
    make_reply: Callable[[bool], Struct]


@dataclass(eq=False)
class Turn:
    """A request's session side: the session it appends to (or opens), or the pin it
    makes, and what is still owed to the manager."""

    session: str | None = None
    pin_name: str | None = None
    open: bool = False  # begin_turn done, end_turn/abort_turn still owed
    assistant_open: bool | None = None  # the frontend's flag for the appended input
    ended_in: dict[int, str] = field(default_factory=dict)  # branch -> session it ended in
    # History read back from the disk tier: the request waits for it (held back, holding
    # no KV) and its admission copies it in after the device match.
    kv_load: DiskLoad | None = None


@dataclass(frozen=True)
class Intake:
    """What a session request adds to its group: the full prompt, the input it appends
    (the rendering picked for this history), the namespace it is matched in, and its
    turn."""

    prompt: np.ndarray
    appended: np.ndarray
    namespace: str | None
    turn: Turn
    program: str | None = None  # the session's program


def client_program(client: bytes, program: str | None) -> str | None:
    """A program a client names, in its own scope (no client can join another's)."""
    return None if program is None else f"{client.hex()}:{program}"


def sessions_of(msg: object) -> list[str]:
    """The sessions a message acts on (a close may name several)."""
    if isinstance(msg, EngineGenerate):
        return [msg.session] if msg.session is not None else []
    if isinstance(msg, EngineCommand):
        if isinstance(msg.msg, CloseSession):
            return msg.msg.ids()
        session = getattr(msg.msg, "session", None)  # ForkSession/TruncateSession
        return [session] if session is not None else []
    return []


class HeldMessages:
    """Per session in its tail, the messages that wait for it."""

    def __init__(self) -> None:
        self._held: dict[str, list[object]] = {}  # session in its tail -> messages held
        self._held_by: dict[str, bytes] = {}  # session in its tail -> its client
        self._ready: list[object] = []

    def hold(self, session: str, client: bytes) -> None:
        """`session`'s turn has reported and runs its tail: its messages wait."""
        self._held.setdefault(session, [])
        self._held_by[session] = client

    def defer(self, msg: object) -> bool:
        """Keep `msg` if it acts on a session whose turn runs its tail; False: handle it
        now."""
        if not self._held:
            return False
        if isinstance(msg, EngineAbort):
            for msgs in self._held.values():
                if any(isinstance(m, EngineGenerate) and m.key == msg.key for m in msgs):
                    msgs.append(msg)
                    return True
            return False
        if isinstance(msg, EngineCommand) and isinstance(msg.msg, (ListSessions, GetStats)):
            # A listing (or stats) shows every turn its client was told is done and every
            # command it sent before: it waits for that client's tails and held messages
            # (replayed, it is checked again).
            for session, client in self._held_by.items():
                if client == msg.client:
                    self._held[session].append(msg)
                    return True
            return False
        for session in sessions_of(msg):  # replayed, it is checked again for the others
            held = self._held.get(session)
            if held is not None:
                held.append(msg)
                return True
        return False

    def forget(self, client: bytes) -> None:
        """`client` is gone: what it sent that waits for a tail is dropped (the tails
        themselves still finish)."""
        for session, owner in self._held_by.items():
            if owner == client:
                self._held[session] = []

    def release(self, session: str, finished: bool) -> None:
        """The tail is done: the held messages become ready (dropped if the turn did not
        finish)."""
        msgs = self._held.pop(session, None)
        self._held_by.pop(session, None)
        if msgs and finished:
            self._ready.extend(msgs)

    def take_ready(self) -> list[object]:
        """Messages released by finished tails, in arrival order (asked after every step
        and message: no copy when there are none)."""
        ready = self._ready
        if ready:
            self._ready = []
        return ready


class SessionController:
    """The hooks the scheduler calls (see the module doc), over one SessionManager."""

    def __init__(self, manager: SessionManager | None, reply: Reply,
                 calls: CallNames | None = None) -> None:
        self.manager = manager
        self._reply = reply
        self.calls = calls or CallNames(None)  # reads the tools a turn called
        # How a committed write reaches the loop (the serving loop's queue); None: wait
        # for the commit where the reply is made (no loop: tests, tools).
        self.post: Callable[[object], None] | None = None
        self.held = HeldMessages()
        self.defer = self.held.defer  # (called for every inbound message)
        self.take_ready = self.held.take_ready  # (called after every step and message)

    # ------------------------------------------------------------------ helpers
    def _m(self) -> SessionManager:
        if self.manager is None:
            raise RequestError(ErrorCode.INVALID_PARAMS, "this engine has no session support")
        return self.manager

    @staticmethod
    def session_of(g: RequestGroup) -> str | None:
        return g.turn.session if g.turn is not None else None

    def reply_when_saved(self, client: bytes, write: Future[None] | None,
                         make_reply: Callable[[bool], Struct]) -> None:
        """Answer once `write` is committed (at once without one): a durable reply is
        sent only after what it acknowledges is on disk."""
        if write is None:
            self._reply(client, make_reply(False))
            return
        done = Committed(client, write, make_reply)
        post = self.post
        if post is None:
            with contextlib.suppress(Exception):
                write.result()
            self.answer_committed(done)
        else:
            write.add_done_callback(lambda _: post(done))

    def answer_committed(self, done: Committed) -> None:
        """(On the loop's thread.) The reply of a write that has settled."""
        self._reply(done.client, done.make_reply(done.write.exception() is None))

    # ------------------------------------------------------------------- intake
    def begin_generate(self, msg: EngineGenerate, appended: np.ndarray) -> Intake:
        """Begin the turn of a Generate naming a session (the caller undoes it with
        `abort_intake` if it then refuses the request)."""
        assert msg.session is not None
        m = self._m()
        s = m.get(msg.session, msg.client)
        if msg.variants is not None:
            last = int(s.history[-1]) if s.length else None
            try:
                ids = msg.variants.pick(msg.input_ids, s.length, last, s.assistant_open)
            except ValueError as e:  # the template cannot render the input for this history
                raise RequestError(ErrorCode.INVALID_PARAMS, str(e)) from None
            appended = np.asarray(ids, dtype=np.int64)
        prompt = m.begin_turn(msg.session, msg.client, appended, msg.namespace)
        turn = Turn(session=msg.session, open=True, assistant_open=msg.assistant_open,
                    kv_load=m.tiers.plan_load(msg.session))
        return Intake(np.asarray(prompt, dtype=np.int64), appended, s.namespace, turn,
                      s.program)

    def abort_intake(self, intake: Intake, client: bytes, opened: bool = False) -> None:
        """The request was refused after its turn began: idle again (an opening turn's
        session is closed)."""
        session = intake.turn.session
        if self.manager is None or session is None:
            return
        self.manager.abort_turn(session)
        if opened:
            self.manager.close(session, client)

    def begin_open(self, msg: EngineOpenSession) -> Intake | None:
        """Open the session; with input, begin its first turn and return its prompt (the
        caller prefills it), without, answer SessionOpened now and return None."""
        m = self._m()
        s = m.open(msg.client, msg.namespace, msg.retention, msg.ttl_s, msg.pinned, msg.input_ids,
                   durable=msg.durable, tenant=msg.tenant,
                   program=client_program(msg.client, msg.program))
        if not msg.input_ids:
            self._reply_opened(msg.client, msg.rid, s.id, s.length, s.held_len)
            return None
        try:
            prompt = m.begin_turn(s.id, msg.client, msg.input_ids)
        except RequestError:
            m.close(s.id, msg.client)
            raise
        turn = Turn(session=s.id, open=True, assistant_open=msg.assistant_open,
                    kv_load=m.tiers.plan_prefix_load(np.asarray(prompt, dtype=np.int64),
                                                     s.namespace))
        return Intake(np.asarray(prompt, dtype=np.int64),
                      np.asarray(msg.input_ids, dtype=np.int64), s.namespace, turn, s.program)

    def begin_pin(self, msg: EnginePin, prompt: np.ndarray) -> Turn:
        """Refuse a pin before it is prefilled: name taken, or beyond the retention cap."""
        m = self._m()
        m.pinned.check(msg.name, prompt, msg.namespace)
        return Turn(pin_name=msg.name, kv_load=m.tiers.plan_prefix_load(prompt, msg.namespace))

    def unreclaimable_tokens(self) -> int:
        """Tokens pins and hard sessions hold (soft ones can be demoted on demand)."""
        m = self.manager
        if m is None or not (m.num_sessions or m.num_pins):
            return 0
        by_class = m.retained_tokens()
        return by_class.get("pinned", 0) + by_class.get("hard", 0)

    # ----------------------------------------------------------------- commands
    def command(self, cmd: EngineCommand) -> Struct | None:
        """The reply to a session command (fork, truncate, close, unpin, list; refusals
        become Errors); None: not one."""
        msg = cmd.msg
        if not is_session_command(msg):
            return None
        try:
            reply = answer(self._m(), msg, cmd.client, cmd.tenant)
        except RequestError as e:
            return Error(rid=msg.rid, code=e.code, message=e.message)
        return reply

    # -------------------------------------------------------------------- tails
    def needs_tail(self, g: RequestGroup) -> bool:
        """Whether a branch that sampled its last token ends one step later, once that
        token's KV is computed (a session turn: the next turn must hit it)."""
        return g.turn is not None and g.turn.session is not None

    def report_early(self, r: Request) -> bool:
        """Whether `r` (an n == 1 session turn waiting for its tail) reports its Done now;
        if so its session's messages are held until `on_ended`. n > 1 branches report at
        the end: their new sessions are made then."""
        g = r.group
        session = self.session_of(g)
        if g.n != 1 or g.kind is not RequestKind.GENERATE or session is None:
            return False
        turn = g.turn
        assert turn is not None and self.manager is not None
        turn.ended_in[r.index] = session
        self.held.hold(session, g.client)
        return True

    # ---------------------------------------------------------------- admission
    def restore(self, r: Request, cached_len: int) -> np.ndarray | None:
        """Device slots holding the K/V of the session history (or pin prefix) after
        `cached_len`, copied back from the host and disk tiers (None: nothing to
        restore)."""
        turn, m = r.group.turn, self.manager
        if m is None or turn is None:
            return None
        load, turn.kv_load = turn.kv_load, None  # (once: a retracted request recomputes)
        if turn.session is None:
            return m.tiers.restore_prefix(cached_len, load)
        return m.tiers.restore(turn.session, cached_len, load)

    @staticmethod
    def loading(g: RequestGroup) -> bool:
        """Whether `g` waits for KV from the disk tier."""
        return g.turn is not None and g.turn.kv_load is not None and not g.turn.kv_load.done()

    def on_admit(self, r: Request, matched: int, restored: int) -> None:
        """First admission of branch 0: usage figures of the reused history."""
        g = r.group
        g.restored_tokens = restored
        session = self.session_of(g)
        if self.manager is not None and session is not None:
            g.recomputed_tokens = self.manager.recomputed_tokens(session, matched + restored)

    def make_room(self, n_tokens: int) -> int:
        """Demote idle soft sessions until `n_tokens` more are evictable; returns what
        was made evictable."""
        return self.manager.make_room(n_tokens) if self.manager is not None else 0

    def tick(self, now: float) -> None:
        if self.manager is not None:
            self.manager.tick(now)

    def poll(self, now: float) -> None:
        """(Every pass of the serving loop.) Prefetches clients asked for."""
        if self.manager is not None:
            self.manager.prefetch.poll(now)

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """The StatsReply fields about retention, sessions, pins and tool waits (those of
        `tenant` only, for a tenant)."""
        m = self.manager
        retained = m.retained_tokens() if m is not None else {}
        return {
            **(m.waits.stats(tenant) if m is not None else {}),
            "retained_tokens": {k: retained.get(k, 0) for k in ("pinned", "hard", "soft")},
            "retained_cap": m.retained_cap if m is not None else 0,
            "host_capacity": m.host_capacity if m is not None else 0,
            "host_used": m.host_used if m is not None else 0,
            "sessions": m.num_sessions if m is not None else 0,
            "pins": m.num_pins if m is not None else 0,
        }

    def client_gone(self, client: bytes) -> None:
        if self.manager is not None:
            self.manager.client_gone(client)

    def forget_held(self, client: bytes) -> None:
        """Drop what a gone client's messages wait for (before its tails end)."""
        self.held.forget(client)

    def clients(self) -> set[bytes]:
        """Every client that holds a session."""
        m = self.manager
        return set() if m is None else {s.client for s in m.sessions()}

    def seed_offset(self, g: RequestGroup) -> int:
        """What `g`'s seed is offset by (`protocol.branch_seed`): forked sessions each
        draw their own stream (see `SessionManager.seed_offset`)."""
        session = self.session_of(g)
        if self.manager is None or session is None:
            return 0
        return self.manager.seed_offset(session)

    # ------------------------------------------------------------------ endings
    def on_finish(self, r: Request) -> None:
        """A branch finished and its tokens are in the tree: settle its turn or pin."""
        g, turn, m = r.group, r.group.turn, self.manager
        if turn is None or m is None:
            return
        if turn.pin_name is not None:
            self._finish_pin(g, turn.pin_name)
            return
        session = turn.session
        assert session is not None
        history = r.tokens[: r.num_tokens]
        try:
            if g.n == 1:
                turn.open = False
                m.end_turn(session, history, turn.assistant_open)
                turn.ended_in[r.index] = session
                if g.tools and g.kind is RequestKind.GENERATE:
                    m.waits.wait_on_tools(session, self.calls.names(r.output, g.tools))
            else:
                turn.ended_in[r.index] = m.branch(session, history, r.index, turn.assistant_open)
        except Exception as e:  # noqa: BLE001 - the output stands; the session keeps its history
            log.exception("session %s: could not record the turn", session[:8])
            if g.n == 1:
                m.abort_turn(session)
            if g.kind is RequestKind.OPEN_SESSION:
                self._reply(
                    g.client,
                    Error(rid=g.rid, code=getattr(e, "code", ErrorCode.INTERNAL), message=str(e)),
                )
            return
        if g.kind is RequestKind.OPEN_SESSION:
            self._reply_opened(g.client, g.rid, session, g.prompt_len, max(r.cached_tokens, 0))

    def _reply_opened(self, client: bytes, rid: str, session: str, length: int,
                      cached: int) -> None:
        """SessionOpened; for a durable session, once its row is committed (if that
        fails, the session stays, not durable, and the reply says so)."""
        m = self.manager
        assert m is not None
        s = m.records.sessions.get(session)
        write = m.durability.persist(s) if s is not None and s.durable else None

        def make(saved: bool) -> Struct:
            if not saved and s is not None:
                s.durable = False
            return SessionOpened(rid=rid, session=session, length=length, cached_tokens=cached,
                                 durable=saved)

        self.reply_when_saved(client, write, make)

    def _finish_pin(self, g: RequestGroup, name: str) -> None:
        assert self.manager is not None
        try:
            pin = self.manager.pinned.pin(name, g.prompt, g.namespace)
        except RequestError as e:
            self._reply(g.client, Error(rid=g.rid, code=e.code, message=e.message))
            return
        self.reply_when_saved(g.client, self.manager.durability.persist_pin(pin),
                              lambda saved: Pinned(rid=g.rid, name=name, length=g.prompt_len))

    def on_abort(self, r: Request) -> None:
        """A branch was aborted or failed: its turn leaves the history unchanged."""
        g, turn, m = r.group, r.group.turn, self.manager
        if m is None or turn is None or turn.session is None or g.n > 1:
            return
        if turn.open:
            turn.open = False
            m.abort_turn(turn.session)
        if g.kind is RequestKind.OPEN_SESSION:
            with contextlib.suppress(Exception):  # already closed by client_gone
                m.close(turn.session, g.client)

    def on_ended(self, r: Request, finished: bool) -> None:
        """A branch that reported early has ended: its session's held messages are
        replayed (dropped if it did not finish: its client is gone)."""
        session = self.session_of(r.group)
        if session is not None:
            self.held.release(session, finished)

    def on_group_done(self, g: RequestGroup) -> None:
        """Every branch ended. An n > 1 session turn appends the input to the history once
        its prompt was prefilled (the branches went on in their own sessions)."""
        turn, m = g.turn, self.manager
        if m is None or turn is None or turn.session is None or not turn.open:
            return
        turn.open = False
        try:
            if g.prefilled:
                m.end_turn(turn.session, g.prompt, turn.assistant_open)
            else:
                m.abort_turn(turn.session)
        except Exception:  # noqa: BLE001
            log.exception("session %s: could not close the n > 1 turn", turn.session[:8])
            m.abort_turn(turn.session)
