"""``radixlm serve``'s state-directory flags: where sessions, pins, stored responses and
KV outlive the server's processes (runtime/state/; docs/deployment.md)."""

from __future__ import annotations

import argparse

import msgspec
from radixlm.runtime.cli.engine_flags import non_negative_int, positive_float
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.state.location import default_state_dir


def add_state_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("state (what outlives disconnects, crashes and restarts)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--state-dir", default=None, metavar="DIR",
                       help="keep durable sessions, pins, the HTTP API's stored responses and "
                            "conversations, and a disk tier of KV here (made 0700; one server "
                            f"at a time) (default: {default_state_dir()}, from "
                            "$RADIXLM_STATE_DIR or $XDG_STATE_HOME)")
    where.add_argument("--no-state", action="store_true",
                       help="keep nothing: every session and stored response ends with the "
                            "server (an ephemeral server)")
    g.add_argument("--disk-kv-bytes", type=non_negative_int, default=0, metavar="BYTES",
                   help="bound of the disk KV tier; 0 = a tenth of the free space, at most "
                        "20 GiB (default: %(default)s)")
    g.add_argument("--durable-session-expiry", type=positive_float,
                   default=EngineConfig().durable_session_expiry_s, metavar="SECONDS",
                   help="a durable session nobody has resumed for this long is closed "
                        "(default: %(default)s, 30 days)")


def with_state(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """`config` with the state flags of `args` (no such flags: no state)."""
    if getattr(args, "no_state", True):
        return msgspec.structs.replace(config, state_dir="")
    return msgspec.structs.replace(
        config, state_dir=str(args.state_dir or default_state_dir()),
        disk_kv_bytes=args.disk_kv_bytes,
        durable_session_expiry_s=args.durable_session_expiry)
