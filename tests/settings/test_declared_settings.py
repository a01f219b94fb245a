"""Every setting is declared once (`radixlm.runtime.settings`) and everything else is
derived from that declaration: each has help and a default its own rule takes; a value
given as a flag (each spelling of it) or as an `rl.Engine` keyword arrives in the config
the child process decodes from its spec; a value the rule refuses is refused on the
command line, by the config and by the child; and the copies that once held the same
defaults and rules (the scheduler's options, the HTTP and router configs, the CLI) read
them from the declaration. No model is loaded."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from radixlm.runtime import cli, protocol
from radixlm.runtime.config import Endpoints, EngineConfig
from radixlm.runtime.engine import policy
from radixlm.runtime.engine.options import SETTINGS, SchedulerOptions
from radixlm.runtime.http import convert
from radixlm.runtime.http import main as http_main
from radixlm.runtime.http.config import HttpConfig, HttpConfigError, HttpSpec
from radixlm.runtime.router.config import RouterConfig
from radixlm.runtime.server.spec import encode_spec, load_spec
from radixlm.runtime.settings import PROCESSES, Setting, SettingError, settings_of
from radixlm.sdk.engine import engine_flags

CONFIGS = (EngineConfig, HttpConfig, RouterConfig)
ALL = [(c, s) for c in CONFIGS for s in settings_of(c)]
FLAGGED = [s for s in settings_of(EngineConfig) if s.flag]
ENDPOINTS = Endpoints(client="ipc:///x/client", to_engine="ipc:///x/e", to_frontend="ipc:///x/f",
                      runtime_dir="/x")


def _ids(s: Setting) -> str:
    return s.name


def other_value(s: Setting) -> Any:
    """A value `s` takes that is not its default."""
    if s.kind is bool:
        return not s.default
    if s.choices is not None:
        return next(c for c in s.choices if c != s.default)
    if s.kind is str:
        return "/tmp/a-value"
    base = s.default if s.default is not None else 1
    for step in (1, 0.25, -1):
        value = s.kind(base + step) if s.kind is int else base + step
        if s.problem(value) is None and value != s.default:
            return value
    raise AssertionError(f"no other value for {s.name}")


def refused_value(s: Setting) -> Any | None:
    """A value of `s`'s kind that its rule refuses (None: it takes all of them)."""
    if s.choices is not None:
        return "not-a-choice"
    candidates = {int: [-1, 0, 70000], float: [-1.0, 0.0, 0.5, 1.5]}.get(s.kind, [])
    return next((v for v in candidates if s.problem(v) is not None), None)


def argv_for(s: Setting, value: Any, flag: str | None = None) -> list[str]:
    flag = flag or s.flag
    assert flag is not None
    return [flag] if value is True else [flag, str(value)]


def serve_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


def child_config(config: EngineConfig, tmp_path: Path) -> EngineConfig:
    """What a server's child reads: the spec file the launcher writes, through load_spec."""
    spec = tmp_path / "spec.json"
    spec.write_bytes(encode_spec(config, ENDPOINTS))
    loaded, endpoints = load_spec(spec)
    assert endpoints == ENDPOINTS
    return loaded


# -- the declarations ----------------------------------------------------------------------


@pytest.mark.parametrize(("config", "s"), ALL, ids=[f"{c.__name__}.{s.name}" for c, s in ALL])
def test_every_setting_has_help_a_default_it_takes_and_its_readers(config: type, s: Setting) -> None:
    assert len(s.declared.help) > 10, "a setting says what it does"
    assert s.problem(s.default) is None, f"the default {s.default!r} breaks its own rule"
    assert s.declared.read_by and PROCESSES.issuperset(s.declared.read_by)
    assert getattr(config, "__struct_fields__", None) and s.name in config.__struct_fields__


def test_each_flag_spells_one_setting() -> None:
    for config in CONFIGS:
        flags = [f for s in settings_of(config) for f in s.declared.flags]
        assert len(flags) == len(set(flags)), config


# serve's own defaults: host and port None ("not given", which tells the default address
# from an asked one); the state directory the user's, unless --no-state (with_state).
SERVE_S_OWN = ("host", "port", "state_dir")


def test_the_parser_s_defaults_are_the_declared_ones() -> None:
    args = serve_args()
    for s in FLAGGED + [s for s in settings_of(HttpConfig) if s.flag]:
        if hasattr(args, s.name) and s.name not in SERVE_S_OWN:
            assert getattr(args, s.name) == s.default, s.name
    assert cli.config_from_args(args) == EngineConfig()


def test_serve_keeps_the_user_s_state_directory_unless_told_otherwise(
        capsys: pytest.CaptureFixture[str]) -> None:
    from radixlm.runtime.cli.state_flags import with_state
    from radixlm.runtime.state.location import default_state_dir

    def state_dir(*argv: str) -> str:
        args = serve_args(*argv)
        return with_state(cli.config_from_args(args), args).state_dir

    assert state_dir() == str(default_state_dir())
    assert state_dir("--state-dir", "/tmp/s") == "/tmp/s"
    assert state_dir("--no-state") == ""
    with pytest.raises(SystemExit):
        serve_args("--state-dir", "/tmp/s", "--no-state")
    assert "not allowed with argument" in capsys.readouterr().err


