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
from dataclasses import dataclass
from pathlib import Path

from radixlm.runtime.engine.sessions.durable import DurableLog
from radixlm.runtime.model.gguf_weights import source_gguf
from radixlm.runtime.state.fingerprint import fingerprint, model_files
from radixlm.runtime.state.location import StateDirError, make_private_dir

log = logging.getLogger("radixlm.engine")

ENGINE_DB = "engine.sqlite"
MODELS = "models"


@dataclass
class EngineState:
    """The engine's state folder and what it keeps there."""

    fingerprint: str
    folder: Path
    log: DurableLog

    def close(self) -> None:
        self.log.close()


def model_fingerprint(model_dir: Path, settings: dict[str, object]) -> str:
    """The fingerprint of the model served from `model_dir` (a converted GGUF: the GGUF
    file itself, whose tokenizer is inside) with `settings`."""
    gguf = source_gguf(model_dir)
    files = [gguf] if gguf is not None else model_files(model_dir)
    return fingerprint(files, settings)


def open_engine_state(state_dir: str, model_dir: Path, settings: dict[str, object],
                      *, max_bytes: int = 0) -> EngineState | None:
    """The engine's state for this model, or None (no state directory, or one it cannot
    use: said once)."""
    if not state_dir:
        return None
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
