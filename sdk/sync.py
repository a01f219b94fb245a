"""The synchronous API: `Client` (``rl.connect``), `ChatSession`, `SyncTextStream`.

A `Client` runs one event loop in one daemon thread and drives an `AsyncClient` in it
through a `LoopThread`: every sync call is one hop into that loop, and every
program run on the client executes there as anyio tasks -- one thread per client, never
one per program. The thread is a daemon so that a client nobody closed cannot hang
interpreter exit; a ``weakref.finalize`` (which also runs at exit) closes it cleanly.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from anyio.from_thread import BlockingPortal
from radixlm.runtime.protocol import Welcome
from radixlm.sdk.chat import AsyncChatSession
from radixlm.sdk.client import AsyncClient, EngineFacts
from radixlm.sdk.errors import EngineDeadError
from radixlm.sdk.loop_thread import LoopThread
from radixlm.sdk.results import GenerateResult, StreamDelta
from radixlm.sdk.signatures import blocking, constructor_parameters, facing, same_parameters
from radixlm.sdk.text_stream import TextStream

if TYPE_CHECKING:
    from radixlm.sdk.options import TurnOptions
    from typing_extensions import Unpack

__all__ = ["ChatSession", "Client", "SyncTextStream", "connect"]


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


class SyncTextStream:
    """A streamed generation for synchronous code: iterate it; ``result`` at the end.
    Leaving early (``break`` inside ``with``, or ``close()``) aborts the generation."""

    def __init__(self, loop: LoopThread, stream: TextStream) -> None:
        self._loop = loop
        self._stream = stream
        self._pump = loop.iterate(stream)
        self._done = False

    def __iter__(self) -> Iterator[StreamDelta]:
        return self

    def __next__(self) -> StreamDelta:
        if self._done:
            raise StopIteration
        try:
            more, delta = self._pump.take()
        except BaseException:
            self._done = True
            raise
        if not more:
            self._done = True
            raise StopIteration
        assert delta is not None
        return delta

    @property
    def result(self) -> GenerateResult:
        """The finished generation (branch 0), once the stream ended."""
        return self._stream.result

    @property
    def results(self) -> list[GenerateResult]:
        """Every branch's finished generation, by branch index."""
        return self._stream.results

    def close(self) -> None:
        """Stop the stream: a generation still running is aborted in the engine."""
        if not self._done:
            self._done = True
            self._pump.close()  # (the stream aborts and closes as its task is cancelled)

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
        """The engine session's id (None until opened, and after closing)."""
        return self._chat.id

    @property
    def history(self) -> list[dict[str, str]]:
        """The conversation so far, as role/content dicts."""
        return self._chat.history

    @property
    def length(self) -> int:
        """Tokens of history the engine holds for this session."""
        return self._chat.length

    @property
    def durable(self) -> bool:
        """Whether it outlives this client (then ``with`` leaves it open for `resume`)."""
        return self._chat.durable

    def open(self) -> ChatSession:
        """Open the engine session (``with`` does it); returns this chat."""
        self._loop.call(self._chat.open)
        return self

    def close(self) -> None:
        """Close this session and every session forked from it (idempotent)."""
        self._loop.call(self._chat.close)

    def __enter__(self) -> ChatSession:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self._loop.call(self._chat.__aexit__, *exc)  # (a durable session stays open)

    send = blocking(AsyncChatSession.send, "_chat")
    tool_done_soon = blocking(AsyncChatSession.tool_done_soon, "_chat")
    stream = facing(AsyncChatSession.stream, "_chat", SyncTextStream)

    def fork(self, n: int = 1) -> list[ChatSession]:
        """`n` sessions continuing this conversation independently (closed with this one)."""
        children = self._loop.call(self._chat.fork, n)
        return [ChatSession(self._loop, c) for c in children]


class EndpointAddress(str):
    """A client's engine address: a plain string wherever one is expected, and also what
    SGLang programs reach through ``runtime.endpoint`` (``get_model_name()``,
    ``get_server_info()``, ``flush_cache()``, ``cache_prefix(text)``: the client's)."""

    __slots__ = ("_client",)

    def __new__(cls, address: str, client: Client) -> EndpointAddress:
        self = super().__new__(cls, address)
        self._client = weakref.ref(client)
        return self

    def _of(self) -> Client:
        client = self._client()
        if client is None:
            raise EngineDeadError(f"the client of {str(self)} is gone")
        return client

    def get_model_name(self) -> str:
        return self._of().get_model_name()

    def get_server_info(self) -> dict[str, Any]:
        return self._of().get_server_info()

    def flush_cache(self) -> None:
        self._of().flush_cache()

    def cache_prefix(self, prefix: str) -> None:
        self._of().cache_prefix(prefix)


