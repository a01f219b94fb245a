"""The router's settings, built once from the command line (or by ``serve --replicas``).

A replica is named by its endpoint and, for a CurveZMQ server, the keys to reach it:
``ENDPOINT[,server_key=PATH][,client_key=PATH][,gateway_token=PATH]``. ``gateway_token``
is the replica's gateway credential (``gateway.token`` in its runtime directory): with it
the router speaks for its own clients' tenants there (docs/deployment.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from radixlm.runtime.config import MAX_MESSAGE_BYTES
from radixlm.runtime.router.policy import Balance
from radixlm.runtime.settings import Declaration, Settings, setting
from radixlm.runtime.transport.endpoints import EndpointError, parse_endpoint

__all__ = ["ROUTING", "ReplicaSpec", "RouterConfig", "parse_replica"]

ROUTING = "routing (docs/deployment.md)"  # its --help section
_BALANCE = Balance()  # the routing rule's defaults (policy.py)


@dataclass(frozen=True)
class ReplicaSpec:
    endpoint: str
    server_key: str | None = None
    client_key: str | None = None
    gateway_token: str | None = None  # the token itself (read from the file at start)


def _routing(help: str, *flags: str, **options: Any) -> Declaration:  # noqa: A002
    return setting(help, *flags, read_by="router", group=ROUTING, **options)


class RouterConfig(Settings, frozen=True, kw_only=True):
    """The router's settings, each declared once (`radixlm.runtime.settings`): the flags
    of `radixlm router` and of `serve --replicas` are generated from them."""

    replicas: tuple[ReplicaSpec, ...] = ()
    endpoint: Annotated[str, setting(
        "client endpoint to bind (ipc:///path or tcp://HOST:PORT; default: a private ipc "
        "socket, printed)", "--endpoint", read_by="router")] = ""
    auth_dir: Annotated[str, setting(
        "CurveZMQ for the router's clients (keys from 'radixlm keys DIR')", "--auth-dir",
        metavar="DIR", read_by="router")] = ""
    insecure: Annotated[bool, setting(
        "allow a non-loopback endpoint without --auth-dir", "--insecure",
        read_by="router")] = False
    routing_policy: Annotated[Literal["cache_aware", "round_robin"], _routing(
        "where new sessions, pins and plain requests go",
        "--routing-policy")] = _BALANCE.policy  # type: ignore[assignment]
    cache_threshold: Annotated[float, _routing(
        "a cached-prefix estimate must cover this fraction of a request to decide its "
        "replica", "--cache-threshold", ge=0, le=1)] = _BALANCE.cache_threshold
    balance_abs_tokens: Annotated[int, _routing(
        "replicas whose loads (in-flight tokens) differ by more than this...",
        "--balance-abs-tokens", ge=0)] = _BALANCE.abs_tokens
    balance_new_abs_tokens: Annotated[int, _routing(
        "...or than this, for a request that continues nothing sent before...",
        "--balance-new-abs-tokens", ge=0)] = _BALANCE.new_abs_tokens
    balance_rel: Annotated[float, _routing(
        "...and by more than this ratio are balanced: the least loaded replica gets new "
        "work", "--balance-rel", gt=0)] = _BALANCE.rel
    hot_pin_uses: Annotated[int, _routing(
        "sessions opened from a pin before it is placed on every replica", "--hot-pin-uses",
        ge=1)] = 8
    probe_interval_s: Annotated[float, setting(
        "a quiet replica is asked for stats this often", gt=0, read_by="router")] = 0.5
    replica_timeout_s: Annotated[float, setting(
        "a replica silent this long is taken out", "--replica-timeout", gt=0,
        metavar="SECONDS", read_by="router")] = 5.0
    rejoin_interval_s: Annotated[float, setting(
        "a down replica is dialled afresh at most this often", gt=0, read_by="router")] = 1.0
    start_timeout_s: Annotated[float, setting(
        "wait this long for the first replica", "--start-timeout", gt=0, metavar="SECONDS",
        read_by="router")] = 120.0
    max_message_bytes: Annotated[int, setting(
        "largest client frame (serve --replicas: its --max-message-bytes); 0 = no limit",
        ge=0, read_by="router")] = MAX_MESSAGE_BYTES

    @property
    def balance(self) -> Balance:
        """The routing rule's numbers (policy.py)."""
        return Balance(policy=self.routing_policy, cache_threshold=self.cache_threshold,
                       abs_tokens=self.balance_abs_tokens,
                       new_abs_tokens=self.balance_new_abs_tokens, rel=self.balance_rel)


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
