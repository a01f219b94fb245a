"""`ProtocolClient`: the engine protocol over one `Connection`, for every async client.

The SDK's `AsyncClient` and the HTTP process's `EngineLink` are this, plus what each adds
(the SDK: user inputs and sampling keywords turned into messages, results; the HTTP
process: a tenant's gateway credential). It does, once:

- request ids (`new_rid`, from `exchange.Rids`);
- `request`: send one message, get its in-flight `Request` (a ``Generate`` waits for the
  ``Done`` of each of its ``n`` branches, and is aborted if closed before);
- `call`: a request with exactly one answer, of the type expected (an ``Error`` raises
  its typed `EngineError`; another type, `InternalError`);
- `run_generate`: a ``Generate`` to its end, one ``Done`` per branch by index (aborted
  in the engine if cancelled half-way); stream its ``Chunk``s with `request`;
- the protocol's one-answer requests (sessions, pins, stats, tokenizing), each a method
  that takes and returns protocol types.

Must be used from the event loop (and so the thread) that opened it: a request from
another thread is refused (`wrong_loop` makes the error).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from threading import get_ident
from typing import TypeVar

from anyio.abc import TaskGroup
from radixlm.runtime.protocol import (
    CloseSession,
    Detokenize,
    Detokenized,
    Done,
    FlushCache,
    ForkSession,
    Gateway,
    Generate,
    GetStats,
    Input,
    ListSessions,
    Ok,
    OpenSession,
    Pin,
    Pinned,
    ResumeSession,
    Retention,
    SessionInfo,
    SessionList,
    SessionOpened,
    SessionsForked,
    StatsReply,
    Struct,
    Tokenize,
    Tokens,
    TruncateSession,
    Unpin,
    Welcome,
)
from radixlm.runtime.transport.connection import Connection, Liveness
from radixlm.runtime.transport.curve import CurveKeys
from radixlm.runtime.transport.exchange import Rids, unexpected
from radixlm.runtime.transport.request import Request

__all__ = ["ProtocolClient"]

R = TypeVar("R")


class ProtocolClient:
    """The protocol's calls over one engine connection (see the module doc).

    `rid_prefix` starts every request id; `wrong_loop` makes the error for a request
    from a thread other than the one that opened the client. The other arguments are the
    `Connection`'s.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        client_name: str,
        rid_prefix: str = "",
        heartbeat_timeout: float = 30.0,
        liveness: Liveness | None = None,
        curve: CurveKeys | None = None,
        gateway: Gateway | None = None,
        wrong_loop: Callable[[], Exception] = lambda: RuntimeError(
            "this client belongs to another event loop (or is not open)"),
    ) -> None:
        self.conn = Connection(endpoint, client_name=client_name,
                               heartbeat_timeout=heartbeat_timeout, liveness=liveness,
                               curve=curve, gateway=gateway)
        self.rids = Rids(rid_prefix)
        self._wrong_loop = wrong_loop
        self._thread: int | None = None  # the one that opened it

    # -- lifecycle ------------------------------------------------------------------------

    async def open(self, tg: TaskGroup, connect_timeout: float) -> Welcome:
        """Connect and shake hands (`Connection.open`); the link's tasks run in `tg`."""
        self._thread = get_ident()
        return await self.conn.open(tg, connect_timeout)

    def close(self) -> None:
        """Close the connection (after `tg` was cancelled)."""
        self.conn.close()

    @property
    def welcome(self) -> Welcome | None:
        """What the engine said about itself when the client connected."""
        return self.conn.welcome

    @property
    def alive(self) -> bool:
        """False once the engine was found dead or the client closed."""
        return self.conn.alive

    # -- requests -------------------------------------------------------------------------

    def new_rid(self) -> str:
        """A request id unused by this client."""
        return self.rids.new()

    def request(self, msg: Struct) -> Request:
        """Send `msg` (a message with a ``rid``) and return its in-flight `Request`: use
        it as an async context manager (or ``await req.aclose()``), so a generation left
        before its end is aborted in the engine."""
        if self._thread != get_ident():
            raise self._wrong_loop()
        if type(msg) is Generate:
            return self.conn.request(msg, branches=msg.n, generate=True)
        return self.conn.request(msg)

    async def call(self, msg: Struct, expect: type[R]) -> R:
        """Send a request that has exactly one answer and return it (typed errors raise)."""
        req = self.request(msg)
        try:
            reply = await req.receive()
        finally:
            req.close()
        if not isinstance(reply, expect):
            raise unexpected(reply, msg)
        return reply

    async def run_generate(self, msg: Generate) -> list[Done]:
        """Send a Generate and collect one Done per branch (sorted by branch index)."""
        req = self.request(msg)
        try:
            while not req.finished:
                await req.receive()
        finally:
            if req.finished:
                req.close()
            else:  # cancelled or failed mid-way: abort it in the engine
                await req.aclose()
        return req.sorted_dones()

    # -- sessions and pins ------------------------------------------------------------------

    async def open_session(self, inp: Input | None = None, *, pinned: str | None = None,
                           retention: Retention = "hard", ttl_s: float | None = None,
                           namespace: str | None = None, durable: bool = False
                           ) -> SessionOpened:
        """Open a session: empty, from `inp` prefilled now, and/or from the pin `pinned`
        (`durable`: kept across disconnects and restarts, where the server keeps state)."""
        return await self.call(OpenSession(rid=self.new_rid(), input=inp, pinned=pinned,
                                           retention=retention, ttl_s=ttl_s,
                                           namespace=namespace, durable=durable),
                               SessionOpened)

    async def resume_session(self, session: str) -> SessionOpened:
        """Take the durable session `session` as this connection's own."""
        return await self.call(ResumeSession(rid=self.new_rid(), session=session),
                               SessionOpened)

    async def fork_session(self, session: str, n: int = 1) -> SessionsForked:
        """`n` new sessions sharing `session`'s history."""
        return await self.call(ForkSession(rid=self.new_rid(), session=session, n=n),
                               SessionsForked)

    async def truncate_session(self, session: str, length: int) -> None:
        """Cut `session`'s history back to its first `length` tokens."""
        await self.call(TruncateSession(rid=self.new_rid(), session=session, length=length), Ok)

    async def close_session(self, session: str) -> None:
        """Close `session` and wait for the engine's answer."""
        await self.call(CloseSession(rid=self.new_rid(), session=session), Ok)

    def close_sessions_unawaited(self, sessions: Sequence[str]) -> None:
        """Close `sessions` without waiting for the answer (the engine handles a client's
        requests in order: later ones see them closed). Nothing is sent on a dead
        connection: the engine dropped its sessions with it."""
        if not sessions or not self.conn.alive:
            return
        rid = self.new_rid()
        msg = (CloseSession(rid=rid, session=sessions[0]) if len(sessions) == 1
               else CloseSession(rid=rid, sessions=list(sessions)))
        self.conn.send_unawaited(msg)

    async def list_sessions(self) -> list[SessionInfo]:
        """This client's open sessions."""
        return (await self.call(ListSessions(rid=self.new_rid()), SessionList)).sessions

    async def pin(self, name: str, inp: Input, namespace: str | None = None) -> int:
        """Prefill and hold `inp` as the pin `name`; its length in tokens."""
        reply = await self.call(Pin(rid=self.new_rid(), name=name, input=inp,
                                    namespace=namespace), Pinned)
        return reply.length

    async def unpin(self, name: str) -> None:
        """Release the pin `name`."""
        await self.call(Unpin(rid=self.new_rid(), name=name), Ok)

    # -- engine state and tokens ---------------------------------------------------------------

    async def stats(self) -> StatsReply:
        """The engine's counters and sizes."""
        return await self.call(GetStats(rid=self.new_rid()), StatsReply)

    async def flush_cache(self) -> None:
        """Evict everything evictable from the prefix cache."""
        await self.call(FlushCache(rid=self.new_rid()), Ok)

    async def tokenize(self, inp: Input) -> list[int]:
        """The token ids of `inp` as a fresh prompt."""
        return (await self.call(Tokenize(rid=self.new_rid(), input=inp), Tokens)).input_ids

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids`."""
        return (await self.call(Detokenize(rid=self.new_rid(), token_ids=token_ids),
                                Detokenized)).text
