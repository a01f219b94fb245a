"""The scheduler's side of sessions and pins: every `SessionManager` call it makes, at
the lifecycle points docs/architecture.md names, and the replies they lead to.

- Generate with `session`: `begin_turn` at intake (the full prompt is history +
  appended); `restore_from_host` after the match is locked, before allocation;
  `recomputed_tokens` for usage at first admission. At finish, after the insert:
  `end_turn(session, prompt + output, node)` (n == 1) or, per branch of an n > 1 turn,
  `branch(session, prompt + output_i)` (the branch's new session) and, once every branch
  is done, `end_turn(session, prompt)` (the history grows by the input only). On abort or
  error: `abort_turn`.
- OpenSession: `open` (+ a prefill-only turn ending in `end_turn` when it has input).
- Pin: `check_pin` at intake, prefill, then `pin`.
- `make_room` when the pool is short, `tick` periodically, `client_gone`.

Without a SessionManager every session/pin request gets a clear error.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import numpy as np
from radixlm.cache import TreeNode
from radixlm.runtime.engine.errors import RequestError
from radixlm.runtime.engine.messages import EngineOpenSession
from radixlm.runtime.engine.request import Request, RequestGroup, RequestKind
from radixlm.runtime.protocol import Error, ErrorCode, Pinned, SessionOpened, Struct

log = logging.getLogger(__name__)

Reply = Callable[[bytes, Struct], None]


class TurnGlue:
    def __init__(self, sessions, reply: Reply) -> None:
        self.sessions = sessions  # SessionManager | None
        self._reply = reply

    # ---------------------------------------------------------------- helpers
    def manager(self):
        if self.sessions is None:
            raise RequestError(ErrorCode.INVALID_PARAMS, "this engine has no session support")
        return self.sessions

    def call(self, fn, *args):
        try:
            return fn(*args)
        except RequestError:
            raise
        except Exception as e:  # SessionError and friends carry a protocol code
            if hasattr(e, "code"):
                raise RequestError(e.code, str(e)) from None
            raise

    # ------------------------------------------------------------------ intake
    def begin(
        self, session: str, client: bytes, appended: np.ndarray, namespace: str | None
    ) -> np.ndarray:
        m = self.manager()
        return np.asarray(
            self.call(m.begin_turn, session, client, appended, namespace), dtype=np.int64
        )

    def namespace_of(self, session: str, client: bytes) -> str | None:
        return self.manager().get(session, client).namespace

    def abort(self, session: str) -> None:
        if self.sessions is not None:
            self.sessions.abort_turn(session)

    def open(self, msg: EngineOpenSession) -> tuple[str, np.ndarray | None]:
        """Open the session; with input, begin its first turn and return its prompt (the
        caller prefills it), without, answer SessionOpened now and return None."""
        m = self.manager()
        s = self.call(
            m.open, msg.client, msg.namespace, msg.retention, msg.ttl_s, msg.pinned, msg.input_ids
        )
        if not msg.input_ids:
            self._reply(
                msg.client,
                SessionOpened(rid=msg.rid, session=s.id, length=s.length, cached_tokens=s.held_len),
            )
            return s.id, None
        try:
            prompt = self.call(m.begin_turn, s.id, msg.client, msg.input_ids)
        except RequestError:
            m.close(s.id, msg.client)
            raise
        return s.id, np.asarray(prompt, dtype=np.int64)

    def discard_open(self, session: str, client: bytes) -> None:
        if self.sessions is not None:
            self.sessions.abort_turn(session)
            self.sessions.close(session, client)

    def check_pin(self, name: str, ids: np.ndarray, namespace: str | None) -> None:
        self.call(self.manager().check_pin, name, ids, namespace)

    def unreclaimable_tokens(self) -> int:
        """Tokens pins and hard sessions hold (soft ones can be demoted on demand)."""
        if self.sessions is None or not (self.sessions.num_sessions or self.sessions.num_pins):
            return 0
        by_class = self.sessions.retained_tokens()
        return by_class.get("pinned", 0) + by_class.get("hard", 0)

    # --------------------------------------------------------------- admission
    def restore_slots(self, r: Request, cached_len: int) -> np.ndarray | None:
        """Device slots holding the K/V of the session history after `cached_len`,
        copied back from the host tier (None: nothing to restore)."""
        g = r.group
        if self.sessions is None or g.session is None or g.kind is RequestKind.PIN:
            return None
        return self.sessions.restore_from_host(g.session, cached_len)

    def note_reuse(self, r: Request, matched: int, restored: int) -> None:
        g = r.group
        g.restored_tokens = restored
        if self.sessions is not None and g.session is not None:
            g.recomputed_tokens = self.sessions.recomputed_tokens(g.session, matched + restored)

    def make_room(self, n_tokens: int) -> int:
        return self.sessions.make_room(n_tokens) if self.sessions is not None else 0

    def tick(self, now: float) -> bool:
        return bool(self.sessions.tick(now)) if self.sessions is not None else False

    def client_gone(self, client: bytes) -> None:
        if self.sessions is not None:
            self.sessions.client_gone(client)

    # ------------------------------------------------------------------ endings
    def finish(self, r: Request, node: TreeNode | None) -> None:
        """A branch finished and its tokens are in the tree: settle its turn or pin."""
        g = r.group
        m = self.sessions
        if g.kind is RequestKind.PIN:
            try:
                self.call(m.pin, g.pin_name, g.prompt, node, g.namespace)
            except RequestError as e:
                self._reply(g.client, Error(rid=g.rid, code=e.code, message=e.message))
                return
            self._reply(g.client, Pinned(rid=g.rid, name=g.pin_name or "", length=g.prompt_len))
            return
        if g.session is None or m is None:
            return
        history = r.tokens[: r.num_tokens]
        try:
            if g.n == 1:
                g.session_turn_open = False
                m.end_turn(g.session, history, node)
                r.session = g.session
            else:
                r.session = m.branch(g.session, history)
        except Exception as e:  # noqa: BLE001 - the output stands; the session keeps its history
            log.exception("session %s: could not record the turn", g.session[:8])
            if g.n == 1:
                m.abort_turn(g.session)
            if g.kind is RequestKind.OPEN_SESSION:
                self._reply(
                    g.client,
                    Error(rid=g.rid, code=getattr(e, "code", ErrorCode.INTERNAL), message=str(e)),
                )
            return
        if g.kind is RequestKind.OPEN_SESSION:
            self._reply(
                g.client,
                SessionOpened(
                    rid=g.rid,
                    session=g.session,
                    length=g.prompt_len,
                    cached_tokens=max(r.cached_tokens, 0),
                ),
            )

    def fail(self, r: Request) -> None:
        """A branch was aborted or failed: its turn leaves the history unchanged."""
        g = r.group
        if self.sessions is None or g.session is None or g.n > 1:
            return
        if g.session_turn_open:
            g.session_turn_open = False
            self.sessions.abort_turn(g.session)
        if g.kind is RequestKind.OPEN_SESSION:
            with contextlib.suppress(Exception):  # already closed by client_gone
                self.sessions.close(g.session, g.client)

    def group_done(self, g: RequestGroup) -> None:
        """Every branch ended. An n > 1 session turn appends the input to the history once
        its prompt was prefilled (the branches went on in their own sessions)."""
        if self.sessions is None or g.session is None or not g.session_turn_open:
            return
        g.session_turn_open = False
        try:
            if g.prefilled:
                self.sessions.end_turn(g.session, g.prompt, None)
            else:
                self.sessions.abort_turn(g.session)
        except Exception:  # noqa: BLE001
            log.exception("session %s: could not close the n > 1 turn", g.session[:8])
            self.sessions.abort_turn(g.session)
