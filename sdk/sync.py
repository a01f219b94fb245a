"""The synchronous API: `Client` (``rl.connect``), `ChatSession`, `SyncTextStream`.

A `Client` runs one event loop in one daemon thread and drives an `AsyncClient` in it
through a `LoopThread`: every sync call is one hop into that loop, and every
program run on the client executes there as anyio tasks -- one thread per client, never
one per program. The thread is a daemon so that a client nobody closed cannot hang
interpreter exit; a ``weakref.finalize`` (which also runs at exit) closes it cleanly.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from functools import partial
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal
from radixlm.runtime.protocol import Retention, SessionOpened
from radixlm.sdk.chat import AsyncChatSession
from radixlm.sdk.client import AsyncClient, TextStream
from radixlm.sdk.connection import Liveness
from radixlm.sdk.loop_thread import LoopThread
from radixlm.sdk.results import GenerateResult, StreamDelta

__all__ = ["ChatSession", "Client", "LoopThread", "SyncTextStream", "connect"]


async def _hold_client(client: AsyncClient, *, task_status: Any) -> None:
    """Keep `client` open (its task group lives in this task) until told to stop."""
    async with client:
        stop = anyio.Event()
        task_status.started(stop)
        await stop.wait()


def _close_client(loop: LoopThread, stop: anyio.Event, held: Future[None]) -> None:
    if loop.in_loop_thread():
        return
    try:
        loop.portal.call(stop.set)
        held.result(timeout=10)
    except Exception:  # noqa: BLE001 - closing: the loop is stopped below regardless
        pass
    loop.close()


class Client:
    """A synchronous client of a running engine (see `connect`); also the base of
    `rl.Engine`. The same calls as `AsyncClient`, blocking; programs run on it."""

    def __init__(
        self,
        endpoint: str,
        *,
        name: str = "radixlm-python",
        connect_timeout: float = 30.0,
        heartbeat_timeout: float = 30.0,
        liveness: Liveness | None = None,
        server_key: str | os.PathLike[str] | None = None,
        client_key: str | os.PathLike[str] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._loop = LoopThread("radixlm-client")
        self.aclient = AsyncClient(endpoint, name=name, connect_timeout=connect_timeout,
                                   heartbeat_timeout=heartbeat_timeout, liveness=liveness,
                                   server_key=server_key, client_key=client_key)
        try:
            held, stop = self._loop.portal.start_task(_hold_client, self.aclient)
        except BaseException:
            self._loop.close()
            raise
        self._finalizer = weakref.finalize(self, _close_client, self._loop, stop, held)

    # -- plumbing -------------------------------------------------------------------------

    @property
    def portal(self) -> BlockingPortal:
        return self._loop.portal

    @property
    def loop(self) -> LoopThread:
        return self._loop

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._loop.call(partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Close the connection and stop the client's thread (idempotent)."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        """False once the engine was found dead or the client closed."""
        return not self.closed and self.aclient.alive

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- engine facts ---------------------------------------------------------------------

    @property
    def model(self) -> str:
        return self.aclient.model

    @property
    def context_length(self) -> int:
        return self.aclient.context_length

    @property
    def page_size(self) -> int:
        return self.aclient.page_size

    @property
    def kv_capacity(self) -> int:
        return self.aclient.kv_capacity

    # -- calls ----------------------------------------------------------------------------

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Any:
        """See `AsyncClient.generate`."""
        return self._call(self.aclient.generate, prompt, **kwargs)

    def stream(self, prompt: str | None = None, **kwargs: Any) -> SyncTextStream:
        """See `AsyncClient.stream`; iterate the result for `StreamDelta`s."""
        return SyncTextStream(self._loop, self.aclient.stream(prompt, **kwargs))

    def tokenize(self, prompt: str | None = None, **kwargs: Any) -> list[int]:
        return self._call(self.aclient.tokenize, prompt, **kwargs)

    def open_session(self, prompt: str | None = None, **kwargs: Any) -> SessionOpened:
        return self._call(self.aclient.open_session, prompt, **kwargs)

    def fork_session(self, session: str, n: int = 1) -> list[str]:
        return self._call(self.aclient.fork_session, session, n)

    def truncate_session(self, session: str, length: int) -> None:
        self._call(self.aclient.truncate_session, session, length)

    def close_session(self, session: str) -> None:
        self._call(self.aclient.close_session, session)

    def list_sessions(self) -> list[dict[str, Any]]:
        return self._call(self.aclient.list_sessions)

    def pin(self, name: str, prompt: str | None = None, **kwargs: Any) -> int:
        return self._call(self.aclient.pin, name, prompt, **kwargs)

    def unpin(self, name: str) -> None:
        self._call(self.aclient.unpin, name)

    def stats(self) -> dict[str, Any]:
        return self._call(self.aclient.stats)

    def flush_cache(self) -> None:
        self._call(self.aclient.flush_cache)

    def session(
        self,
        system: str | None = None,
        *,
        pin: str | None = None,
        retention: Retention = "hard",
        ttl_s: float | None = None,
        namespace: str | None = None,
        **sampling: Any,
    ) -> ChatSession:
        """A chat session: ``with engine.session(system=...) as chat: chat.send(...)``."""
        return ChatSession(self._loop, self.aclient.session(
            system, pin=pin, retention=retention, ttl_s=ttl_s, namespace=namespace, **sampling
        ))


async def _next_or_end(stream: TextStream) -> tuple[bool, StreamDelta | None]:
    try:
        return True, await stream.__anext__()
    except StopAsyncIteration:
        return False, None


class SyncTextStream:
    """A streamed generation for synchronous code: iterate it; ``result`` at the end.
    Leaving early (``break`` inside ``with``, or ``close()``) aborts the generation."""

    def __init__(self, loop: LoopThread, stream: TextStream) -> None:
        self._loop = loop
        self._stream = stream
        self._done = False

    def __iter__(self) -> Iterator[StreamDelta]:
        return self

    def __next__(self) -> StreamDelta:
        if self._done:
            raise StopIteration
        more, delta = self._loop.call(_next_or_end, self._stream)
        if not more:
            self._done = True
            raise StopIteration
        assert delta is not None
        return delta

    @property
    def result(self) -> GenerateResult:
        return self._stream.result

    @property
    def results(self) -> list[GenerateResult]:
        return self._stream.results

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._loop.call(self._stream.aclose)

    def __enter__(self) -> SyncTextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._done and not self._loop.in_loop_thread():
            with contextlib.suppress(Exception):  # best effort at garbage collection
                self.close()


class ChatSession:
    """The synchronous face of `AsyncChatSession` (``with engine.session() as chat``)."""

    def __init__(self, loop: LoopThread, chat: AsyncChatSession) -> None:
        self._loop = loop
        self._chat = chat

    @property
    def id(self) -> str | None:
        return self._chat.id

    @property
    def history(self) -> list[dict[str, str]]:
        return self._chat.history

    @property
    def length(self) -> int:
        return self._chat.length

    def open(self) -> ChatSession:
        self._loop.call(self._chat.open)
        return self

    def close(self) -> None:
        self._loop.call(self._chat.close)

    def __enter__(self) -> ChatSession:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, content: str, *, role: str = "user", **sampling: Any) -> GenerateResult:
        return self._loop.call(partial(self._chat.send, content, role=role, **sampling))

    def stream(self, content: str, *, role: str = "user", **sampling: Any) -> SyncTextStream:
        return SyncTextStream(self._loop, self._chat.stream(content, role=role, **sampling))

    def fork(self, n: int = 1) -> list[ChatSession]:
        children = self._loop.call(self._chat.fork, n)
        return [ChatSession(self._loop, c) for c in children]


def connect(
    endpoint: str,
    *,
    connect_timeout: float = 30.0,
    heartbeat_timeout: float = 30.0,
    name: str = "radixlm-python",
    server_key: str | os.PathLike[str] | None = None,
    client_key: str | os.PathLike[str] | None = None,
) -> Client:
    """Attach to a running engine (``radixlm serve``) at `endpoint`; a synchronous `Client`.
    For async code use ``async with rl.AsyncClient(endpoint) as client``. For a server
    started with ``--auth-dir DIR``: ``server_key="DIR/server.key"``,
    ``client_key="DIR/clients/NAME.key_secret"`` (CurveZMQ, over pyzmq's libzmq socket)."""
    if endpoint.startswith(("http://", "https://")):
        raise ValueError(
            f"radixlm engines speak ZeroMQ, not HTTP: pass the endpoint `radixlm serve` "
            f"printed (ipc://... or tcp://HOST:PORT), not {endpoint!r}"
        )
    return Client(endpoint, connect_timeout=connect_timeout,
                  heartbeat_timeout=heartbeat_timeout, name=name, server_key=server_key,
                  client_key=client_key)
