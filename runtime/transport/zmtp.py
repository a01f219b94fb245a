"""A ZeroMQ DEALER in pure asyncio: ZMTP 3.1 with NULL security, for ipc:// and tcp://.

libzmq moves every message through an I/O thread of its own: a request wakes that thread
to send, and the reply wakes it again before it wakes the caller. On a small, virtualized
host each thread wake-up costs more CPU than the rest of a request. Speaking ZMTP on a
socket of the event loop itself sends from the caller and reads in a loop callback: no
other thread, no ``ZMQ_EVENTS`` dance. It covers what talking to the engine's ROUTER
takes (ZMTP 3.1, RFC 37): the greeting, the READY handshake (``Socket-Type: DEALER``),
short and long frames, multipart messages, and PING -> PONG (the engine's tcp
heartbeats). A ROUTER strips its peer identity, so each message here is its frames.

Reads go straight into one reused buffer (`asyncio.BufferedProtocol`): a plain protocol
gets a fresh 256 KiB bytes object per read, which costs the allocator an mmap, an mremap
and a munmap (and page faults) for every reply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import cast

from radixlm.runtime.transport.endpoints import parse_endpoint

__all__ = ["ZmtpDealer"]

# Signature, version 3.1, mechanism NULL, as-server 0, filler.
_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
_GREETING_SIZE = 64
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
_SHORT_HEADERS = [bytes((0, n)) for n in range(256)]
_RETRY_S = (0.005, 0.1)  # first and longest wait between connection attempts
_BUFFER = 1 << 16  # initial receive buffer; it grows to hold a bigger frame whole
_MIN_READ = 4096  # free space below which the buffer is compacted before a read


def _command(name: bytes, body: bytes) -> bytes:
    payload = bytes((len(name),)) + name + body
    if len(payload) < 256:
        return bytes((_COMMAND, len(payload))) + payload
    return bytes((_COMMAND | _LONG,)) + len(payload).to_bytes(8, "big") + payload


def _framed(data: bytes) -> bytes:
    n = len(data)
    if n < 256:
        return _SHORT_HEADERS[n] + data
    return b"\x02" + n.to_bytes(8, "big") + data


def _property(name: bytes, value: bytes) -> bytes:
    return bytes((len(name),)) + name + len(value).to_bytes(4, "big") + value


_READY = _command(b"READY", _property(b"Socket-Type", b"DEALER"))


class ZmtpDealer(asyncio.BufferedProtocol):
    """One DEALER connection. Frames go to `on_frame` in order; `on_lost` is told (once)
    when the connection goes, with why."""

    def __init__(self, on_frame: Callable[[bytes], None], on_lost: Callable[[str], None]) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray(_BUFFER)
        self._start = 0  # received bytes not parsed yet: _buf[_start:_end]
        self._end = 0
        self._need = _GREETING_SIZE  # bytes the unparsed rest must reach to be worth parsing
        self._greeted = False  # the peer's greeting was read
        self._ready: asyncio.Future[None] | None = None  # set by the peer's READY
        self._parts: list[bytes] = []  # frames of a multipart message so far
        self._closing = False
        self._held: list[bytes] | None = None  # framed messages held by `cork`

    # -- connecting ------------------------------------------------------------------------

    async def connect(self, endpoint: str, timeout: float) -> None:
        """Connect (retrying while nothing listens yet, up to `timeout` s in all) and
        complete the ZMTP handshake. Raises ``OSError`` or ``TimeoutError``."""
        target = parse_endpoint(endpoint).native
        if target is None:
            raise ValueError(f"not an endpoint for the native transport: {endpoint!r}")
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        pause = _RETRY_S[0]
        while True:
            self._ready = loop.create_future()
            try:
                if target[0] == "unix":
                    await loop.create_unix_connection(lambda: self, target[1])  # type: ignore[arg-type]
                else:
                    host, port = target[1]  # type: ignore[misc]
                    await loop.create_connection(lambda: self, host, port)
                break
            except (FileNotFoundError, ConnectionRefusedError):  # not listening (yet)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"nothing listens at {endpoint}") from None
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, _RETRY_S[1])
        await asyncio.wait_for(self._ready, max(deadline - time.monotonic(), 0.0))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's are not `asyncio.Transport` subclasses).
        self._transport = transport = cast(asyncio.Transport, transport)
        transport.write(_GREETING + _READY)

    # -- sending ---------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Send one single-frame message (queued by the transport if the socket is full)."""
        transport = self._transport
        if transport is None or self._closing:
            raise ConnectionError("the connection to the engine is closed")
        if self._held is not None:
            self._held.append(_framed(data))
        else:
            transport.write(_framed(data))

    def send_many(self, messages: list[bytes]) -> None:
        """Send single-frame messages, in order, in one write (one system call)."""
        transport = self._transport
        if transport is None or self._closing:
            raise ConnectionError("the connection to the engine is closed")
        if self._held is not None:
            self._held += [_framed(data) for data in messages]
        else:
            transport.write(b"".join([_framed(data) for data in messages]))

    def cork(self) -> None:
        """Hold what is sent until the loop has run the callbacks scheduled so far (the
        first steps of tasks just started, say), then send it all in one write: a send
        costs a system call that wakes the engine, whatever its size."""
        if self._held is None and self._transport is not None:
            self._held = []
            asyncio.get_running_loop().call_soon(self._uncork)

    def _uncork(self) -> None:
        held, self._held = self._held, None
        if held and self._transport is not None and not self._closing:
            self._transport.write(b"".join(held))

    def close(self) -> None:
        """Close the connection; what was sent already still leaves (it is in the kernel,
        or flushed by the transport before it closes)."""
        self._uncork()
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    # -- receiving -------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        buf, start, end = self._buf, self._start, self._end
        if start == end:
            self._start = self._end = start = end = 0
        elif len(buf) - end < max(_MIN_READ, self._need - (end - start)):
            # Move the incomplete rest to the front, growing the buffer if it cannot
            # hold the frame it is waiting for.
            rest = buf[start:end]
            if len(buf) < self._need + _MIN_READ:
                buf = self._buf = bytearray(max(2 * len(buf), self._need + _MIN_READ))
            end = len(rest)
            buf[:end] = rest
            self._start, self._end = 0, end
        return memoryview(buf)[end:]

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        if self._end - self._start < self._need:
            return  # the pending frame is still incomplete: parse once it is whole
        try:
            self._start = self._parse(self._buf, self._start, self._end)
        except _ProtocolError as e:
            self._lose(f"the engine broke the ZMTP protocol: {e}")

    def _parse(self, data: bytearray, pos: int, end: int) -> int:
        """Handle every whole frame in ``data[pos:end]``; returns where the incomplete
        rest starts (and sets ``_need``: how many bytes that rest must reach)."""
        if not self._greeted:
            if data[pos] != 0xFF or data[pos + 9] != 0x7F or data[pos + 10] < 3:
                raise _ProtocolError("not a ZMTP 3 greeting")
            if data[pos + 12:pos + 16] != b"NULL":
                raise _ProtocolError("the engine asks for a security mechanism")
            self._greeted = True
            pos += _GREETING_SIZE
        on_frame, view = self._on_frame, memoryview(data)
        while True:
            if end - pos < 2:
                self._need = 2
                return pos
            flags = data[pos]
            if flags & _LONG:
                if end - pos < 9:
                    self._need = 9
                    return pos
                start = pos + 9
                size = int.from_bytes(data[pos + 1:start], "big")
            else:
                start = pos + 2
                size = data[pos + 1]
            stop = start + size
            if stop > end:
                self._need = stop - pos
                return pos
            body = bytes(view[start:stop])
            pos = stop
            if flags & _COMMAND:
                self._command(body)
            elif flags & _MORE:
                self._parts.append(body)
            elif self._parts:
                parts, self._parts = self._parts, []
                for part in (*parts, body):
                    on_frame(part)
            else:
                on_frame(body)

    def _command(self, body: bytes) -> None:
        name = body[1:1 + body[0]] if body else b""
        if name == b"READY":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif name == b"PING":  # [name][ttl: 2 bytes][context]: answer PONG with the context
            if self._transport is not None and not self._closing:
                self._transport.write(_command(b"PONG", body[1 + len(name) + 2:]))
        elif name == b"ERROR":
            reason = body[2 + len(name):].decode("utf-8", "replace")
            raise _ProtocolError(f"the engine refused the connection: {reason}")
        # Other commands (PONG, SUBSCRIBE...) mean nothing to a DEALER.

    # -- losing the connection -------------------------------------------------------------

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ConnectionError(
                "the engine closed the connection during the handshake"))
        if not self._closing:
            why = f": {exc}" if exc is not None else ""
            self._on_lost(f"the connection to the engine was closed{why}")

    def _lose(self, reason: str) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ConnectionError(reason))
        self._on_lost(reason)
        self._closing = True
        if self._transport is not None:
            self._transport.abort()


class _ProtocolError(Exception):
    pass

