"""`AsyncClient`: the async API over one engine connection.

    async with rl.AsyncClient(endpoint) as client:
        result = await client.generate("The capital of France is", max_tokens=8)
        async with client.stream("Once upon a time", max_tokens=32) as stream:
            async for delta in stream:
                print(delta.text, end="")
        async with client.session(system="Be brief.") as chat:
            reply = await chat.send("Hi!")

The client owns a task group (its reader and monitor tasks) for as long as it is open,
and must be used from the event loop that opened it. `rl.Engine` / `rl.connect` give the
same API synchronously.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import anyio
import msgspec
from radixlm.runtime.protocol import (
    CloseSession,
    Done,
    Generate,
    Input,
    Ok,
    Retention,
    SamplingParams,
    SessionOpened,
    Struct,
    Welcome,
)
from radixlm.runtime.transport.client import ProtocolClient
from radixlm.runtime.transport.connection import Connection, Liveness, Request
from radixlm.runtime.transport.curve import load_curve_keys
from radixlm.runtime.transport.discovery import client_endpoint, find_server
from radixlm.runtime.transport.mailbox import Waiter
from radixlm.sdk.errors import InvalidParamsError, ProgramError
from radixlm.sdk.loop_entry import LoopEntry
from radixlm.sdk.options import SamplingOptions, TurnOptions, sampling_params
from radixlm.sdk.reconnect import NOT_CONNECTED, Reconnect
from radixlm.sdk.results import result_from_done, to_messages
from radixlm.sdk.signatures import same_parameters
from radixlm.sdk.structured import pop_tool_options
from radixlm.sdk.text_stream import TextStream

if TYPE_CHECKING:
    from radixlm.sdk.chat import AsyncChatSession
    from typing_extensions import Unpack

__all__ = ["AsyncClient", "EngineFacts", "TextStream", "make_input"]

R = TypeVar("R")
T = TypeVar("T")


def make_input(
    prompt: str | None = None,
    input_ids: Sequence[int] | None = None,
    messages: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> Input:
    """An `Input` from exactly one of a text prompt, token ids or chat messages."""
    if prompt is not None and input_ids is None and messages is None:
        return Input(text=prompt)  # the usual case, without the checks below
    given = [name for name, v in (("prompt", prompt), ("input_ids", input_ids),
                                  ("messages", messages)) if v is not None]
    if len(given) != 1:
        raise InvalidParamsError(
            f"give exactly one of prompt, input_ids, messages (got {given or 'none'})"
        )
    if prompt is not None:
        return Input(text=prompt)
    if input_ids is not None:
        return Input(input_ids=list(input_ids))
    return Input(messages=to_messages(messages), add_generation_prompt=add_generation_prompt)


class _Read(Generic[T]):
    """A read-only attribute of a client, read from one of its parts: ``source(client)``'s
    attribute `field` (by default, the attribute's own name)."""

    def __init__(self, source: Callable[[Any], Any], doc: str, field: str = "") -> None:
        self.source, self.field, self.__doc__ = source, field, doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = self.field or name

    @overload
    def __get__(self, client: None, owner: type) -> _Read[T]: ...
    @overload
    def __get__(self, client: object, owner: type) -> T: ...

    def __get__(self, client: object, owner: type) -> Any:
        return self if client is None else getattr(self.source(client), self.field)


def _welcome_of(client: EngineFacts) -> Welcome:
    return client._welcome()


def _connection_of(client: AsyncClient) -> Connection:
    return client._conn


class EngineFacts:
    """What the engine said about itself when the client connected (its ``Welcome``)."""

    model = _Read[str](_welcome_of, "The model the engine serves (its name or path).")
    context_length = _Read[int](
        _welcome_of, "The most tokens one sequence may hold (prompt, history and output).")
    page_size = _Read[int](
        _welcome_of, "Tokens per KV page: the cache keeps and shares whole pages.")
    kv_capacity = _Read[int](_welcome_of, "The KV pool's size in tokens.")
    server_version = _Read[str](_welcome_of, "The engine's radixlm version.")
    state = _Read[str](_welcome_of, "The server's state key (its model fingerprint): sessions "
                                     "opened with ``durable=True`` outlive disconnects and "
                                     "restarts; \"\" when it keeps no state.")

    def get_model_name(self) -> str:
        """The model the engine serves (SGLang's ``RuntimeEndpoint.get_model_name``)."""
        return self.model

    def _welcome(self) -> Welcome:
        raise NotImplementedError


def _wrong_loop() -> ProgramError:
    return ProgramError(
        "this AsyncClient belongs to another event loop (or is not open): use it from "
        "the loop that opened it, or use the synchronous handle's methods"
    )


class AsyncClient(EngineFacts):
    """An async client of one radixlm engine (one DEALER socket, one reader task).

    `endpoint`: the engine's client endpoint (``ipc://...`` or ``tcp://host:port``);
    None: ``$RADIXLM_ENDPOINT``, else this user's default server (``radixlm serve``
    without ``--endpoint``). Nothing listening there is `NoServerError` at once.
    `connect_timeout`: how long to wait for the engine's Welcome (a new engine may still
    be loading its model). `heartbeat_timeout`: a call fails with `EngineDeadError` once
    the server's frontend has been silent this long while requests wait (the frontend
    answers pings even while the engine is busy; an engine that stopped answering fails
    requests with `EngineUnavailableError` after the server's ``--engine-timeout``).
    `server_key`, `client_key`: CurveZMQ certificate files for a server started with
    ``--auth-dir`` (its ``server.key``; this client's ``NAME.key_secret``); with keys the
    connection uses pyzmq's libzmq socket, which does CURVE.

    Reconnecting (reconnect.py): a connection the server dropped (a frontend restarted
    by `radixlm serve`) fails the requests in flight with `EngineDeadError`; the next call
    connects again (within `connect_timeout`) and resumes every durable session this
    client holds (``durable=True``: they outlive disconnects and restarts). After an
    engine restart, a turn, fork or close naming one of them resumes them all and is sent
    once more.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        name: str = "radixlm-python",
        connect_timeout: float = 30.0,
        heartbeat_timeout: float = 30.0,
        liveness: Liveness | None = None,
        server_key: str | os.PathLike[str] | None = None,
        client_key: str | os.PathLike[str] | None = None,
    ) -> None:
        endpoint, self._source = client_endpoint(endpoint)
        self.endpoint = endpoint
        # A server this client did not start is looked for before waiting for it (one
        # with a `liveness` hook is being started by the caller, and may not listen yet).
        self._probe = liveness is None
        new_core = partial(ProtocolClient, endpoint, client_name=name,
                           heartbeat_timeout=heartbeat_timeout, liveness=liveness,
                           curve=load_curve_keys(server_key, client_key),
                           wrong_loop=_wrong_loop)
        self._use(new_core())
        self._reconnect = Reconnect(endpoint, new_core, lambda: self._core, self._use,
                                    connect_timeout, liveness)
        self._connect_timeout = connect_timeout
        self._stack: AsyncExitStack | None = None
        self._loop = LoopEntry(NOT_CONNECTED)  # the loop it was opened on, for `post`

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncClient:
        if self._probe:
            await self._find_server()
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            stack.callback(lambda: self._core.close())  # (the core of the moment)
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)
            self._reconnect.start(tg)
            self._loop.bind()
            await self._core.open(tg, self._connect_timeout)
        except BaseException:
            # Unwind without handing the error to the task group (which would wrap it in
            # an ExceptionGroup): the caller gets the typed error itself.
            await stack.aclose()
            raise
        self._stack = stack
        return self

    async def _find_server(self) -> None:
        """Raise `NoServerError` at once when nothing listens at the endpoint."""
        given = self.endpoint if self._source == "given" else None
        await anyio.to_thread.run_sync(partial(find_server, given, flag='rl.connect("ENDPOINT")'))

    async def __aexit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.__aexit__(*exc)

    def _use(self, core: ProtocolClient) -> None:
        self._core = core
        self._conn = core.conn
        self._new_rid = core.rids.new

    # -- engine facts (`EngineFacts`, from the Welcome) ------------------------------------

    def _welcome(self) -> Welcome:
        if self._conn.welcome is None:
            raise ProgramError(NOT_CONNECTED)
        return self._conn.welcome

    # -- the connection's counters ----------------------------------------------------------

    alive = _Read[bool](_connection_of, "False once the engine was found dead or the client "
                                        "closed.")
    in_flight = _Read[int](_connection_of, "Requests waiting for replies now.")
    messages_sent = _Read[int](
        _connection_of, "Messages this client has sent (requests, aborts, heartbeat pings).",
        "sent")
    peak_generating = _Read[int](_connection_of,
                                 "The most generations this client had in flight at once.")

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def new_waiter(self) -> Callable[[], Waiter]:
        """Makes waiters for this client's event loop (see `radixlm.runtime.transport.mailbox`)."""
        return self._conn.new_waiter

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in this client's event loop soon, from another thread; on
        asyncio without waiting for it (one wake-up of the loop, not a round trip)."""
        self._loop.post(fn, *args)

    def cork(self) -> None:
        """Batch the requests sent until the callbacks already scheduled in the loop have
        run into one write (call it right after starting tasks that each send one)."""
        self._conn.cork()

    def new_rid(self) -> str:
        """A request id unused by this client (hex counter)."""
        return self._new_rid()

    def request(self, msg: Struct) -> Request:
        """Send one protocol request (a message with a ``rid``, e.g. from
        `generate_message`) and return its in-flight `Request`, for callers that read the
        replies themselves (programs, custom streaming).

        ``await req.receive()`` returns the replies in order until ``req.finished``: for a
        ``Generate``, a ``Chunk`` per streamed delta and one ``Done`` per branch (all of
        them, aborted branches' too, also in ``req.dones``); for any other request, its one
        answer. An ``Error`` reply raises its typed `EngineError`. Use the request as an
        async context manager (or ``await req.aclose()``): leaving it before it finished
        aborts a generation in the engine. `generate`, `stream`, `call` and `run_generate`
        cover the usual cases."""
        return self._core.request(msg)

    # `call` and `run_generate` hand back the core's coroutine itself (awaited by the
    # caller): one coroutine per request on the programs' hot path, not two. A dropped
    # connection, or durable sessions held, go through `Reconnect.send`.

    def call(self, msg: Struct, expect: type[R]) -> Coroutine[Any, Any, R]:
        """Send a request that has exactly one answer and return it (typed errors raise;
        await it)."""
        if self._conn.alive and not self._reconnect.durable:
            return self._core.call(msg, expect)
        return self._reconnect.send(msg, lambda: self._core.call(msg, expect))

    def run_generate(self, msg: Generate) -> Coroutine[Any, Any, list[Done]]:
        """Send a Generate and collect one Done per branch (sorted by branch index; await
        it)."""
        if self._conn.alive and not self._reconnect.durable:
            return self._core.run_generate(msg)
        return self._reconnect.send(msg, lambda: self._core.run_generate(msg))

    def generate_message(
        self, inp: Input, sampling: Mapping[str, Any] | SamplingParams, **fields: Any
    ) -> Generate:
        """A `Generate` with a new rid; `fields` are its other fields (``session``, ``n``,
        ``stream``...). `sampling`: a `SamplingParams` or keyword sampling options."""
        if not isinstance(sampling, SamplingParams):
            options = dict(sampling)
            fields.update(pop_tool_options(options))  # tools travel with the keywords
            sampling = sampling_params(options)
        return Generate(rid=self.new_rid(), input=inp, sampling=sampling, **fields)

    def _message(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        session: str | None = None,
        n: int = 1,
        namespace: str | None = None,
        priority: int = 0,
        prompt_logprobs_start: int | None = None,
        **sampling: Unpack[SamplingOptions],
    ) -> Generate:
        """The `Generate` that `generate` and `stream` send (they take these parameters)."""
        return self.generate_message(
            make_input(prompt, input_ids, messages, add_generation_prompt), sampling,
            session=session, n=n, namespace=namespace, priority=priority,
            prompt_logprobs_start=prompt_logprobs_start,
        )

    # -- generation -------------------------------------------------------------------------

    @same_parameters(_message)
    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Generate from a text prompt (`prompt`), token ids (`input_ids`) or chat
        `messages`; with `session`, the input is appended to that session's history.

        ``n > 1`` samples n branches from one prefill; `namespace` salts the cache keys;
        higher `priority` is scheduled first; `prompt_logprobs_start` asks for the
        logprobs of the input from that position on. Sampling options are `SamplingParams`
        fields (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``stop``,
        ``stop_token_ids``, ``ignore_eos``, penalties, ``seed``, ``logprobs``..., and one of
        ``regex``, ``json_schema`` (JSON text, dict or pydantic model class) or ``ebnf``)
        or SGLang's names for them (``max_new_tokens``, ``return_logprob``,
        ``top_logprobs_num``), plus ``tools`` and ``tool_choice`` (then
        ``result.tool_calls`` holds the parsed calls).
        Returns a `GenerateResult`, or a list of them (one per branch) when ``n > 1``.
        """
        msg = self._message(*args, **kwargs)
        start = time.perf_counter()
        dones = await self.run_generate(msg)
        latency = time.perf_counter() - start
        results = [result_from_done(d, latency) for d in dones]
        return results[0] if msg.n == 1 else results

    @same_parameters(_message)
    def stream(self, *args: Any, **kwargs: Any) -> TextStream:
        """Like `generate`, but yields `StreamDelta`s as the engine produces them."""
        msg = self._message(*args, **kwargs)
        msg.stream = True
        return TextStream(self, msg)

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The token ids the engine would use for this input as a fresh prompt."""
        return await self._core.tokenize(
            make_input(prompt, input_ids, messages, add_generation_prompt))

    # -- sessions and pins -------------------------------------------------------------------

    async def open_session(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Any] | None = None,
        add_generation_prompt: bool = False,
        pin: str | None = None,
        retention: Retention = "hard",
        ttl_s: float | None = None,
        namespace: str | None = None,
        durable: bool = False,
    ) -> SessionOpened:
        """Open an engine session (empty, from an input prefilled now, and/or from a pin).
        `durable`: it outlives this connection and restarts of the server (one with a
        state directory: ``state``); the reply's ``durable`` says whether it does."""
        inp = None
        if prompt is not None or input_ids is not None or messages is not None:
            inp = make_input(prompt, input_ids, messages, add_generation_prompt)
        if self._reconnect.dropped:
            await self._reconnect.recover()
        opened = await self._core.open_session(inp, pinned=pin, retention=retention,
                                               ttl_s=ttl_s, namespace=namespace,
                                               durable=durable)
        if opened.durable:
            self._reconnect.durable.add(opened.session)
        return opened

    async def resume_session(self, session: str) -> SessionOpened:
        """Take a durable session (opened by this or another connection of this tenant,
        before a disconnect or a restart) as this client's own: `SessionOpened`, its
        ``length`` the history's; `NotFoundError` for an id that is not a durable session
        of this tenant."""
        if self._reconnect.dropped:
            await self._reconnect.recover()
        opened = await self._core.resume_session(session)
        self._reconnect.durable.add(opened.session)
        return opened

    async def fork_session(self, session: str, n: int = 1) -> list[str]:
        """`n` new sessions sharing `session`'s history (nothing is copied or recomputed)."""
        return (await self._core.fork_session(session, n)).sessions

    async def truncate_session(self, session: str, length: int) -> None:
        """Cut `session`'s history back to its first `length` tokens."""
        await self._core.truncate_session(session, length)

    async def close_session(self, session: str) -> None:
        """Close `session`: its history goes back to the ordinary cache."""
        await self.call(CloseSession(rid=self.new_rid(), session=session), Ok)
        self._reconnect.durable.discard(session)

    def close_session_unawaited(self, session: str) -> None:
        """Close a session without waiting for the engine's answer (it handles this
        client's requests in order, so later requests already see it closed; nothing is
        sent once the engine is dead: its sessions went with it)."""
        self._reconnect.durable.discard(session)
        self._core.close_sessions_unawaited([session])

    async def list_sessions(self) -> list[dict[str, Any]]:
        """This client's open sessions (id, length, idle time, retention, busy)."""
        return [msgspec.structs.asdict(s) for s in await self._core.list_sessions()]

    async def pin(
        self,
        name: str,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Any] | None = None,
        namespace: str | None = None,
    ) -> int:
        """Prefill and hold a named prefix (a system or tool prompt) that sessions and
        programs can start from (``pin=name``). Returns its length in tokens."""
        inp = make_input(prompt, input_ids, messages, add_generation_prompt=False)
        return await self._core.pin(name, inp, namespace)

    async def unpin(self, name: str) -> None:
        """Release the pinned prefix `name` (sessions started from it keep theirs)."""
        await self._core.unpin(name)

    def session(
        self,
        system: str | None = None,
        *,
        pin: str | None = None,
        retention: Retention = "hard",
        ttl_s: float | None = None,
        namespace: str | None = None,
        durable: bool = False,
        **sampling: Unpack[SamplingOptions],
    ) -> AsyncChatSession:
        """A chat session (``async with client.session(...) as chat``); `sampling` are the
        defaults of its sends. `durable`: it outlives this client (``chat.id`` names it to
        `resume`); its ``with`` block then leaves it open, held for a later resume."""
        from radixlm.sdk.chat import AsyncChatSession

        return AsyncChatSession(self, system=system, pin=pin, retention=retention,
                                ttl_s=ttl_s, namespace=namespace, sampling=sampling,
                                durable=durable)

    async def resume(self, session: str, **sampling: Unpack[TurnOptions]) -> AsyncChatSession:
        """A durable chat session back (after this or another process disconnected, or
        the server restarted), by its id: ``chat = await client.resume(saved_id)``. Its
        ``history`` starts empty here (the engine holds the tokens); sends continue it."""
        from radixlm.sdk.chat import AsyncChatSession

        opened = await self.resume_session(session)
        return AsyncChatSession(self, sampling=sampling, durable=True, _session=opened.session,
                                _length=opened.length)

    # -- engine state -------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """The engine's `StatsReply` as a dict (cache sizes, sessions, token counters)."""
        out = msgspec.structs.asdict(await self._core.stats())
        out.pop("rid", None)
        return out

    async def flush_cache(self) -> None:
        """Evict everything evictable from the prefix cache; sessions and pins keep
        what they hold."""
        await self._core.flush_cache()
