"""A tiny synchronous protocol client: one DEALER socket, `protocol.py` messages.

For the `radixlm generate` / `radixlm sessions` commands, the launcher's readiness probe,
tests and scripts. It imports pyzmq, msgspec and the protocol module only. (Programs
want the async SDK, `import radixlm as rl`.)

    with RawClient("ipc:///run/user/1000/radixlm-x/client") as c:
        done = c.generate("Hello", max_tokens=16, temperature=0)
        print(done.text)

Replies for other requests that arrive while waiting for one are kept, so several
requests may be in flight at once (`send` them, then `recv_for` each rid).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    Chunk,
    Done,
    Error,
    Generate,
    GetStats,
    Hello,
    Input,
    ListSessions,
    SamplingParams,
    ServerMessage,
    SessionInfo,
    SessionList,
    StatsReply,
    Struct,
    Welcome,
    decode_server,
    encode,
)

__all__ = ["RawClient", "ServerError"]


class ServerError(Exception):
    """The server answered with an `Error`."""

    def __init__(self, error: Error) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error
        self.code = error.code
        self.rid = error.rid


class RawClient:
    """A synchronous radixlm client over one DEALER socket.

    `timeout_s` bounds every wait for a reply (None: wait forever); a wait that runs out
    raises `TimeoutError`. With ``handshake=True`` the constructor sends `Hello` and keeps
    the `Welcome` in `welcome`.
    """

    def __init__(self, endpoint: str, *, name: str = "radixlm-raw-client",
                 timeout_s: float | None = 60.0, handshake: bool = True,
                 options: dict[int, Any] | None = None) -> None:
        self.endpoint = endpoint
        self.name = name
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        for option, value in (options or {}).items():  # e.g. CURVE keys
            self._sock.setsockopt(option, value)
        self._sock.connect(endpoint)
        self._buffer: deque[ServerMessage] = deque()
        self._rids = itertools.count(1)
        self.welcome: Welcome | None = None
        if handshake:
            try:
                self.hello()
            except BaseException:
                self.close()
                raise

    # -- plumbing ------------------------------------------------------------------------

    def new_rid(self, prefix: str = "r") -> str:
        return f"{prefix}{next(self._rids)}"

    def send(self, msg: Struct) -> None:
        self._sock.send(encode(msg))

    def send_raw(self, data: bytes) -> None:
        """Send a frame as it is (tests send malformed ones)."""
        self._sock.send(data)

    def _read(self, deadline: float | None) -> ServerMessage:
        try:  # a message is usually waiting already: skip the poll
            return decode_server(self._sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            pass
        timeout_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        if not self._sock.poll(timeout_ms):
            raise TimeoutError(f"no reply from {self.endpoint} within {self.timeout_s} s")
        return decode_server(self._sock.recv())

    def _deadline(self, timeout_s: float | None) -> float | None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return None if timeout_s is None else time.monotonic() + timeout_s

    def recv(self, timeout_s: float | None = None) -> ServerMessage:
        """The next message (kept ones first)."""
        if self._buffer:
            return self._buffer.popleft()
        return self._read(self._deadline(timeout_s))

    def recv_for(self, rid: str | None, timeout_s: float | None = None) -> ServerMessage:
        """The next message for `rid` (None: messages without a rid); others are kept."""
        for i, msg in enumerate(self._buffer):
            if getattr(msg, "rid", None) == rid:
                del self._buffer[i]
                return msg
        deadline = self._deadline(timeout_s)
        while True:
            msg = self._read(deadline)
            if getattr(msg, "rid", None) == rid:
                return msg
            self._buffer.append(msg)

    def request(self, msg: Struct, timeout_s: float | None = None) -> ServerMessage:
        """Send `msg` and return the first reply for its rid (an `Error` included)."""
        self.send(msg)
        return self.recv_for(getattr(msg, "rid", None), timeout_s)

    def call(self, msg: Struct, timeout_s: float | None = None) -> ServerMessage:
        """`request`, raising `ServerError` for an `Error` reply."""
        reply = self.request(msg, timeout_s)
        if isinstance(reply, Error):
            raise ServerError(reply)
        return reply

    # -- protocol --------------------------------------------------------------------------

    def hello(self, protocol_version: int = PROTOCOL_VERSION,
              timeout_s: float | None = None) -> Welcome:
        self.send(Hello(protocol_version=protocol_version, client_name=self.name))
        reply = self.recv_for(None, timeout_s)
        if isinstance(reply, Error):
            raise ServerError(reply)
        if not isinstance(reply, Welcome):
            raise ServerError(Error(rid=None, code="bad_message",
                                    message=f"expected welcome, got {type(reply).__name__}"))
        self.welcome = reply
        return reply

    def generate(self, prompt: str | Input, **options: Any) -> Done:
        """Run one request (``n == 1``) to its end and return its `Done`; `options` are
        `generate_n`'s."""
        if options.get("n", 1) != 1:
            raise ValueError("generate() runs n == 1; use generate_n() for branches")
        return self.generate_n(prompt, **options)[0]

    def generate_n(
        self,
        prompt: str | Input,
        *,
        rid: str | None = None,
        stream: bool = False,
        on_chunk: Callable[[Chunk], None] | None = None,
        session: str | None = None,
        n: int = 1,
        timeout_s: float | None = None,
        **sampling: Any,
    ) -> list[Done]:
        """Run one request to its end: the `Done` of each of its `n` branches, by index.

        `prompt` is text or an `Input`; `sampling` are `SamplingParams` fields. With
        ``stream=True`` every `Chunk` goes to `on_chunk`. Raises `ServerError`.
        """
        rid = rid or self.new_rid("gen")
        inp = prompt if isinstance(prompt, Input) else Input(text=prompt)
        self.send(Generate(rid=rid, input=inp, sampling=msgspec.convert(sampling, SamplingParams),
                           stream=stream, session=session, n=n))
        return self.collect(rid, n=n, on_chunk=on_chunk, timeout_s=timeout_s)

    def collect(self, rid: str, *, n: int = 1, on_chunk: Callable[[Chunk], None] | None = None,
                timeout_s: float | None = None) -> list[Done]:
        """Read a sent Generate's replies until its `n` Dones (raises `ServerError`)."""
        dones: list[Done] = []
        while len(dones) < n:
            msg = self.recv_for(rid, timeout_s)
            if isinstance(msg, Chunk):
                if on_chunk is not None:
                    on_chunk(msg)
            elif isinstance(msg, Done):
                dones.append(msg)
            elif isinstance(msg, Error):
                raise ServerError(msg)
        return sorted(dones, key=lambda d: d.index)

    def stats(self) -> StatsReply:
        reply = self.call(GetStats(rid=self.new_rid("stats")))
        assert isinstance(reply, StatsReply), reply
        return reply

    def list_sessions(self) -> list[SessionInfo]:
        reply = self.call(ListSessions(rid=self.new_rid("ls")))
        assert isinstance(reply, SessionList), reply
        return reply.sessions

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