# -- a value given reaches the process that reads it ----------------------------------------


@pytest.mark.parametrize("s", FLAGGED, ids=_ids)
def test_a_flag_given_to_serve_arrives_in_the_engine_s_config(s: Setting, tmp_path: Path) -> None:
    value = other_value(s)
    for flag in s.declared.flags:  # every spelling: the peers' aliases too
        config = cli.config_from_args(serve_args(*argv_for(s, value, flag)))
        assert getattr(config, s.name) == value, flag
        assert getattr(child_config(config, tmp_path), s.name) == value
        untouched = cli.config_from_args(serve_args())
        others = {n for n in EngineConfig.__struct_fields__ if n != s.name}
        assert all(getattr(config, n) == getattr(untouched, n) for n in others)


@pytest.mark.parametrize("s", FLAGGED, ids=_ids)
def test_an_engine_keyword_becomes_the_same_flag(s: Setting, tmp_path: Path) -> None:
    """rl.Engine(**{keyword: value}) starts `radixlm serve` with `engine_flags`."""
    value = other_value(s)
    for keyword in s.keywords:
        argv = engine_flags({keyword: value})
        assert argv == argv_for(s, value)
        assert getattr(child_config(cli.config_from_args(serve_args(*argv)), tmp_path),
                       s.name) == value


def through_spec(config: HttpConfig) -> HttpConfig:
    """What the HTTP child reads: the spec start_http writes to its stdin."""
    spec = HttpSpec(config, parent_pid=1, log_level="info", fd=3)
    return http_main.load_http_spec(msgspec.json.encode(spec)).config


def http_alone(*argv: str) -> argparse.Namespace:
    """``python -m radixlm.runtime.http``'s flags, attaching to a running server."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    http_main.add_http_arguments(parser)
    return parser.parse_args(["--http", "127.0.0.1:1", *argv])


@pytest.mark.parametrize("s", [s for s in settings_of(HttpConfig) if s.flag], ids=_ids)
def test_an_http_flag_arrives_in_the_http_process_s_spec(s: Setting) -> None:
    value = "::1" if s.name == "host" else other_value(s)  # (another host needs a key)
    if hasattr(serve_args(), s.name):  # radixlm serve: its HTTP child
        args = serve_args(*argv_for(s, value))
        listen = http_main.http_listen(args)
        assert listen is not None
        config = through_spec(http_main.http_config(args, "ipc:///x", listen=listen))
        assert getattr(config, s.name) == value
    if s.name not in ("host", "port"):  # (there: --http HOST:PORT)
        config = through_spec(http_main.http_config(http_alone(*argv_for(s, value)), "ipc:///x"))
        assert getattr(config, s.name) == value


def test_serve_s_http_child_is_given_one_typed_spec() -> None:
    from radixlm.runtime.http.launch import child_command

    assert child_command()[-1] == http_main.SPEC_FLAG  # no other flag: all in the spec
    config = http_main.http_config(serve_args("--api-key", "k1", "--max-tools", "3"), "ipc:///e",
                                   listen=("127.0.0.1", 9))
    spec = http_main.load_http_spec(msgspec.json.encode(HttpSpec(config, 7, "debug", 5)))
    assert spec == HttpSpec(config, 7, "debug", 5) and spec.config.api_keys == ("k1",)


@pytest.mark.parametrize("s", [s for s in settings_of(RouterConfig) if s.flag], ids=_ids)
def test_a_router_flag_arrives_in_the_router_s_config(s: Setting) -> None:
    from radixlm.runtime.router.cli import add_router_arguments

    value = other_value(s)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_router_arguments(parser)
    args = parser.parse_args(["--replica", "ipc:///r", *argv_for(s, value)])
    assert getattr(cli.config_from_args(args, RouterConfig), s.name) == value
    if hasattr(serve_args(), s.name):  # serve --replicas: the routing flags, and serve's own
        assert getattr(cli.config_from_args(serve_args(*argv_for(s, value)), RouterConfig),
                       s.name) == value


def test_the_routing_settings_are_the_router_s_balance() -> None:
    config = RouterConfig(routing_policy="round_robin", cache_threshold=0.25,
                          balance_abs_tokens=7, balance_new_abs_tokens=3, balance_rel=2.0)
    assert dataclasses.astuple(config.balance) == ("round_robin", 0.25, 7, 3, 2.0)
    assert RouterConfig().balance == type(config.balance)()  # the defaults are policy.py's


# -- a value refused is refused everywhere ---------------------------------------------------


REFUSABLE = [(c, s) for c, s in ALL if refused_value(s) is not None]


@pytest.mark.parametrize(("config", "s"), REFUSABLE,
                         ids=[f"{c.__name__}.{s.name}" for c, s in REFUSABLE])
def test_a_refused_value_is_refused_by_the_config_and_by_a_child(config: type, s: Setting) -> None:
    bad = refused_value(s)
    required = {"engine_endpoint": "ipc:///x"} if config is HttpConfig else {}
    with pytest.raises(HttpConfigError if config is HttpConfig else SettingError,
                       match=f"{s.spelled} must be"):
        config(**required, **{s.name: bad})
    data = json.dumps({**required, s.name: bad}).encode()
    with pytest.raises(msgspec.ValidationError):  # a spec holding it: the child refuses it
        msgspec.json.decode(data, type=config)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from radixlm.runtime.router.cli import add_router_arguments

    router = argparse.ArgumentParser(allow_abbrev=False)
    add_router_arguments(router)
    http = argparse.ArgumentParser(allow_abbrev=False)
    http_main.add_http_arguments(http)
    commands = cli.build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    return {"serve": commands["serve"], "generate": commands["generate"], "router": router,
            "http": http}


FLAGGED_REFUSABLE = [s for _, s in REFUSABLE if s.flag]


@pytest.mark.parametrize("s", FLAGGED_REFUSABLE,
                         ids=[f"{s.name}-{i}" for i, s in enumerate(FLAGGED_REFUSABLE)])
def test_a_command_refuses_a_bad_value_naming_its_flag(s: Setting,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    having = {name: parser for name, parser in _parsers().items()
              if any(s.flag in a.option_strings and a.dest == s.name for a in parser._actions)}
    assert having, f"no command has {s.flag}"
    for parser in having.values():
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*(["hi"] if parser.prog.endswith("generate") else []),
                               str(s.flag), str(refused_value(s))])
        assert exit_.value.code == 2
        assert f"argument {s.declared.flags[0]}" in capsys.readouterr().err


# -- no default or rule written twice ---------------------------------------------------------


def test_the_scheduler_s_knobs_are_the_engine_settings() -> None:
    """SchedulerOptions holds no default or rule of its own for a setting: its defaults
    are the declared ones, a config's values all arrive, the declared rule refuses."""
    declared = {s.name: s for s in settings_of(EngineConfig)}
    fields = {f.name for f in dataclasses.fields(SchedulerOptions)}
    derived = {"context_length"}  # the served context: context_length_for(config, model)
    assert not (fields & set(declared)) - set(SETTINGS.values()) - derived, "not mapped"
    mine, default = SchedulerOptions(), EngineConfig()
    for option, name in SETTINGS.items():
        assert getattr(mine, option) == getattr(default, name)
    changed = EngineConfig(**{n: other_value(declared[n]) for n in SETTINGS.values()})
    options = SchedulerOptions.from_config(changed, 100)
    for option, name in SETTINGS.items():
        assert getattr(options, option) == getattr(changed, name)
        bad = refused_value(declared[name])
        with pytest.raises(ValueError, match=option):
            SchedulerOptions(**{option: bad})


