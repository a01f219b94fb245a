"""``@rl.function`` programs and how they run.

    @rl.function
    def qa(s, question):
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", max_tokens=64))

    state = qa.run(question="Why is the sky blue?")           # sync
    state = await qa.arun(question="...")                      # async
    states = qa.run_batch([{"question": q} for q in qs], max_concurrency=16)

A program's body runs in the caller's thread (``run``, ``run_batch``) and only *appends*
operations; they execute as anyio tasks in the backend's event loop, concurrently across
states and programs, and the body blocks only when it reads a value that is not ready.
A body that reads generated values mid-way (``if s["x"] == ...``) holds ``run_batch``'s
thread while it waits; write it as ``async def`` (reading with ``await s.aget(...)``) to
run such programs fully concurrently. ``arun`` runs a plain ``def`` body in a worker
thread so that its reads never block the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import msgspec
from anyio.from_thread import BlockingPortal
from anyio.lowlevel import current_token
from radixlm.runtime.protocol import Input
from radixlm.sdk.backend import Backend, resolve_backend
from radixlm.sdk.client import AsyncClient
from radixlm.sdk.errors import DuplicateIdError, ProgramError, plain_errors
from radixlm.sdk.global_config import global_config
from radixlm.sdk.options import GEN_FIELDS, SAMPLING_FIELDS, unknown_keyword
from radixlm.sdk.prefix import CachedPrefix
from radixlm.sdk.run import ProgramRun, await_future
from radixlm.sdk.state import ProgramState
from radixlm.sdk.sync import Client
from radixlm.sdk.trace import TracedState, constant_prefix, trace

__all__ = ["Program", "function"]
_CANCEL_WAIT_S = 10.0
_PRECACHE_MIN_CHARS = 64  # SGLang precaches a batch's prefix only when it is longer


def _split(options: dict[str, Any], params: frozenset[str] = frozenset()
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(sampling defaults, program arguments) from a run's keyword arguments; a name the
    program itself declares (`params`) is always the program's."""
    def sampling_option(k: str) -> bool:
        return (k in SAMPLING_FIELDS or k in GEN_FIELDS) and k not in params

    sampling = {k: v for k, v in options.items() if sampling_option(k) and v is not None}
    return sampling, {k: v for k, v in options.items() if not sampling_option(k)}


def _batch_sampling(where: str, options: dict[str, Any]) -> dict[str, Any]:
    """A batch's keyword arguments, which are all sampling defaults (the programs'
    arguments are the batch items): an unknown one is an error naming `where`."""
    sampling, extra = _split(options)
    if extra:
        raise unknown_keyword(f"{where}()", sorted(extra)[0], SAMPLING_FIELDS | GEN_FIELDS)
    return sampling


def _wait(fut: Future[Any], run_cancel: Callable[[], None]) -> None:
    """Wait for a supervisor future; on Ctrl-C cancel it (aborting requests, closing
    sessions) and wait for that cleanup before re-raising."""
    try:
        fut.result()
    except BaseException:
        run_cancel()
        _settle(fut)
        raise


