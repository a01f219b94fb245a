"""`RawClient`: the blocking protocol client, over one DEALER socket.

For the `radixlm generate` / `radixlm sessions` / `radixlm top` commands, tests and
scripts. (Programs want the async SDK, `import radixlm as rl`.) It keeps the protocol's
rules where every client keeps them (`exchange`: request ids, the hello, when a request
is finished, errors as typed `EngineError`s, the answer a call expects), reads its
endpoint with the one parser (`endpoints`), and opens its socket as every radixlm socket
is opened (`channel.open_socket`: ZMTP heartbeats, no lingering). It imports pyzmq,
msgspec and the protocol module: no anyio.

    with RawClient("ipc:///run/user/1000/radixlm-x/client") as c:
        done = c.generate("Hello", max_tokens=16, temperature=0)
        print(done.text)

Replies for other requests that arrive while waiting for one are kept, so several
requests may be in flight at once (`send` them, then `recv_for` each rid).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, overload

import msgspec
import zmq
from radixlm.runtime.protocol import (
    PROTOCOL_VERSION,
    Chunk,
    Done,
    Generate,
    GetStats,
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
from radixlm.runtime.transport.channel import open_socket
from radixlm.runtime.transport.endpoints import checked_endpoint
from radixlm.runtime.transport.exchange import Replies, Rids, hello, unexpected

__all__ = ["RawClient"]

R = TypeVar("R")


class RawClient:
    """A synchronous radixlm client over one DEALER socket.

    `timeout_s` bounds every wait for a reply (None: wait forever); a wait that runs out
    raises `TimeoutError`. With ``handshake=True`` the constructor sends `Hello` and keeps
    the `Welcome` in `welcome`. An ``Error`` reply to a call raises its typed
    `EngineError` (`radixlm.runtime.transport.errors`). `options` are extra socket
    options (CurveZMQ keys).
    """

    def __init__(self, endpoint: str, *, name: str = "radixlm-raw-client",
                 timeout_s: float | None = 60.0, handshake: bool = True,
                 options: dict[int, Any] | None = None) -> None:
        checked_endpoint(endpoint)
        self.endpoint = endpoint
        self.name = name
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[Any] = zmq.Context()
        try:
            self._sock = open_socket(self._ctx, zmq.DEALER, endpoint, bind=False,
                                     options=options)
        except BaseException:
            self._ctx.term()
            raise
        self._buffer: deque[ServerMessage] = deque()
        self._rids = Rids("r", start=1)
        self.welcome: Welcome | None = None
        if handshake:
            try:
                self.hello()
            except BaseException:
                self.close()
                raise

    # -- plumbing ------------------------------------------------------------------------

    def new_rid(self, prefix: str = "r") -> str:
        """A request id unused by this client, starting with `prefix`."""
        return self._rids.with_prefix(prefix)

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
        """Send `msg` and return the first reply for its rid, as it is (an `Error` too)."""
        self.send(msg)
        return self.recv_for(getattr(msg, "rid", None), timeout_s)

    @overload
    def call(self, msg: Struct, expect: type[R], *, timeout_s: float | None = None) -> R: ...
    @overload
    def call(self, msg: Struct, expect: None = None, *,
             timeout_s: float | None = None) -> ServerMessage: ...

    def call(self, msg: Struct, expect: type[R] | None = None, *,
             timeout_s: float | None = None) -> Any:
        """A request with one answer: an `Error` raises its typed `EngineError`; with
        `expect`, an answer of another type raises `InternalError`."""
        reply = Replies(getattr(msg, "rid", "")).take(self.request(msg, timeout_s))
        if expect is not None and not isinstance(reply, expect):
            raise unexpected(reply, msg)
        return reply

    # -- protocol --------------------------------------------------------------------------

    def hello(self, protocol_version: int = PROTOCOL_VERSION,
              timeout_s: float | None = None) -> Welcome:
        msg = hello(self.name, protocol_version=protocol_version)
        self.send(msg)
        reply = Replies("").take(self.recv_for(None, timeout_s))
        if not isinstance(reply, Welcome):
            raise unexpected(reply, msg)
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
        ``stream=True`` every `Chunk` goes to `on_chunk`. An `Error` raises its typed
        `EngineError`.
        """
        rid = rid or self.new_rid("gen")
        inp = prompt if isinstance(prompt, Input) else Input(text=prompt)
        self.send(Generate(rid=rid, input=inp, sampling=msgspec.convert(sampling, SamplingParams),
                           stream=stream, session=session, n=n))
        return self.collect(rid, n=n, on_chunk=on_chunk, timeout_s=timeout_s)

    def collect(self, rid: str, *, n: int = 1, on_chunk: Callable[[Chunk], None] | None = None,
                timeout_s: float | None = None) -> list[Done]:
        """Read a sent Generate's replies until its `n` Dones, by branch index (an `Error`
        raises its typed `EngineError`)."""
        replies = Replies(rid, n)
        while not replies.finished:
            msg = replies.take(self.recv_for(rid, timeout_s))
            if on_chunk is not None and type(msg) is Chunk:
                on_chunk(msg)
        return replies.sorted_dones()

    def stats(self) -> StatsReply:
        return self.call(GetStats(rid=self.new_rid("stats")), StatsReply)

    def list_sessions(self) -> list[SessionInfo]:
        return self.call(ListSessions(rid=self.new_rid("ls")), SessionList).sessions

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
