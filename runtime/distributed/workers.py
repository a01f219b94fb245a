"""Rank 0's handles on the worker processes: spawn one, wait until all have loaded, say
why one is gone, stop them all."""

from __future__ import annotations

import contextlib
import logging
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess

from .step_wire import encode_stop
from .worker import FAILED, LOADED, WorkerSpec, worker_main

log = logging.getLogger("radixlm.tp")

STOP_WAIT_S = 10.0  # a stopped worker exits within this, else it is killed


class TensorParallelError(RuntimeError):
    """A worker rank failed or died: this engine cannot compute any more."""


class WorkerProcess:
    """One worker rank: its process and rank 0's end of its pipe."""

    def __init__(self, rank: int, process: BaseProcess, conn: Connection) -> None:
        self.rank, self.process, self.conn = rank, process, conn
        self.error: str | None = None  # what it reported before exiting

    def describe_exit(self) -> str:
        """Why this worker is gone, in one line."""
        self.read_error()
        # reaped, so its exit code is known (a rank that reported its error may take a
        # while to tear down its process group on a loaded machine: 1 s was once short).
        code = join_process(self.process, 5.0)
        how = ("still exiting" if code is None else f"exit code {code}" if code >= 0
               else f"signal {-code}")
        detail = f": {self.error}" if self.error else ""
        return f"tensor-parallel rank {self.rank} (pid {self.process.pid}) stopped ({how}){detail}"

    def read_error(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            while self.error is None and self.conn.poll(0):
                msg = self.conn.recv_bytes()
                if msg.startswith(FAILED):
                    self.error = msg[len(FAILED):].decode(errors="replace")


def join_process(process: BaseProcess, timeout_s: float) -> int | None:
    """`process.join`, safe when another thread joins the same process: the loser of the
    two `waitpid` calls gets ECHILD and returns before the winner records the exit code,
    so wait (up to the same deadline) until it is recorded. None: still running."""
    deadline = time.monotonic() + timeout_s
    process.join(timeout_s)
    while (code := process.exitcode) is None and time.monotonic() < deadline:
        process.join(0.02)
    return code


def spawn_worker(ctx: SpawnContext, spec: WorkerSpec) -> WorkerProcess:
    mine, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=worker_main, args=(spec, theirs), daemon=True,
                       name=f"radixlm-tp{spec.rank}")  # fmt: skip
    proc.start()
    theirs.close()
    return WorkerProcess(spec.rank, proc, mine)


def wait_loaded(workers: list[WorkerProcess], timeout_s: float) -> None:
    """Until every worker has loaded its shard; a failure or death is the start-up error."""
    pending = {w.conn: w for w in workers}
    by_sentinel = {w.process.sentinel: w for w in workers}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            ranks = ", ".join(str(w.rank) for w in pending.values())
            raise TensorParallelError(f"tensor-parallel ranks {ranks} did not load the model "
                                      f"within {timeout_s:.0f}s")
        for obj in wait([*pending, *by_sentinel], timeout=left):
            w = pending.get(obj) or by_sentinel[obj]
            if obj in pending:
                try:
                    msg = w.conn.recv_bytes()
                except (EOFError, OSError):
                    msg = b""
                if msg == LOADED:
                    del pending[obj]
                    continue
                if msg.startswith(FAILED):
                    w.error = msg[len(FAILED):].decode(errors="replace")
            raise TensorParallelError(w.describe_exit())


def stop_all(workers: list[WorkerProcess], send_stop: bool) -> None:
    for w in workers:
        if send_stop:
            with contextlib.suppress(OSError):
                w.conn.send_bytes(encode_stop())
        else:
            w.process.terminate()
    deadline = time.monotonic() + STOP_WAIT_S
    for w in workers:
        if join_process(w.process, max(0.0, deadline - time.monotonic())) is None:
            log.warning("tensor-parallel rank %d did not stop: killing it", w.rank)
            w.process.kill()
            join_process(w.process, 1.0)
        w.conn.close()
