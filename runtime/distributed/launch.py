"""Rank 0's side: start the worker ranks, meet them, send each step, watch them, stop them.

`TensorParallel.start(...)` spawns ranks 1..N-1 (multiprocessing "spawn": no forked torch
state), loads rank 0's shard while they load theirs, waits until each has loaded (or
failed, or died: its error becomes the start-up error), then all ranks join the group.
`runner` is what the scheduler calls: `forward(batch)` sends the batch to every worker
and runs rank 0's shard; the all-reduces inside keep the ranks in step.

A worker that fails or dies fails the forward in progress (its requests get the error)
and sets `failure`; the watcher thread also notices a death while the engine is idle and
calls the `on_failure` callback (the engine then stops and reports `failure`). Nothing
waits forever: collectives time out (group.py), pipes close with their process
(workers.py).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path

import torch
from radixlm.cache import KVPool
from radixlm.runtime.model.batch import ForwardBatch
from radixlm.runtime.model.config import ModelConfig
from radixlm.runtime.model.runner import ModelRunner

from .group import Rendezvous, TPGroup
from .linear import use_row_parallel
from .load import load_shard
from .shard import check_tp_size
from .step_wire import encode_step
from .worker import WorkerSpec
from .workers import (
    TensorParallelError,
    WorkerProcess,
    spawn_worker,
    stop_all,
    wait_loaded,
)

log = logging.getLogger("radixlm.tp")


class TensorParallel:
    """N ranks of one model; rank 0 is this process. See the module docstring."""

    def __init__(self, world: int, workers: list[WorkerProcess], group: TPGroup,
                 runner: ModelRunner, tmpdir: str) -> None:  # fmt: skip
        self.world = world
        self.workers = workers
        self.group = group
        self.runner = TensorParallelRunner(self, runner)
        self.failure: str | None = None
        self._on_failure: Callable[[], None] = lambda: None
        self._fail_lock = threading.Lock()  # the watcher and the forward may both see it
        self._tmpdir = tmpdir
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    @classmethod
    def start(
        cls,
        model_dir: str | Path,
        world: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        capacity: int,
        page_size: int,
        attention: str = "auto",
        threads: int = 0,
        seed: int = 0,
        log_level: str = "info",
        start_timeout_s: float = 600.0,
    ) -> TensorParallel:
        """Spawn and meet the workers; raises `TensorParallelConfigError` for sizes the
        model cannot split (before anything starts), `TensorParallelError` for a worker
        that fails to start."""
        check_tp_size(ModelConfig.from_dir(model_dir), world)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + world:
            raise TensorParallelError(f"--tensor-parallel-size {world} needs {world} GPUs from "
                                      f"{device}; {torch.cuda.device_count()} visible")
        threads = threads if threads > 0 else max(1, (os.cpu_count() or 1) // world)
        torch.set_num_threads(threads)
        tmpdir = tempfile.mkdtemp(prefix="radixlm-tp-")  # 0700: a private rendezvous
        rdv = Rendezvous(str(Path(tmpdir) / "rendezvous"), world, str(device))
        ctx = mp.get_context("spawn")
        workers: list[WorkerProcess] = []
        try:
            for rank in range(1, world):
                spec = WorkerSpec(
                    model_dir=str(model_dir), rank=rank, rendezvous=rdv,
                    dtype=str(dtype).removeprefix("torch."), capacity=capacity,
                    page_size=page_size, attention=attention, threads=threads, seed=seed,
                    log_level=log_level, parent_pid=os.getpid(),
                )  # fmt: skip
                workers.append(spawn_worker(ctx, spec))
            model = load_shard(model_dir, device, dtype, 0, world)
            c = model.config
            pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, capacity, page_size, dtype,
                          device)  # fmt: skip
            runner = ModelRunner.from_model(model, pool, attention)
            wait_loaded(workers, start_timeout_s)
            group = TPGroup(rdv, 0)
            use_row_parallel(model, group)
        except BaseException:
            stop_all(workers, send_stop=False)
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        log.info("tensor parallel: %d ranks (%s), %d heads and %d KV heads per rank",
                 world, rdv.backend, c.num_heads, c.num_kv_heads)  # fmt: skip
        return cls(world, workers, group, runner, tmpdir)

    def send(self, batch: ForwardBatch) -> None:
        """Hand `batch` to every worker (before rank 0 runs its own shard)."""
        self.raise_if_failed()
        data = encode_step(batch)
        for w in self.workers:
            try:
                w.conn.send_bytes(data)
            except OSError as e:
                raise self._fail(w.describe_exit() if not w.process.is_alive() else
                                 f"tensor-parallel rank {w.rank}: pipe failed ({e})") from e

    def collective_failed(self, exc: BaseException) -> TensorParallelError:
        """Rank 0's forward raised (a collective whose peer died, or anything else: the
        ranks are out of step either way); name the worker behind it if one is gone."""
        deadline = time.monotonic() + 2.0  # the failed peer is usually exiting right now
        while time.monotonic() < deadline and all(w.process.is_alive() for w in self.workers):
            time.sleep(0.05)
        gone = [w.describe_exit() for w in self.workers if not w.process.is_alive()]
        return self._fail("; ".join(gone) if gone else
                          f"tensor-parallel forward failed on rank 0: {type(exc).__name__}: {exc}")

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the watcher thread) once a rank has failed; at once if
        one has already."""
        self._on_failure = callback
        if self.failure is not None:
            callback()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def _fail(self, why: str) -> TensorParallelError:
        with self._fail_lock:
            first = self.failure is None
            if first:
                self.failure = why
        if first:
            log.error("%s; the engine stops", why)
            self._on_failure()
        return TensorParallelError(self.failure)

    def _watch(self) -> None:
        """Notice a worker's death even while nothing is computed."""
        sentinels = {w.process.sentinel: w for w in self.workers}
        while not self._closed.is_set():
            ready = wait(list(sentinels), timeout=0.5)
            if self._closed.is_set():
                return
            if ready:
                self._fail(sentinels[ready[0]].describe_exit())
                return

    def close(self) -> None:
        """Stop the workers (a stop message, then kill after STOP_WAIT_S) and leave the group."""
        if self._closed.is_set():
            return
        self._closed.set()
        stop_all(self.workers, send_stop=self.failure is None)
        self.group.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


class TensorParallelRunner:
    """What the scheduler calls (`ForwardModel`): the batch to every rank, logits from rank 0."""

    def __init__(self, tp: TensorParallel, local: ModelRunner) -> None:
        self.tp = tp
        self.local = local
        self.model = local.model
        self.config = local.config
        self.pool = local.pool
        self.device = local.device
        self.dtype = local.dtype
        self.attention = local.attention

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.tp.send(batch)
        try:
            return self.local.forward(batch)
        except Exception as e:  # noqa: BLE001 - any failure here leaves the ranks out of step
            raise self.tp.collective_failed(e) from e
