"""The command lines speak their peers' spellings (vLLM, llama-server, SGLang), match
nothing by abbreviation, and read ``--http 8000`` as a port; `rl.Engine` errors name
keyword arguments; a context beyond the model's positions is refused unless allowed."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
from radixlm.runtime import cli
from radixlm.runtime.config import EngineConfig, context_length_for
from radixlm.runtime.http import main as http_main
from radixlm.runtime.http.config import HttpConfigError
from radixlm.sdk import repl
from radixlm.sdk.engine import keyword_words


def _serve(*flags: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *flags])


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["-m", "x.gguf"], "model", "x.gguf"),
    (["--model-path", "x.gguf"], "model", "x.gguf"),
    (["--max-model-len", "2048"], "context_length", 2048),
    (["--ctx-size", "2048"], "context_length", 2048),
    (["-c", "2048"], "context_length", 2048),
    (["-t", "3"], "threads", 3),
    (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
    (["-tp", "2"], "tensor_parallel_size", 2),  # vLLM
    (["--tp-size", "2"], "tensor_parallel_size", 2),  # SGLang
    (["--tp", "2"], "tensor_parallel_size", 2),
])
def test_the_peers_spellings_are_aliases(flags: list[str], field: str, value: object) -> None:
    assert getattr(cli.config_from_args(_serve(*flags)), field) == value


def test_host_and_port_are_the_http_api_s() -> None:
    args = _serve("--host", "0.0.0.0", "--port", "9000")
    assert (args.host, args.port, args.host_kv_tokens) == ("0.0.0.0", 9000, 0)  # not --host-kv-tokens
    assert http_main.http_listen(args) == ("0.0.0.0", 9000)
    assert http_main.http_listen(_serve()) == ("127.0.0.1", 8000)  # on by default, loopback
    assert http_main.http_listen(_serve("--http", "8000")) == ("127.0.0.1", 8000)  # a port
    assert http_main.http_listen(_serve("--http", "[::1]:0")) == ("::1", 0)
    assert http_main.http_listen(_serve("--no-http")) is None


@pytest.mark.parametrize("flags", [["--no-http", "--port", "1"], ["--http", "1", "--host", "h"]])
def test_contradicting_http_flags_are_refused(flags: list[str]) -> None:
    with pytest.raises(HttpConfigError):
        http_main.http_listen(_serve(*flags))


@pytest.mark.parametrize("argv", [
    ["serve", "--kv-tok", "512"], ["serve", "--host-kv", "5"], ["serve", "--ho", "0.0.0.0"],
    ["generate", "hi", "--max-tok", "3"], ["sessions", "--end", "ipc:///x"],
    ["top", "--onc"],
])
def test_no_flag_is_matched_by_abbreviation(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_the_repl_and_the_http_process_match_no_abbreviation() -> None:
    with pytest.raises(SystemExit):
        repl.build_parser().parse_args(["--max-tok", "3"])
    with pytest.raises(SystemExit):
        http_main.main(["--engine", "ipc:///x", "--htt", "1"])


def test_chat_and_generate_take_the_key_options() -> None:
    args = repl.build_parser().parse_args(["--server-key", "s.key", "--client-key", "c.key_secret"])
    assert (args.server_key, args.client_key) == ("s.key", "c.key_secret")
    gen = cli.build_parser().parse_args(["generate", "hi", "--raw"])
    assert gen.raw and gen.model is None  # no model named: a running server is looked for


@pytest.mark.parametrize(("server_says", "given", "user_reads"), [
    ("--kv-tokens 10 is below the smallest KV pool", {"kv_tokens": 10},
     "kv_tokens=10 is below the smallest KV pool"),
    ("--device cuda: no CUDA device here; use --device cpu", {"device": "cuda"},
     "device='cuda': no CUDA device here; use device cpu"),
    ("give --kv-tokens 256 or more", {}, "give kv_tokens 256 or more"),
    ("--session-ttl 5 is ...", {"session_ttl_s": 5}, "session_ttl_s=5 is ..."),
    ("argument --dtype: invalid choice: 'int3'", {}, "dtype: invalid choice: 'int3'"),
    ("argument --context-length/--max-model-len/--ctx-size/-c: invalid int value: 'x'", {},
     "context_length: invalid int value: 'x'"),
    ("unrecognized arguments: --kv-tokns 512", {}, "unknown keyword argument(s) kv_tokns"),
])
def test_engine_errors_name_keywords_not_flags(server_says: str, given: dict[str, object],
                                               user_reads: str) -> None:
    assert keyword_words(server_says, given).startswith(user_reads)


def test_a_context_beyond_the_model_is_refused_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    assert context_length_for(EngineConfig(), 2048) == 2048  # 0: the model's own
    assert context_length_for(EngineConfig(context_length=1024), 2048) == 1024
    with pytest.raises(ValueError, match="beyond the model's 2048 positions.*--allow-long-context"):
        context_length_for(EngineConfig(context_length=4096), 2048)
    with caplog.at_level(logging.WARNING):
        assert context_length_for(EngineConfig(context_length=4096, allow_long_context=True),
                                  2048) == 4096
    assert "beyond the model's 2048 positions" in caplog.text


def test_the_engine_applies_the_context_rule(tiny_model_dir: Path) -> None:
    from radixlm.runtime.engine.engine_main import build_engine

    config = EngineConfig(model=str(tiny_model_dir), device="cpu", kv_tokens=1024,
                          context_length=512)  # the tiny model has 256 positions
    with pytest.raises(ValueError, match="256 positions"):
        build_engine(config)
    import msgspec

    engine = build_engine(msgspec.structs.replace(config, allow_long_context=True))
    assert engine.ready.context_length == 512
