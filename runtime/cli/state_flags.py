"""``radixlm serve``'s state-directory flags (`EngineConfig`'s settings of its `STATE`
group): where sessions, pins, stored responses and KV outlive the server's processes
(runtime/state/; docs/deployment.md). A server keeps the user's state directory unless
told another (``--state-dir``) or none (``--no-state``)."""

from __future__ import annotations

import argparse

import msgspec
from radixlm.runtime.config import STATE, EngineConfig
from radixlm.runtime.settings import add_settings, settings_of
from radixlm.runtime.state.location import default_state_dir


def add_state_arguments(p: argparse.ArgumentParser) -> list[str]:
    """The state group's flags; returns the names of the settings added."""
    where = p.add_argument_group(STATE).add_mutually_exclusive_group()
    added = add_settings(p, EngineConfig, only=("state_dir",), into=where,
                         shown={"state_dir": str(default_state_dir())})
    where.add_argument("--no-state", action="store_true",
                       help="keep nothing: every session and stored response ends with the "
                            "server (an ephemeral server)")
    return added + add_settings(p, EngineConfig, skip=("state_dir",), only=[
        s.name for s in settings_of(EngineConfig) if s.declared.group == STATE])


def with_state(config: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """`config` with the state directory the flags of `args` say: none for --no-state (or
    a command without state flags), else --state-dir's, else the user's."""
    if getattr(args, "no_state", True):
        return msgspec.structs.replace(config, state_dir="")
    return msgspec.structs.replace(config, state_dir=config.state_dir or str(default_state_dir()))