class Program:
    """A program (``@rl.function``): call `run`, `arun`, `run_batch` or `astream`.

    Keyword arguments of those calls that are sampling options (``max_new_tokens``,
    ``temperature``, ``stop``, ``top_p``...) become the defaults of every ``gen`` in the
    program; the rest are the program's arguments.
    """

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None):
        self.func = func
        self.is_async = inspect.iscoroutinefunction(func)
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"{self.__name__}: a program's first parameter is its state `s`")
        self.params = frozenset(p.name for p in params[1:])
        self.arg_names = [p.name for p in params[1:]
                          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        # A body taking **kwargs accepts any argument name; otherwise a run's unknown
        # keyword is the SDK's error, named before the body runs.
        self.any_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
        # The prefix `cache()` pinned, by the client it is pinned in.
        self._cached: weakref.WeakKeyDictionary[AsyncClient, CachedPrefix] = (
            weakref.WeakKeyDictionary())

    def _body_kwargs(self, where: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The body's keyword arguments: the bound ones updated with `kwargs` (the run's
        keywords that are not sampling options), each checked against the body's."""
        if not self.any_keyword:
            for key in kwargs:
                if key not in self.params:
                    raise unknown_keyword(f"{self.__name__}.{where}()", key,
                                          self.params | SAMPLING_FIELDS | GEN_FIELDS)
        return {**self.bind_arguments, **kwargs}

    def bind(self, **kwargs: Any) -> Program:
        """A copy with some arguments fixed."""
        if not self.any_keyword:
            for key in kwargs:
                if key not in self.params:
                    raise unknown_keyword(f"{self.__name__}.bind()", key, self.params)
        return Program(self.func, {**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Called with a state (a running or a traced one): a sub-program, inline.
        if args and isinstance(args[0], (ProgramState, TracedState)):
            return self.func(*args, **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)

    # -- tracing and the constant prefix ------------------------------------------------------

    def trace(self, *, backend: Backend | None = None, **kwargs: Any) -> TracedState:
        """Run the body against a recording state (nothing is sent): the expressions it
        appends are ``.nodes``; arguments not given are placeholders (`trace.Argument`),
        and values it reads are `trace.Variable`s. `backend` is accepted for SGLang."""
        return trace(self.func, self.arg_names, {**self.bind_arguments, **kwargs})

    def constant_prefix(self) -> Input | None:
        """The input every run of the program begins with, known without running it: the
        leading text, or the leading whole messages, before anything that depends on an
        argument or a generated value (None if there is none)."""
        if self.is_async:
            return None  # an async body cannot be traced without running it
        return constant_prefix(trace(self.func, self.arg_names, dict(self.bind_arguments),
                                     prefix_only=True))

    def cache(self, backend: Backend | None = None) -> str | None:
        """SGLang's ``program.cache()``: pin the program's constant prefix (see
        `constant_prefix`) in the engine, so that every later run on `backend` starts
        its session from the pin, and it is never evicted. Returns the pin's name (None:
        the program has no constant prefix); idempotent. ``client.unpin(name)`` ends it."""
        client = resolve_backend(backend)
        if isinstance(client, AsyncClient):
            raise ProgramError("cache() needs a synchronous backend (rl.Engine, rl.connect)")
        prefix = self.constant_prefix()
        if prefix is None:
            return None
        key = repr((self.func.__module__, self.func.__qualname__, msgspec.json.encode(prefix)))
        name = f"rl.cache:{self.__name__}:{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        with contextlib.suppress(DuplicateIdError):  # pinned already: cache() again
            client.pin(name, prefix.text, messages=prefix.messages)
        self._cached[client.aclient] = CachedPrefix(name, prefix)
        return name

    def _precache(self, client: Client) -> None:
        """SGLang's run_batch precache: prefill the constant prefix once, so that every
        program of the batch finds it in the cache (``global_config`` switches it)."""
        if client.aclient in self._cached:
            return  # pinned: better than cached
        try:
            prefix = self.constant_prefix()
        except Exception:  # noqa: BLE001 - the body failed on placeholders: no precache
            return
        if prefix is None:
            return
        chars = len(prefix.text or "") + sum(len(m.content or "") for m in prefix.messages or [])
        if chars > _PRECACHE_MIN_CHARS:
            client.generate(prefix.text, messages=prefix.messages, add_generation_prompt=False,
                            max_tokens=0)

    def _new_run(self, client: AsyncClient, sampling: dict[str, Any], *, stream: bool,
                 pin: str | None, namespace: str | None, loop_thread: int, token: Any,
                 portal: BlockingPortal | None) -> ProgramRun:
        cached = self._cached.get(client) if namespace is None else None
        if cached is not None and cached.gone:
            self._cached.pop(client, None)
            cached = None
        return ProgramRun(client, defaults=sampling, stream=stream, pin=pin, namespace=namespace,
                          loop_thread=loop_thread, token=token, portal=portal,
                          cached_prefix=cached)

    def _sync_run(self, client: Client, sampling: dict[str, Any], stream: bool,
                  pin: str | None, namespace: str | None) -> ProgramRun:
        loop = client.loop
        return self._new_run(client.aclient, sampling, stream=stream, pin=pin,
                             namespace=namespace, loop_thread=loop.thread_id, token=loop.token,
                             portal=loop.portal)

    # -- sync ---------------------------------------------------------------------------------

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False,
            pin: str | None = None, namespace: str | None = None, use_thread: bool = True,
            **kwargs: Any) -> ProgramState:
        """Run the program and return its state once it finished (with ``stream=True``, at
        once: read it with ``state.text_iter(name)``). Engine errors raise.

        `pin`: start the program's session from this pinned prefix (see ``client.pin``);
        `namespace`: the cache namespace of its sessions. `use_thread` is SGLang's: its
        programs run in a thread of their own, or not; here every program runs as tasks
        in the backend's event loop either way, and the body in the caller's thread."""
        client = resolve_backend(backend)
        sampling, kwargs = _split(kwargs, self.params)
        kwargs = self._body_kwargs("run", kwargs)
        if isinstance(client, AsyncClient):
            raise ProgramError("run() needs a synchronous backend (rl.Engine, rl.connect); "
                               "with an AsyncClient use `await program.arun(...)`")
        if self.is_async:
            state = client.loop.call(partial(
                self.arun, *args, backend=client.aclient, pin=pin, namespace=namespace,
                _portal=client.portal, **sampling, **kwargs))
            _report(state)
            return state  # type: ignore[no-any-return]
        run = self._sync_run(client, sampling, stream, pin, namespace)
        run.spawn = client.loop.spawn  # at the body's first commit
        self._run_body(run, args, kwargs)
        if stream:
            return run.root
        assert run.future is not None  # the body's final commit started the supervisor
        _wait(run.future, run.cancel)
        error = run.first_error()
        if error is not None:
            raise error
        _report(run.root)
        return run.root

    def _run_body(self, run: ProgramRun, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        try:
            run.root.ret_value = self.func(run.root, *args, **kwargs)
        except BaseException as e:
            run.body_error = e
            run.cancel()
            run.commit(final=True)
            if run.future is not None:
                _settle(run.future)
            raise
        run.commit(final=True)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        backend: Backend | None = None,
        max_concurrency: int | None = None,
        num_threads: int | str | None = None,
        progress_bar: bool = False,
        generator_style: bool = False,
        pin: str | None = None,
        namespace: str | None = None,
        **sampling: Any,
    ) -> Any:
        """Run the program once per argument dict (or tuple of positional arguments),
        concurrently (anyio tasks in the backend's loop, at most `max_concurrency`
        programs at a time; SGLang's `num_threads` is read as that limit, ``"auto"``:
        none). Returns the states in order; a program that failed raises its error when
        its state is read (``state.error()`` returns it). With `generator_style`, an
        iterator that yields each state, in order, once it finished (the batch starts
        when it is first iterated)."""
        client = resolve_backend(backend)
        if isinstance(client, AsyncClient):
            raise ProgramError("run_batch() needs a synchronous backend; with an AsyncClient "
                               "use `await program.arun_batch(...)`")
        if max_concurrency is None and isinstance(num_threads, int):
            max_concurrency = num_threads
        defaults = _batch_sampling("run_batch", sampling)
        states = self._batch(client, list(batch_kwargs), defaults, max_concurrency,
                             progress_bar, pin, namespace)
        return states if generator_style else list(states)

    def _batch(self, client: Client, batch: list[Any], defaults: dict[str, Any],
               max_concurrency: int | None, progress_bar: bool, pin: str | None,
               namespace: str | None) -> Iterator[ProgramState]:
        if global_config.enable_precache_with_tracing and len(batch) > 1 and pin is None:
            self._precache(client)
        pbar = _progress(len(batch)) if progress_bar else None
        try:
            if self.is_async:
                yield from client.loop.call(partial(
                    self.arun_batch, batch, backend=client.aclient,
                    max_concurrency=max_concurrency, pin=pin, namespace=namespace,
                    _portal=client.portal, _on_done=pbar.update if pbar else None, **defaults))
                return
            runs = [self._sync_run(client, defaults, False, pin, namespace) for _ in batch]
            fut = client.loop.spawn(
                _supervise_batch, runs, max_concurrency, pbar.update if pbar else None)
            try:
                for run, arguments in zip(runs, batch, strict=False):
                    args, kwargs = _arguments(arguments)
                    try:
                        run.root.ret_value = self.func(run.root, *args,
                                                       **{**self.bind_arguments, **kwargs})
                    except Exception as e:  # noqa: BLE001 - this program fails, the batch goes on
                        run.body_error = e
                        run.cancel()
                    finally:
                        run.commit(final=True)
                for run in runs:  # in order, each once it finished
                    run.root.sync()
                    yield run.root
            except BaseException:
                for run in runs:
                    run.commit(final=True)
                _wait_cancelled(fut)
                raise
            _wait(fut, lambda: fut.cancel())
        finally:
            if pbar is not None:
                pbar.close()

    # -- async --------------------------------------------------------------------------------

    async def arun(self, *args: Any, backend: Backend | None = None, stream: bool = False,
                   pin: str | None = None, namespace: str | None = None,
                   _portal: BlockingPortal | None = None, **kwargs: Any) -> ProgramState:
        """Run the program from async code and return its finished state.

        On an `AsyncClient` it runs in the current loop; on a synchronous client it runs
        in that client's loop and this coroutine waits for it. Cancelling it aborts the
        program's requests and closes its sessions."""
        client = resolve_backend(backend)
        if isinstance(client, Client):
            if client.loop.in_loop_thread():
                client, _portal = client.aclient, client.portal
            else:
                return await await_future(client.loop.spawn(partial(
                    self.arun, *args, backend=client.aclient, stream=stream, pin=pin,
                    namespace=namespace, _portal=client.portal, **kwargs)))
        sampling, kwargs = _split(kwargs, self.params)
        kwargs = self._body_kwargs("arun", kwargs)
        run = self._new_run(client, sampling, stream=stream, pin=pin, namespace=namespace,
                            loop_thread=threading.get_ident(), token=current_token(),
                            portal=_portal)
        with plain_errors():
            async with anyio.create_task_group() as tg:
                tg.start_soon(run.supervise)
                await self._abody(run, args, kwargs)
        error = run.first_error()
        if error is not None:
            raise error
        return run.root

    async def _abody(self, run: ProgramRun, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Run the body from the run's loop: an async body as a coroutine, a plain one in a
        worker thread (its reads must not block the loop)."""
        try:
            if self.is_async:
                run.root.ret_value = await self.func(run.root, *args, **kwargs)
            else:
                run.root.ret_value = await anyio.to_thread.run_sync(
                    partial(self.func, run.root, *args, **kwargs))
        except BaseException as e:
            run.body_error = e
            run.cancel()
            raise
        finally:
            run.commit(final=True)

    @asynccontextmanager
    async def astream(self, *args: Any, backend: AsyncClient | None = None,
                      pin: str | None = None, namespace: str | None = None,
                      **kwargs: Any) -> AsyncIterator[ProgramState]:
        """Start the program with streaming and yield its state at once:

            async with prog.astream(topic="...", backend=client) as s:
                async for piece in s.text_async_iter("story"):
                    print(piece, end="")

        The program runs in a task group owned by this context; leaving waits for it."""
        client = resolve_backend(backend)
        if not isinstance(client, AsyncClient):
            raise ProgramError("astream() needs an AsyncClient; with a synchronous client use "
                               "run(stream=True) and state.text_iter()")
        sampling, kwargs = _split(kwargs, self.params)
        kwargs = self._body_kwargs("astream", kwargs)
        run = self._new_run(client, sampling, stream=True, pin=pin, namespace=namespace,
                            loop_thread=threading.get_ident(), token=current_token(), portal=None)
        with plain_errors():
            async with anyio.create_task_group() as tg:
                tg.start_soon(run.supervise)
                tg.start_soon(self._abody, run, args, kwargs)
                yield run.root
        error = run.first_error()
        if error is not None:
            raise error

    async def arun_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        backend: Backend | None = None,
        max_concurrency: int | None = None,
        pin: str | None = None,
        namespace: str | None = None,
        _portal: BlockingPortal | None = None,
        _on_done: Callable[[int], Any] | None = None,
        **sampling: Any,
    ) -> list[ProgramState]:
        """`run_batch` from async code: one task per program, at most `max_concurrency`."""
        client = resolve_backend(backend)
        if isinstance(client, Client):
            return await await_future(client.loop.spawn(partial(
                self.arun_batch, batch_kwargs, backend=client.aclient,
                max_concurrency=max_concurrency, pin=pin, namespace=namespace,
                _portal=client.portal, _on_done=_on_done, **sampling)))
        defaults = _batch_sampling("arun_batch", sampling)
        limiter = anyio.CapacityLimiter(max_concurrency) if max_concurrency else None
        runs = [self._new_run(client, defaults, stream=False, pin=pin, namespace=namespace,
                              loop_thread=threading.get_ident(), token=current_token(),
                              portal=_portal) for _ in batch_kwargs]

        async def one(run: ProgramRun, arguments: Any) -> None:
            args, kwargs = _arguments(arguments)
            kwargs = {**self.bind_arguments, **kwargs}
            if limiter is not None:
                await limiter.acquire()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run.supervise)
                    with contextlib.suppress(Exception):  # recorded in the state
                        await self._abody(run, args, kwargs)
            finally:
                if limiter is not None:
                    limiter.release()
            if _on_done is not None:
                _on_done(1)

        async with anyio.create_task_group() as tg:
            for run, arguments in zip(runs, batch_kwargs, strict=False):
                tg.start_soon(one, run, arguments)
        return [run.root for run in runs]


def _arguments(arguments: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(arguments, dict):
        return (), arguments
    if isinstance(arguments, (list, tuple)):
        return tuple(arguments), {}
    raise TypeError(f"each batch item is a dict of arguments (or a tuple), got {arguments!r}")


async def _supervise_batch(runs: list[ProgramRun], limit: int | None,
                           on_done: Callable[[int], Any] | None) -> None:
    limiter = anyio.CapacityLimiter(limit) if limit else None

    async def one(run: ProgramRun) -> None:
        if limiter is None:
            await run.supervise()
        else:
            async with limiter:
                await run.supervise()
        if on_done is not None:
            on_done(1)

    async with anyio.create_task_group() as tg:
        for run in runs:
            tg.start_soon(one, run)


def _settle(fut: Future[Any]) -> None:
    """Wait (boundedly) for a cancelled supervisor's cleanup; its outcome does not matter."""
    with contextlib.suppress(Exception):
        fut.result(timeout=_CANCEL_WAIT_S)


def _wait_cancelled(fut: Future[Any]) -> None:
    fut.cancel()
    _settle(fut)


def _report(state: ProgramState) -> None:
    """``global_config.verbosity >= 2``: print the finished program's text (SGLang's)."""
    if global_config.verbosity >= 2:
        print(state.text())


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total)


def function(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator making a `Program` of a function whose first parameter is the state:
    ``@rl.function`` (or ``@rl.function()``). SGLang's tuning options are accepted."""
    unknown = set(options) - {"num_api_spec_tokens"}
    if unknown:
        raise TypeError(f"function() got unexpected options {sorted(unknown)}")
    if func is None:
        return lambda f: Program(f)
    return Program(func)