def test_shared_values_are_one_value() -> None:
    engine, http, router = EngineConfig(), HttpConfig(""), RouterConfig()
    assert http.drain_timeout_s == engine.drain_timeout_s
    assert router.max_message_bytes == engine.max_message_bytes
    assert convert.MAX_N is protocol.MAX_N
    schedule = next(s for s in settings_of(EngineConfig) if s.name == "schedule_policy")
    assert schedule.choices == policy.POLICIES


# -- what a user reads ------------------------------------------------------------------------


def test_serve_s_help_shows_every_setting_its_help_and_default(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping (argparse breaks at hyphens)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    serve_has = set(vars(serve_args()))  # (a setting of two configs: the first's flag)
    for config in CONFIGS:
        for s in settings_of(config):
            if not s.flag or s.name not in serve_has:
                continue
            serve_has.remove(s.name)
            assert all(f in shown for f in s.declared.flags), s.name
            assert " ".join(s.declared.help.split()) in shown, s.name
            if s.kind is not bool and s.default not in ("", None) and s.name not in SERVE_S_OWN:
                assert f"{s.declared.help.split()[-1]} (default: {s.default})" in shown, s.name


@pytest.mark.parametrize(("argv", "says"), [
    (["--max-running", "0"], "argument --max-running: must be >= 1, got 0"),
    (["--kv-memory-fraction", "2"], "argument --kv-memory-fraction: must be in (0, 1], got 2"),
    (["--fair-step-factor", "0.5"], "must be 0 (off) or >= 1, got 0.5"),
    (["--program-quantum", "0"], "argument --program-quantum: must be >= 1, got 0"),
    (["--program-starve", "0"], "argument --program-starve: must be > 0, got 0"),
    (["--threads", "x"], "argument -t/--threads: invalid int value: 'x'"),
    (["--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
    (["--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
])
def test_a_refusal_says_which_flag_and_why(argv: list[str], says: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serve_args(*argv)
    assert says in capsys.readouterr().err
    with pytest.raises(SettingError, match=r"--max-running must be an integer, got 2\.5"):
        EngineConfig(max_running=2.5)  # type: ignore[arg-type]
