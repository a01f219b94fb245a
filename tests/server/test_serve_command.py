"""The `radixlm` CLI's parser: every flag documented, flags become the EngineConfig."""

from __future__ import annotations

import argparse

import pytest
from radixlm.runtime import cli
from radixlm.runtime.cli import commands
from radixlm.runtime.config import EngineConfig


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_flag_has_help_text() -> None:
    parser = cli.build_parser()
    commands = _subparsers(parser)
    assert {"serve", "generate", "sessions", "protocol-schema", "chat"} <= set(commands)
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"radixlm {name}: {action.option_strings or action.dest} has no help"


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"radixlm {version('radixlm')}"


def test_flags_build_the_engine_config() -> None:
    args = cli.build_parser().parse_args([
        "serve", "--model", "m.gguf", "--endpoint", "tcp://127.0.0.1:7000", "--device", "cpu",
        "--dtype", "bfloat16", "--attention", "torch", "--page-size", "16", "--kv-tokens", "8192",
        "--kv-memory-fraction", "0.25", "--schedule-policy", "fcfs", "--max-running", "8",
        "--chunked-prefill", "512", "--context-length", "1024", "--retained-cap", "4096",
        "--session-ttl", "30", "--host-kv-tokens", "65536", "--threads", "2",
        "--log-level", "debug", "--seed", "7",
    ])
    expected = EngineConfig(
        model="m.gguf", endpoint="tcp://127.0.0.1:7000", device="cpu", dtype="bfloat16",
        attention="torch", page_size=16, kv_tokens=8192, kv_memory_fraction=0.25,
        schedule_policy="fcfs", max_running=8, chunked_prefill=512, context_length=1024,
        retained_cap=4096, default_session_ttl_s=30.0, host_kv_tokens=65536, threads=2,
        log_level="debug", seed=7,
    )
    assert cli.config_from_args(args, endpoint=args.endpoint) == expected


def test_defaults_are_the_config_defaults() -> None:
    args = cli.build_parser().parse_args(["serve"])
    assert cli.config_from_args(args) == EngineConfig()


@pytest.mark.parametrize("flags", [["--page-size", "0"], ["--kv-memory-fraction", "1.5"],
                                   ["--dtype", "int3"], ["--schedule-policy", "random"]])
def test_bad_flag_values_are_refused(flags: list[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", *flags])


def test_chat_without_the_sdk_repl(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(commands, "REPL_MODULE", "radixlm.sdk.no_such_repl_module")
    assert cli.main(["chat", "--help"]) == 2
    assert "no_such_repl_module" in capsys.readouterr().err
