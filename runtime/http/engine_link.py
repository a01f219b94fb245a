"""The HTTP process's one connection to the engine (the SDK's transport, no torch).

Every HTTP request is one or more protocol requests on this connection; stored responses
and chat sessions are engine sessions owned by it, so they live as long as the HTTP
process stays connected.
"""

from __future__ import annotations

import itertools
from typing import Any, TypeVar

from anyio.abc import TaskGroup
from radixlm.runtime.protocol import (
    CloseSession,
    Done,
    ForkSession,
    Generate,
    GetStats,
    Input,
    OpenSession,
    SessionOpened,
    SessionsForked,
    StatsReply,
    Struct,
    Tokenize,
    Tokens,
    Welcome,
)
from radixlm.sdk.connection import Connection, Request
from radixlm.sdk.errors import InternalError

R = TypeVar("R")


class EngineLink:
    def __init__(self, endpoint: str, *, heartbeat_timeout: float = 15.0) -> None:
        self.conn = Connection(endpoint, client_name="radixlm-http",
                               heartbeat_timeout=heartbeat_timeout)
        self._rids = itertools.count()
        self.welcome: Welcome | None = None

    async def open(self, tg: TaskGroup, timeout_s: float) -> Welcome:
        self.welcome = await self.conn.open(tg, timeout_s)
        return self.welcome

    def close(self) -> None:
        self.conn.close()

    @property
    def alive(self) -> bool:
        return self.conn.alive

    def rid(self) -> str:
        return f"h{next(self._rids):x}"

    def start(self, msg: Generate) -> Request:
        """Send a Generate; read its replies from the returned `Request` (close it after:
        `aclose` aborts a generation that has not finished)."""
        return self.conn.request(msg, branches=msg.n, generate=True)

    async def generate(self, msg: Generate) -> list[Done]:
        """Run a Generate to its end; one Done per branch, by branch index."""
        req = self.start(msg)
        try:
            while not req.finished:
                await req.receive()
        finally:
            await req.aclose()
        return sorted(req.dones, key=lambda d: d.index)

    async def call(self, msg: Struct, expect: type[R]) -> R:
        req = self.conn.request(msg)
        try:
            reply: Any = await req.receive()
        finally:
            req.close()
        if not isinstance(reply, expect):
            raise InternalError(f"unexpected {type(reply).__name__} for {type(msg).__name__}")
        return reply

    async def open_session(self, ttl_s: float | None = None) -> str:
        reply = await self.call(OpenSession(rid=self.rid(), retention="soft", ttl_s=ttl_s),
                                SessionOpened)
        return reply.session

    async def fork_session(self, session: str) -> str:
        reply = await self.call(ForkSession(rid=self.rid(), session=session), SessionsForked)
        return reply.sessions[0]

    def close_sessions(self, sessions: list[str]) -> None:
        """Close sessions without waiting (their KV stays as ordinary evictable cache)."""
        if sessions and self.alive:
            self.conn.send_unawaited(CloseSession(rid=self.rid(), sessions=sessions))

    async def stats(self) -> StatsReply:
        return await self.call(GetStats(rid=self.rid()), StatsReply)

    async def tokenize(self, inp: Input) -> list[int]:
        return (await self.call(Tokenize(rid=self.rid(), input=inp), Tokens)).input_ids
