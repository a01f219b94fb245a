"""Compile work shared fairly between the parties that ask for it.

Each party (a tenant, or a client on a server with one tenant) has its own queue of
jobs; worker threads take the next job round-robin across parties, and a party may have
at most `per_party` jobs running at once, so with several workers one party's slow
grammars never hold them all: another party's tiny grammar starts at once. A job nobody
waits for any more (its requests aborted, their clients left: the `CompilingGrammar`
handles were cancelled or dropped) leaves the queue before it starts. A job that has
started runs to its end (xgrammar cannot be interrupted) but still counts against its
party.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

__all__ = ["CompileQueue", "Job"]


class Job:
    """One compilation: its future, its party and how many handles still wait on it."""

    __slots__ = ("future", "party", "run", "waiters", "__weakref__")

    def __init__(self, party: Hashable, run: Callable[[], Any]) -> None:
        self.future: Future[Any] = Future()
        self.party = party
        self.run = run
        self.waiters = 0


class CompileQueue:
    def __init__(self, workers: int, per_party: int, name: str = "grammar-compile") -> None:
        self._per_party = max(1, per_party)
        self._cond = threading.Condition()
        self._queues: OrderedDict[Hashable, deque[Job]] = OrderedDict()  # round-robin order
        self._running: dict[Hashable, int] = {}
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    def submit(self, party: Hashable, run: Callable[[], Any]) -> Job:
        job = Job(party, run)
        with self._cond:
            if self._closed:
                job.future.cancel()
                return job
            self._queues.setdefault(party, deque()).append(job)
            self._cond.notify()
        return job

    def attach(self, job: Job, handle: object) -> weakref.finalize:
        """`handle` waits on `job` until it is collected or the returned finalizer is
        called (its cancellation)."""
        with self._cond:
            job.waiters += 1
        done = weakref.finalize(handle, self.detach, weakref.ref(job))
        done.atexit = False
        return done

    def detach(self, job_ref: weakref.ref[Job]) -> None:
        job = job_ref()
        if job is None:
            return
        with self._cond:
            job.waiters -= 1
            if job.waiters > 0 or job.future.running() or job.future.done():
                return
            queue = self._queues.get(job.party)
            if queue is not None and job in queue:
                queue.remove(job)
                if not queue:
                    del self._queues[job.party]
                job.future.cancel()

    def queued(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def _next(self) -> Job | None:
        """The next job, round-robin over parties under their running limit (lock held)."""
        for party, queue in self._queues.items():
            if self._running.get(party, 0) >= self._per_party:
                continue
            job = queue.popleft()
            if queue:
                self._queues.move_to_end(party)
            else:
                del self._queues[party]
            return job
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                while job is None and not self._closed:
                    self._cond.wait()
                    job = self._next()
                if job is None:
                    return
                if not job.future.set_running_or_notify_cancel():
                    continue
                self._running[job.party] = self._running.get(job.party, 0) + 1
            try:
                job.future.set_result(job.run())
            except BaseException as e:  # noqa: BLE001 - the waiter gets it
                job.future.set_exception(e)
            finally:
                with self._cond:
                    left = self._running[job.party] - 1
                    if left:
                        self._running[job.party] = left
                    else:
                        del self._running[job.party]
                    self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for job in queue:
                    job.future.cancel()
            self._queues.clear()
            self._cond.notify_all()
