"""The engine process's OpenMP waiting: by default passive where decode runs the fused C
step (its threads share the cores with the frontend and the clients), OpenMP's own where the
model runs op by op (read from the model's header, independently of the loader: gguf-py
writes the headers here); `--omp-wait-policy` to change it, and the user's own
OMP_WAIT_POLICY / GOMP_SPINCOUNT always win."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest
from radixlm.runtime import cli
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.server.environment import engine_environment, fused_decode_expected

from tests.conftest import children_of, start_test_server


def test_engine_environment_defaults_to_passive_and_respects_the_users() -> None:
    # the default model (SmolLM2 Q4_1: Llama) decodes with the fused step
    assert engine_environment(EngineConfig(), {"PATH": "/bin"})["OMP_WAIT_POLICY"] == "passive"
    assert engine_environment(EngineConfig(omp_wait_policy="active"), {})["OMP_WAIT_POLICY"] == "active"
    assert "OMP_WAIT_POLICY" not in engine_environment(EngineConfig(omp_wait_policy="default"), {})
    mine = engine_environment(EngineConfig(), {"OMP_WAIT_POLICY": "ACTIVE"})
    assert mine["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "OMP_WAIT_POLICY" not in engine_environment(EngineConfig(), {"GOMP_SPINCOUNT": "1000"})


def _gguf_header(path: Path, arch: str, experts: int = 0, vocab: int = 3000) -> Path:
    """A GGUF of metadata only, the tokenizer's arrays first (as gguf-py's writers may
    order them), then the architecture's keys."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_block_count(2)
    if experts:
        w.add_expert_count(experts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,experts,fused", [
    ("llama", 0, True), ("qwen2", 0, True), ("llama", 8, True),  # Mixtral: Llama with experts
    ("qwen3", 0, True), ("qwen3moe", 128, True), ("qwen2moe", 60, True), ("gemma3", 0, False),
    ("phi3", 0, False),
])
def test_auto_reads_the_gguf_header(tmp_path: Path, arch: str, experts: int, fused: bool) -> None:
    path = _gguf_header(tmp_path / "m.gguf", arch, experts)
    config = EngineConfig(model=str(path))
    assert fused_decode_expected(config) is fused
    assert ("OMP_WAIT_POLICY" in engine_environment(config, {})) is fused
    assert not fused_decode_expected(EngineConfig(model=str(path), dtype="float32"))
    assert not fused_decode_expected(EngineConfig(model=str(path), device="cuda"))
    folder = tmp_path / "holder"
    folder.mkdir()
    path.rename(folder / "m.gguf")  # a directory holding one GGUF
    assert fused_decode_expected(EngineConfig(model=str(folder))) is fused


def test_auto_on_hf_directories_and_unreadable_models(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert not fused_decode_expected(EngineConfig(model=str(tiny_model_dir)))  # float32 weights
    assert fused_decode_expected(EngineConfig(model=str(tiny_model_dir), dtype="int8"))
    assert fused_decode_expected(EngineConfig(model=str(tiny_model_dir), quantize="int4"))
    for bad in ("/nowhere/model.gguf", str(tmp_path)):  # missing; a folder without a model
        assert not fused_decode_expected(EngineConfig(model=bad, dtype="int8"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    assert not fused_decode_expected(EngineConfig(model=str(tmp_path / "junk.gguf")))


@pytest.mark.parametrize("flag,want", [("default", "default"), ("active", "active"), ("passive", "passive"),
                                       ("auto", "auto")])
def test_the_flag_reaches_the_config(flag: str, want: str) -> None:
    args = cli.build_parser().parse_args(["serve", "--omp-wait-policy", flag])
    assert cli.config_from_args(args).omp_wait_policy == want


def test_a_served_engine_runs_with_the_policy(tmp_path: Path, tiny_model_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with start_test_server(tmp_path, tiny_model_dir, "--dtype", "int8") as server:
        envs = {}
        for pid in children_of(server.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                role = f.read().split(b"\0")[3:4]
            with open(f"/proc/{pid}/environ", "rb") as f:
                envs[role[0].decode() if role else "?"] = dict(
                    e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        assert envs["engine"][b"OMP_WAIT_POLICY"] == b"passive"
        assert b"OMP_WAIT_POLICY" not in envs["frontend"]
        assert os.environ.get("OMP_WAIT_POLICY") is None
