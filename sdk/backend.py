"""Which client a program runs on: `resolve_backend` (the one given, else the default),
and SGLang's module-level functions over the default backend (`set_default_backend`,
`get_default_backend`, `flush_cache`, `get_server_info`)."""

from __future__ import annotations

from typing import Any, Union

from radixlm.sdk.client import AsyncClient
from radixlm.sdk.errors import ProgramError
from radixlm.sdk.global_config import global_config
from radixlm.sdk.sync import Client

__all__ = ["Backend", "flush_cache", "get_default_backend", "get_server_info",
           "resolve_backend", "set_default_backend"]

Backend = Union[Client, AsyncClient]


def set_default_backend(backend: Backend | None) -> None:
    """Make `backend` (an `rl.Engine`, `rl.connect(...)` client, `rl.RuntimeEndpoint` or
    `AsyncClient`) the one programs run on when no ``backend=`` is given (it is
    ``rl.global_config.default_backend``)."""
    global_config.default_backend = backend


def get_default_backend() -> Backend | None:
    """The backend set with `set_default_backend` (None if none is)."""
    return global_config.default_backend  # type: ignore[no-any-return]


def flush_cache(backend: Backend | None = None) -> bool:
    """SGLang's ``sgl.flush_cache()``: evict everything evictable from the prefix cache of
    `backend` (default: the default backend); sessions and pins keep what they hold.
    Returns True, or False when there is no backend (as SGLang)."""
    if backend is None and global_config.default_backend is None:
        return False
    client = resolve_backend(backend)
    if isinstance(client, AsyncClient):
        raise ProgramError("with an AsyncClient use `await client.flush_cache()`")
    client.flush_cache()
    return True


def get_server_info(backend: Backend | None = None) -> dict[str, Any] | None:
    """SGLang's ``sgl.get_server_info()``: what the engine of `backend` (default: the
    default backend) says about itself, and its stats; None when there is no backend."""
    if backend is None and global_config.default_backend is None:
        return None
    client = resolve_backend(backend)
    if isinstance(client, AsyncClient):
        raise ProgramError("with an AsyncClient use `await client.stats()`")
    return client.get_server_info()


def resolve_backend(backend: Backend | None) -> Backend:
    """`backend`, else the default one; a clear error when there is neither."""
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise ProgramError("no backend: pass backend=... or call "
                           "rl.set_default_backend(rl.Engine())")
    if not isinstance(backend, (Client, AsyncClient)):
        raise TypeError(f"a backend is an rl.Engine, rl.connect(...), rl.RuntimeEndpoint or "
                        f"rl.AsyncClient, not {type(backend).__name__}")
    return backend
