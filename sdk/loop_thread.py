"""`LoopThread`: an anyio (asyncio) event loop in a daemon thread, and cheap ways in.

Sync clients drive their `AsyncClient` through one. `spawn` starts a coroutine there in
one hop (one ``call_soon_threadsafe``), as a `TaskSet` task, and hands back a
`concurrent.futures.Future`; `call` waits for it. The anyio `BlockingPortal` (kept as
``portal``, for the rest) costs two more cross-thread wake-ups per call (it waits for the
task to be spawned, then for the result) and an anyio task, most of a fast call's time.
The loop is uvloop's when that is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import anyio
from anyio.from_thread import BlockingPortal
from anyio.lowlevel import EventLoopToken, current_token
from radixlm.sdk.tasks import TaskSet

__all__ = ["LoopThread"]

T = TypeVar("T")
_ALIVE_CHECK_S = 1.0  # while waiting for a call, how often to check the loop still runs
# An interrupted call's unwinding (a generation's abort awaits its final reply for up to
# the connection's abort_timeout, 2 s) is waited for this long.
_INTERRUPT_GRACE_S = 5.0


class LoopThread:
    """An asyncio event loop running in a daemon thread, reachable through `spawn`/`call`
    (and through an anyio portal, ``portal``)."""

    def __init__(self, name: str) -> None:
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.portal: BlockingPortal
        self.token: EventLoopToken
        self._aloop: asyncio.AbstractEventLoop
        self._tasks: TaskSet
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure
        self.thread_id: int = self._thread.ident  # type: ignore[assignment]

    def _run(self) -> None:
        try:
            anyio.run(self._main, backend_options=_backend_options())
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            self._failure = e
            self._ready.set()

    async def _main(self) -> None:
        _declare_asyncio_thread()
        async with BlockingPortal() as portal, TaskSet() as tasks:
            self.portal = portal
            self.token = current_token()
            self._aloop = asyncio.get_running_loop()
            self._tasks = tasks
            self._ready.set()
            try:
                await portal.sleep_until_stopped()
            finally:
                tasks.cancel()

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread_id

    # -- running coroutines in the loop --------------------------------------------------------

    def spawn(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
        """Start ``fn(*args)`` as a task in the loop, from another thread, without waiting
        for it to start. Cancelling the returned future cancels the task."""
        return self._spawn(fn, args, None)

    def iterate(self, source: AsyncIterator[T]) -> Pump[T]:
        """`source`'s items for a thread outside the loop (`Pump`)."""
        return Pump(self, source)

    def _spawn(self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...],
               settled: threading.Event | None) -> Future[T]:
        future: Future[T] = Future()
        try:
            self._aloop.call_soon_threadsafe(self._start, future, fn, args, settled)
        except RuntimeError:  # the loop is closed
            raise RuntimeError("this client's event loop is not running (closed?)") from None
        return future

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` in the loop and wait for its result (from another thread).

        Interrupted (Ctrl-C: KeyboardInterrupt in this thread), it cancels the call and
        lets it unwind in the loop -- a generation is aborted in the engine, its session
        freed -- for up to `_INTERRUPT_GRACE_S` before the interrupt goes on: the client
        stays usable for the next call."""
        settled = threading.Event()
        future = self._spawn(fn, args, settled)
        try:
            return self._wait(lambda t: future.result(timeout=t), TimeoutError)
        except KeyboardInterrupt:
            future.cancel()
            settled.wait(_INTERRUPT_GRACE_S)
            raise

    def _wait(self, get: Callable[[float], T], empty: type[Exception]) -> T:
        """``get(timeout)`` until it returns, checking every `_ALIVE_CHECK_S` (each `empty`
        it raises) that the loop still runs (it may stop before taking the work)."""
        while True:
            try:
                return get(_ALIVE_CHECK_S)
            except empty:
                if not self._thread.is_alive():
                    raise RuntimeError("this client's event loop stopped") from None

    def _start(self, future: Future[T], fn: Callable[..., Awaitable[T]],
               args: tuple[Any, ...], settled: threading.Event | None = None) -> None:
        try:
            scope = self._tasks.start(_into_future, future, fn, args, settled)
        except RuntimeError:  # the task set closed: the loop is stopping
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("this client's event loop is stopping"))
            if settled is not None:
                settled.set()
            return

        def on_done(f: Future[T]) -> None:  # cancelling the future cancels the call
            if not f.cancelled():
                return
            if self.in_loop_thread():
                scope.cancel()
            else:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    self._aloop.call_soon_threadsafe(scope.cancel)

        future.add_done_callback(on_done)

    # -- closing -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the loop (cancelling what still runs in it) and join the thread."""
        if self._thread.is_alive() and not self.in_loop_thread():
            with contextlib.suppress(RuntimeError):  # already stopping
                self.portal.call(self.portal.stop, True)
            self._thread.join(timeout=10)


class Pump(Generic[T]):
    """An async iterator's items for another thread: one task in the loop takes them as
    they come and queues them, and `take` waits on the queue. Each item costs one
    cross-thread wake-up, where a `call` per item costs three and a task (for a stream of
    tokens that is most of the client's time). The task starts at the first `take`."""

    def __init__(self, loop: LoopThread, source: AsyncIterator[T]) -> None:
        self._loop = loop
        self._source = source
        self._items: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._task: Future[None] | None = None
        self._settled = threading.Event()

    def take(self) -> tuple[bool, T | None]:
        """``(True, item)``, or ``(False, None)`` once the source has ended; what the source
        raised is raised here. Interrupted (Ctrl-C), the task is cancelled and its
        unwinding waited for, as `LoopThread.call` does."""
        if self._task is None:
            self._task = self._loop._spawn(_queue_items, (self._source, self._items), self._settled)
        try:
            more, item = self._loop._wait(lambda t: self._items.get(timeout=t), queue.Empty)
        except KeyboardInterrupt:
            self.close()
            raise
        if isinstance(item, BaseException):
            raise item
        return more, item

    def close(self) -> None:
        """Cancel the task (the source's own cleanup runs there) and wait for it to unwind."""
        if self._task is not None:
            self._task.cancel()
            self._settled.wait(_INTERRUPT_GRACE_S)


async def _queue_items(source: AsyncIterator[T], items: queue.SimpleQueue[tuple[bool, Any]]) -> None:
    try:
        async for item in source:
            items.put((True, item))
    except anyio.get_cancelled_exc_class():
        items.put((False, None))  # (a thread still waiting in `take` sees the end)
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the taking thread
        items.put((False, exc))
        if not isinstance(exc, Exception):
            raise
        return
    items.put((False, None))


def _declare_asyncio_thread() -> None:
    """`spawn`'s hop runs in a loop callback, outside any task, and makes an anyio cancel
    scope there. anyio finds its backend through sniffio when sniffio is installed (the
    `openai` package brings it), and sniffio recognises asyncio only inside a task unless
    the thread is declared: declare this thread's loop."""
    try:
        import sniffio
    except ImportError:
        return
    sniffio.thread_local.name = "asyncio"


def _backend_options() -> dict[str, Any]:
    """uvloop when it is installed (optional): a C event loop, where a program's gen costs
    a fifth less CPU than on asyncio's own."""
    return {"use_uvloop": True} if importlib.util.find_spec("uvloop") is not None else {}


async def _into_future(future: Future[T], fn: Callable[..., Awaitable[T]],
                       args: tuple[Any, ...], settled: threading.Event | None = None) -> None:
    """Run the call and settle `future` as anyio's portal does: it stays pending while the
    call runs, so that cancelling it still cancels the call. `settled` is set once the
    call has returned or unwound, whatever became of the future."""
    try:
        await _settle(future, fn, args)
    finally:
        if settled is not None:
            settled.set()


async def _settle(future: Future[T], fn: Callable[..., Awaitable[T]],
                  args: tuple[Any, ...]) -> None:
    try:
        result = await fn(*args)
    except anyio.get_cancelled_exc_class():
        future.cancel()
        future.set_running_or_notify_cancel()
        raise
    except BaseException as exc:
        if future.set_running_or_notify_cancel():
            future.set_exception(exc)
        if not isinstance(exc, Exception):
            raise
    else:
        if future.set_running_or_notify_cancel():
            future.set_result(result)
