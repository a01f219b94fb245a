"""The spec a server's child process is started with: its role, the frozen `EngineConfig`
and the `Endpoints`, as one JSON file in the private runtime directory (msgspec's
builtins of the config: no pickle)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import msgspec
from radixlm.runtime.config import Endpoints, EngineConfig

ROLES = ("engine", "frontend")


def encode_spec(config: EngineConfig, endpoints: Endpoints) -> bytes:
    return json.dumps({
        "config": msgspec.to_builtins(config),
        "endpoints": dataclasses.asdict(endpoints),
    }).encode()


def load_spec(path: str | os.PathLike[str]) -> tuple[EngineConfig, Endpoints]:
    """The config and endpoints a child process was started with."""
    spec = json.loads(Path(path).read_bytes())
    return msgspec.convert(spec["config"], EngineConfig), Endpoints(**spec["endpoints"])
