"""The router's settings, built once from the command line (or by ``serve --replicas``).

A replica is named by its endpoint and, for a CurveZMQ server, the keys to reach it:
``ENDPOINT[,server_key=PATH][,client_key=PATH][,gateway_token=PATH]``. ``gateway_token``
is the replica's gateway credential (``gateway.token`` in its runtime directory): with it
the router speaks for its own clients' tenants there (docs/deployment.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from radixlm.runtime.router.policy import Balance
from radixlm.runtime.transport.endpoints import EndpointError, parse_endpoint

__all__ = ["ReplicaSpec", "RouterConfig", "parse_replica"]


@dataclass(frozen=True)
class ReplicaSpec:
    endpoint: str
    server_key: str | None = None
    client_key: str | None = None
    gateway_token: str | None = None  # the token itself (read from the file at start)


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[ReplicaSpec, ...]
    endpoint: str = ""  # the router's client endpoint ("": an ipc socket in runtime_dir)
    auth_dir: str | None = None  # CurveZMQ for the router's own clients
    insecure: bool = False
    balance: Balance = field(default_factory=Balance)
    hot_pin_uses: int = 8  # sessions opened from a pin before it goes on every replica
    probe_interval_s: float = 0.5  # a quiet replica is asked for stats this often...
    replica_timeout_s: float = 5.0  # ...and taken out when silent this long
    rejoin_interval_s: float = 1.0  # a down replica is dialled afresh at most this often
    start_timeout_s: float = 120.0  # waiting for the first replica at start
    max_message_bytes: int = 4 << 20


def parse_replica(text: str) -> ReplicaSpec:
    """``ENDPOINT[,server_key=PATH][,client_key=PATH][,gateway_token=PATH]``; raises
    ValueError saying what is wrong."""
    endpoint, *options = text.split(",")
    try:
        scheme = parse_endpoint(endpoint).scheme
    except EndpointError as e:
        raise ValueError(f"replica {text!r}: {e}") from None
    if scheme not in ("ipc", "tcp"):
        raise ValueError(f"replica {text!r}: the endpoint must be ipc://PATH or tcp://HOST:PORT")
    values: dict[str, str] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in ("server_key", "client_key", "gateway_token") or not value:
            raise ValueError(f"replica {text!r}: unknown option {option!r} (server_key=PATH, "
                             "client_key=PATH, gateway_token=PATH)")
        values[name] = value
    if ("server_key" in values) != ("client_key" in values):
        raise ValueError(f"replica {text!r}: server_key and client_key go together")
    token = None
    if "gateway_token" in values:
        try:
            token = Path(values["gateway_token"]).read_text(encoding="ascii").strip()
        except OSError as e:
            raise ValueError(f"replica {text!r}: cannot read the gateway token: {e}") from e
    return ReplicaSpec(endpoint, values.get("server_key"), values.get("client_key"), token)
