"""The engine's command-line flags, generated from `EngineConfig`'s declarations
(`radixlm.runtime.settings`), and `config_from_args`, the one place flags become a
frozen config. `radixlm serve`, `serve --replicas` and `radixlm generate -m` share them."""

from __future__ import annotations

import argparse
from typing import Any, TypeVar

from radixlm.runtime import settings
from radixlm.runtime.config import START_TIMEOUT_S, STATE, TRUST, EngineConfig
from radixlm.runtime.settings import Settings, add_settings, number, settings_of

C = TypeVar("C", bound=Settings)


def add_engine_arguments(p: argparse.ArgumentParser, *, serve: bool = True,
                         log_level: str | None = None, model_default: str | None = "default",
                         skip: tuple[str, ...] = ("endpoint",)) -> list[str]:
    """Every `EngineConfig` flag but those in `skip` (--endpoint's meaning depends on the
    command) and, but for `serve`, the state directory's and the client endpoint's; and
    --start-timeout. `model_default` None: the command tells whether --model was given.
    Returns the names of the settings added."""
    state, trust = ([s.name for s in settings_of(EngineConfig) if s.declared.group == group]
                    for group in (STATE, TRUST))
    defaults = {"model": model_default, **({"log_level": log_level} if log_level else {})}
    added = add_settings(p, EngineConfig, skip=(*skip, *state, *trust, "debug"),
                         defaults=defaults)
    p.add_argument("--start-timeout", type=number(float, gt=0), default=START_TIMEOUT_S,
                   metavar="SECONDS",
                   help="how long to wait for the server to load the model and become ready "
                        "(default: %(default)s)")
    added += add_settings(p, EngineConfig, only=("debug",))
    if serve:
        from radixlm.runtime.cli.state_flags import add_state_arguments

        added += add_state_arguments(p)
        added += add_settings(p, EngineConfig, only=trust, skip=skip)
    return added


def add_debug_argument(p: argparse.ArgumentParser) -> None:
    add_settings(p, EngineConfig, only=("debug",))


def config_from_args(args: argparse.Namespace, config_type: type[C] = EngineConfig,  # type: ignore[assignment]
                     **fixed: Any) -> C:
    """The frozen config (an `EngineConfig` unless `config_type` says otherwise) for
    parsed flags: the only place flags become config (`settings.config_from_args`)."""
    return settings.config_from_args(args, config_type, **fixed)
