"""`ZmqDealer`: the engine connection over a libzmq DEALER socket (pyzmq).

A connection uses it where the native transport (`radixlm.runtime.transport.zmtp`) does
not apply: event loops other than asyncio, endpoints other than ipc:// and tcp://, and
CurveZMQ.

ZeroMQ's file descriptor is edge-triggered: any operation on the socket (a send
included) may consume the readiness edge, leaving replies queued while the fd stays
quiet. So whoever touches the socket drains it: the reader after the fd wakes it, and a
sender right after its send, inline, when ``ZMQ_EVENTS`` says a reply is waiting
(dispatching is synchronous: a reply only lands in a request's mailbox).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import zmq
from anyio.abc import TaskGroup
from radixlm.runtime.transport.channel import open_socket

__all__ = ["ZmqDealer"]

_CLOSE_LINGER_MS = 200
# Plain ints: pyzmq's flag enums cost an enum operation on every use.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class ZmqDealer:
    """A DEALER socket; frames go to `on_frame`. (libzmq reconnects by itself, so the
    connection is never reported lost: the liveness monitor notices a dead engine.)"""

    def __init__(self, on_frame: Callable[[bytes], None],
                 options: dict[int, Any] | None = None) -> None:
        self._on_frame = on_frame
        self._options = options  # CURVE keys
        self._ctx = zmq.Context(io_threads=1)
        self._sock: zmq.Socket[Any] | None = None
        self._fd = -1

    async def connect(self, endpoint: str, tg: TaskGroup) -> None:
        """Connect (libzmq completes it in the background) and start the reader in `tg`."""
        # radixlm's socket options (`open_socket`): no lingering, unbounded high-water
        # marks (a local pipe never blocks or drops a send), ZMTP heartbeats.
        self._sock = open_socket(self._ctx, zmq.DEALER, endpoint, bind=False,
                                 options=self._options)
        self._fd = self._sock.getsockopt(zmq.FD)
        tg.start_soon(self._read_loop, name="radixlm reader")

    def send(self, data: bytes) -> None:
        if self._sock is None:
            raise ConnectionError("not connected")
        try:
            self._sock.send(data, _NOBLOCK)
        except zmq.Again:  # cannot happen with SNDHWM=0 on a connected socket
            raise ConnectionError("the socket would block") from None
        except zmq.ZMQError as e:
            raise ConnectionError(str(e)) from None
        # The send may have consumed the fd's edge for a reply that is already queued.
        self._drain()

    def send_many(self, messages: list[bytes]) -> None:
        for data in messages:
            self.send(data)

    def cork(self) -> None:
        """Nothing to gain: libzmq's I/O thread batches on its own."""

    def close(self, *, linger: bool) -> None:
        """Close the socket (after the task group running the reader was cancelled);
        with `linger`, messages still queued get a moment to leave."""
        if self._sock is not None:
            self._sock.close(linger=_CLOSE_LINGER_MS if linger else 0)
        self._ctx.term()

    async def _read_loop(self) -> None:
        """Dispatch replies as they arrive, for as long as the client is open."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio: wait on the fd in this task
            while True:
                self._drain()
                await anyio.wait_readable(self._fd)
        # asyncio: drain from a reader callback, saving a task switch (and a new fd waiter)
        # per reply; this task owns the registration and removes it when the client closes.
        loop.add_reader(self._fd, self._drain)
        try:
            self._drain()
            await anyio.sleep_forever()
        finally:
            loop.remove_reader(self._fd)

    def _drain(self) -> None:
        """Dispatch every reply queued on the socket (the fd stays quiet until new ones).
        ``ZMQ_EVENTS`` is asked first: a failed non-blocking recv costs a raised exception."""
        sock = self._sock
        if sock is None:
            return
        events, recv, on_frame = sock.getsockopt, sock.recv, self._on_frame
        try:
            while events(_EVENTS) & _POLLIN:
                on_frame(recv(_NOBLOCK))
        except zmq.Again:  # pragma: no cover - EVENTS said a frame was there
            return
        except zmq.ZMQError:  # the socket is closed: the client is shutting down
            return
