"""A worker rank (1..N-1): a spawned process that loads its shard, joins the group and
runs each step rank 0 sends, on its heads (no logits: rank 0 samples).

It stops at a stop message, when rank 0's pipe closes (the engine died) or when its
parent dies (PR_SET_PDEATHSIG); a failure is logged here (the engine's stderr) and sent
to rank 0 as one line before the worker exits non-zero.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from .group import Rendezvous, TPGroup

log = logging.getLogger("radixlm.tp")

LOADED = b"loaded"
FAILED = b"failed:"


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard (plain values: spawn pickles it)."""

    model_dir: str
    rank: int
    rendezvous: Rendezvous
    dtype: str  # torch dtype name, e.g. "float32"
    capacity: int  # KV pool slots, as rank 0's
    page_size: int
    attention: str
    threads: int
    seed: int
    log_level: str
    parent_pid: int


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The spawned process's entry point."""
    from radixlm.runtime.server.child import die_with_parent

    die_with_parent(spec.parent_pid)
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s radixlm-tp{spec.rank} %(levelname)s %(name)s: %(message)s",
    )
    try:
        _serve(spec, conn)
    except BaseException as e:  # noqa: BLE001 - every failure is reported, then the exit
        log.exception("tensor-parallel rank %d failed", spec.rank)
        with contextlib.suppress(OSError):
            conn.send_bytes(FAILED + f"{type(e).__name__}: {e}".encode())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)  # no interpreter teardown (seconds with torch loaded)


def _serve(spec: WorkerSpec, conn: Connection) -> None:
    from radixlm.cache import KVPool
    from radixlm.runtime.memory import keep_freed_blocks
    from radixlm.runtime.model.runner import ModelRunner

    from .linear import use_row_parallel
    from .load import load_shard
    from .step_wire import decode_step

    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    device = spec.rendezvous.device_of(spec.rank)
    dtype = getattr(torch, spec.dtype)
    model = load_shard(spec.model_dir, device, dtype, spec.rank, spec.rendezvous.world)
    c = model.config
    pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, spec.capacity, spec.page_size,
                  dtype, device)  # fmt: skip
    runner = ModelRunner.from_model(model, pool, spec.attention)
    conn.send_bytes(LOADED)
    group = TPGroup(spec.rendezvous, spec.rank)
    use_row_parallel(model, group)
    log.debug("rank %d of %d ready on %s", spec.rank, group.world, device)
    keep_freed_blocks()  # as the engine (rank 0): runtime/memory.py
    try:
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:
                log.info("rank 0 is gone: stopping")
                return
            batch = decode_step(data, device)
            if batch is None:
                return
            with torch.inference_mode():
                runner.attn.plan(batch)
                runner.model.forward_hidden(batch, runner.attn)
    finally:
        group.close()
