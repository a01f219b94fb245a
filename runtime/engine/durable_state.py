"""The engine's part of the state directory: its model folder, durable rows and disk tier.

`radixlm serve` opens and locks the state directory (runtime/state/location.py) and passes
its path in `EngineConfig.state_dir`; the engine names its model's folder by the model's
fingerprint, once the model is resolved and loaded (runtime/state/fingerprint.py: the
weights and tokenizer files, the weights' format, the KV dtype, the page size and the KV
layout), so state made by any other model, or the same one served differently, is never
read. A folder it cannot use is said in one line and the engine serves without state.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from radixlm.cache import KVPool
from radixlm.cache.disk_kv import DiskKV
from radixlm.runtime.engine.sessions.disk_backup import layout_of
from radixlm.runtime.engine.sessions.durable import DurableLog
from radixlm.runtime.model.gguf_weights import source_gguf
from radixlm.runtime.state.fingerprint import fingerprint, model_files
from radixlm.runtime.state.location import StateDirError, make_private_dir

log = logging.getLogger("radixlm.engine")

# Fault injection (tests, and a user trying the failure path): the engine's database
# file capped at this many bytes fails its writes exactly as a full disk does.
MAX_BYTES_ENV = "RADIXLM_STATE_MAX_BYTES"
ENGINE_DB = "engine.sqlite"
MODELS = "models"
KV_FOLDER = "kv"
DISK_SHARE = 0.1  # default bound of the disk tier: this share of the free space ...
DISK_MAX = 20 * 2**30  # ... at most


@dataclass
class EngineState:
    """The engine's state folder and what it keeps there."""

    fingerprint: str
    folder: Path
    log: DurableLog
    disk: DiskKV | None = None  # the disk KV tier (`open_disk_tier`)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        self.log.close()


def open_disk_tier(state: EngineState, pool: KVPool, capacity_bytes: int,
                   tensor_parallel: int = 1) -> DiskKV | None:
    """The disk KV tier in the state folder (`capacity_bytes` 0: a tenth of the free
    space, at most 20 GiB), or None (said once) where it cannot be."""
    if tensor_parallel > 1:  # each rank holds a shard of the heads: not one block's KV
        log.info("disk KV tier: off with tensor parallelism (sessions are kept, their KV "
                 "recomputed after a restart)")
        return None
    folder = state.folder / KV_FOLDER
    try:
        if capacity_bytes <= 0:
            capacity_bytes = min(DISK_MAX, int(shutil.disk_usage(state.folder).free * DISK_SHARE))
        state.disk = DiskKV(folder, layout_of(pool), capacity_bytes)
    except (OSError, ValueError) as e:
        log.error("disk KV tier: %s: %s; serving without it", folder, e)
        return None
    log.info("disk KV tier: %s, %d block(s) (%.1f of %.1f MiB)", folder, state.disk.num_blocks,
             state.disk.used_bytes / 2**20, capacity_bytes / 2**20)
    return state.disk


def model_fingerprint(model_dir: Path, settings: dict[str, object]) -> str:
    """The fingerprint of the model served from `model_dir` (a converted GGUF: the GGUF
    file itself, whose tokenizer is inside) with `settings`."""
    gguf = source_gguf(model_dir)
    files = [gguf] if gguf is not None else model_files(model_dir)
    return fingerprint(files, settings)


def open_engine_state(state_dir: str, model_dir: Path, settings: dict[str, object],
                      *, max_bytes: int | None = None) -> EngineState | None:
    """The engine's state for this model, or None (no state directory, or one it cannot
    use: said once)."""
    if not state_dir:
        return None
    if max_bytes is None:
        max_bytes = int(os.environ.get(MAX_BYTES_ENV, "0") or 0)
    root = Path(state_dir)
    try:
        fp = model_fingerprint(model_dir, settings)
        folder = make_private_dir(root / MODELS / fp)
        durable = DurableLog(folder / ENGINE_DB, max_bytes=max_bytes)
    except (StateDirError, OSError) as e:
        log.error("state: %s; serving without state (nothing outlives this engine)", e)
        return None
    others = [p.name for p in (root / MODELS).iterdir() if p.is_dir() and p.name != fp]
    if others:
        log.info("state: %d other model setup(s) in %s left unused (state is kept per "
                 "model fingerprint)", len(others), root)
    return EngineState(fp, folder, durable)
