"""The engine process's OpenMP waiting: passive by default (its threads share the cores
with the frontend and the clients), `--omp-wait-policy` to change it, and the user's own
OMP_WAIT_POLICY / GOMP_SPINCOUNT always win."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from radixlm.runtime import cli
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.server.environment import engine_environment

from tests.conftest import children_of, start_test_server


def test_engine_environment_defaults_to_passive_and_respects_the_users() -> None:
    assert engine_environment(EngineConfig(), {"PATH": "/bin"})["OMP_WAIT_POLICY"] == "passive"
    assert engine_environment(EngineConfig(omp_wait_policy="active"), {})["OMP_WAIT_POLICY"] == "active"
    assert "OMP_WAIT_POLICY" not in engine_environment(EngineConfig(omp_wait_policy="default"), {})
    mine = engine_environment(EngineConfig(), {"OMP_WAIT_POLICY": "ACTIVE"})
    assert mine["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "OMP_WAIT_POLICY" not in engine_environment(EngineConfig(), {"GOMP_SPINCOUNT": "1000"})


@pytest.mark.parametrize("flag,want", [("default", "default"), ("active", "active"), ("passive", "passive")])
def test_the_flag_reaches_the_config(flag: str, want: str) -> None:
    args = cli.build_parser().parse_args(["serve", "--omp-wait-policy", flag])
    assert cli.config_from_args(args).omp_wait_policy == want


def test_a_served_engine_runs_with_the_policy(tmp_path: Path, tiny_model_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with start_test_server(tmp_path, tiny_model_dir) as server:
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