class Client(EngineFacts):
    """A synchronous client of a running engine (see `connect`); also the base of
    `rl.Engine`. The same calls as `AsyncClient`, blocking; programs run on it."""

    @same_parameters(AsyncClient.__init__)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.aclient = AsyncClient(*args, **kwargs)
        self.endpoint = EndpointAddress(self.aclient.endpoint, self)
        self._loop = LoopThread("radixlm-client")
        try:
            held, stop = self._loop.portal.start_task(_hold_client, self.aclient)
        except BaseException:
            self._loop.close()
            raise
        self._finalizer = weakref.finalize(self, _close_client, self._loop, stop, held)

    # -- plumbing -------------------------------------------------------------------------

    @property
    def portal(self) -> BlockingPortal:
        """The anyio portal into the client's event loop (for code that needs one)."""
        return self._loop.portal

    @property
    def loop(self) -> LoopThread:
        """The event loop thread this client (and programs run on it) uses."""
        return self._loop

    def close(self) -> None:
        """Close the connection and stop the client's thread (idempotent)."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        """False once the engine was found dead or the client closed."""
        return not self.closed and self.aclient.alive

    @property
    def closed(self) -> bool:
        """Whether `close` was called (or the client was garbage collected)."""
        return not self._finalizer.alive

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _welcome(self) -> Welcome:
        return self.aclient._welcome()

    # -- SGLang's backend calls ----------------------------------------------------------

    def get_server_info(self) -> dict[str, Any]:
        """What the engine said about itself (its model, version, sizes) and its stats
        (``internal_states``), as SGLang's ``get_server_info`` gives them."""
        w = self._welcome()
        return {"model_path": w.model, "version": w.server_version,
                "protocol_version": w.protocol_version, "context_length": w.context_length,
                "page_size": w.page_size, "kv_capacity": w.kv_capacity,
                "max_message_bytes": w.max_message_bytes, "endpoint": str(self.endpoint),
                "internal_states": [self.stats()]}

    def cache_prefix(self, prefix: str) -> None:
        """Prefill `prefix` into the prefix cache (SGLang's ``cache_prefix``: nothing is
        generated; it stays cached until evicted, like any other prefix)."""
        self.generate(prefix, max_tokens=0)

    # -- calls: `AsyncClient`'s, blocking --------------------------------------------------

    generate = blocking(AsyncClient.generate, "aclient")
    tokenize = blocking(AsyncClient.tokenize, "aclient")
    open_session = blocking(AsyncClient.open_session, "aclient")
    fork_session = blocking(AsyncClient.fork_session, "aclient")
    truncate_session = blocking(AsyncClient.truncate_session, "aclient")
    close_session = blocking(AsyncClient.close_session, "aclient")
    list_sessions = blocking(AsyncClient.list_sessions, "aclient")
    pin = blocking(AsyncClient.pin, "aclient")
    unpin = blocking(AsyncClient.unpin, "aclient")
    stats = blocking(AsyncClient.stats, "aclient")
    flush_cache = blocking(AsyncClient.flush_cache, "aclient")
    resume_session = blocking(AsyncClient.resume_session, "aclient")
    stream = facing(AsyncClient.stream, "aclient", SyncTextStream)
    session = facing(AsyncClient.session, "aclient", ChatSession)

    def resume(self, session: str, **sampling: Unpack[TurnOptions]) -> ChatSession:
        """A durable chat session back by its id (`AsyncClient.resume`)."""
        return ChatSession(self._loop, self._loop.call(partial(self.aclient.resume, session,
                                                               **sampling)))


@constructor_parameters(AsyncClient)
def connect(*args: Any, **kwargs: Any) -> Client:
    """Attach to a running engine (``radixlm serve``) at `endpoint` (``ipc://PATH`` or
    ``tcp://HOST:PORT``, as the server printed it; none: ``$RADIXLM_ENDPOINT``, else this
    user's default server); a synchronous `Client`. Nothing listening there raises
    `NoServerError` at once. For async code
    use ``async with rl.AsyncClient(endpoint) as client``. For a server started with
    ``--auth-dir DIR``: ``server_key="DIR/server.key"``,
    ``client_key="DIR/clients/NAME.key_secret"`` (CurveZMQ, over pyzmq's libzmq socket)."""
    return Client(*args, **kwargs)
