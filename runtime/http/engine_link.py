"""One engine connection of the HTTP process (the SDK's transport, no torch): one per
tenant (API key).

Every HTTP request is one or more protocol requests on its tenant's connection; stored
responses and chat sessions are engine sessions owned by it, so they live as long as the
HTTP process stays connected.
"""

from __future__ import annotations

import itertools
from typing import Any, TypeVar

from anyio.abc import TaskGroup
from radixlm.runtime import protocol as p
from radixlm.runtime.http.config import DEFAULT_LINK_TIMEOUT_S
from radixlm.runtime.transport.connection import Connection, Request
from radixlm.runtime.transport.curve import CurveKeys
from radixlm.runtime.transport.errors import InternalError

R = TypeVar("R")


class EngineLink:
    def __init__(self, endpoint: str, *, heartbeat_timeout: float = DEFAULT_LINK_TIMEOUT_S,
                 tenant: str | None = None, gateway_token: str | None = None,
                 curve: CurveKeys | None = None) -> None:
        """`tenant` with `gateway_token`: the connection is that tenant's (the frontend
        trusts the gateway credential); without a token it is the server's local one."""
        gateway = None
        if tenant is not None and gateway_token is not None:
            gateway = p.Gateway(tenant=tenant, token=gateway_token)
        self.conn = Connection(endpoint, client_name="radixlm-http",
                               heartbeat_timeout=heartbeat_timeout, gateway=gateway,
                               curve=curve)
        self._rids = itertools.count()
        self.welcome: p.Welcome | None = None

    async def open(self, tg: TaskGroup, timeout_s: float) -> p.Welcome:
        self.welcome = await self.conn.open(tg, timeout_s)
        return self.welcome

    def close(self) -> None:
        self.conn.close()

    @property
    def alive(self) -> bool:
        return self.conn.alive

    def rid(self) -> str:
        return f"h{next(self._rids):x}"

    def start(self, msg: p.Generate) -> Request:
        """Send a Generate; read its replies from the returned `Request` (close it after:
        `aclose` aborts a generation that has not finished)."""
        return self.conn.request(msg, branches=msg.n, generate=True)

    async def generate(self, msg: p.Generate) -> list[p.Done]:
        """Run a Generate to its end; one Done per branch, by branch index."""
        req = self.start(msg)
        try:
            while not req.finished:
                await req.receive()
        finally:
            await req.aclose()
        return sorted(req.dones, key=lambda d: d.index)

    async def call(self, msg: p.Struct, expect: type[R]) -> R:
        req = self.conn.request(msg)
        try:
            reply: Any = await req.receive()
        finally:
            req.close()
        if not isinstance(reply, expect):
            raise InternalError(f"unexpected {type(reply).__name__} for {type(msg).__name__}")
        return reply

    async def open_session(self, ttl_s: float | None = None) -> str:
        reply = await self.call(p.OpenSession(rid=self.rid(), retention="soft", ttl_s=ttl_s),
                                p.SessionOpened)
        return reply.session

    async def fork_session(self, session: str) -> str:
        reply = await self.call(p.ForkSession(rid=self.rid(), session=session), p.SessionsForked)
        return reply.sessions[0]

    def close_sessions(self, sessions: list[str]) -> None:
        """Close sessions without waiting (their KV stays as ordinary evictable cache)."""
        if sessions and self.alive:
            self.conn.send_unawaited(p.CloseSession(rid=self.rid(), sessions=sessions))

    async def stats(self) -> p.StatsReply:
        return await self.call(p.GetStats(rid=self.rid()), p.StatsReply)

    async def tokenize(self, inp: p.Input) -> list[int]:
        return (await self.call(p.Tokenize(rid=self.rid(), input=inp), p.Tokens)).input_ids

    async def detokenize(self, token_ids: list[int]) -> str:
        return (await self.call(p.Detokenize(rid=self.rid(), token_ids=token_ids),
                                p.Detokenized)).text
