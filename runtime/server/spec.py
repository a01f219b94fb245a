"""The spec a server's child process is started with: its role's whole config, typed
(`ServerSpec`: the frozen `EngineConfig` and the `Endpoints`), as one JSON file in the
private runtime directory. msgspec decodes it into those types, so a child checks every
setting as it reads them (`radixlm.runtime.settings`); no pickle, no flags."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
from radixlm.runtime.config import Endpoints, EngineConfig

ROLES = ("engine", "frontend")


class ServerSpec(msgspec.Struct, frozen=True):
    config: EngineConfig
    endpoints: Endpoints


def encode_spec(config: EngineConfig, endpoints: Endpoints) -> bytes:
    return msgspec.json.encode(ServerSpec(config, endpoints))


def load_spec(path: str | os.PathLike[str]) -> tuple[EngineConfig, Endpoints]:
    """The config and endpoints a child process was started with."""
    spec = msgspec.json.decode(Path(path).read_bytes(), type=ServerSpec)
    return spec.config, spec.endpoints
