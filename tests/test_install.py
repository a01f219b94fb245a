"""The package installs as `radixlm` with a plain (non-editable) `pip install .` and
imports from any working directory — not only because the repo root is on sys.path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["cache", "tokenizer", "runtime", "sdk"]


@pytest.fixture(scope="module")
def plain_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(REPO)],
        check=True, capture_output=True, timeout=240,
    )
    return target


def _python(code: str, pythonpath: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, "-I" if not pythonpath else "-s", "-c", code],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_plain_install_imports_every_module(plain_install: Path, tmp_path: Path) -> None:
    code = (
        "import importlib, pkgutil, radixlm\n"
        "mods = [m.name for m in pkgutil.walk_packages(radixlm.__path__, 'radixlm.')]\n"
        "for m in mods: importlib.import_module(m)\n"
        "print(radixlm.__file__); print(len(mods)); print(' '.join(sorted(radixlm.__all__)))\n"
    )
    out = _python(code, str(plain_install), tmp_path).splitlines()
    assert out[0].startswith(str(plain_install)), out[0]
    assert int(out[1]) > 20
    for name in ("function", "gen", "select", "Engine", "connect", "system", "user", "assistant"):
        assert name in out[2].split(), name
    installed = {p.name for p in (plain_install / "radixlm").iterdir()}
    assert set(SUBPACKAGES) <= installed
    assert not {"tests", "benchmarks", "examples"} & installed  # only the package ships


def test_repo_root_on_path_is_not_enough(tmp_path: Path) -> None:
    """With only the repo root on sys.path (no install), `radixlm` must not import: the
    suite cannot pass by accident of the working directory."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); import radixlm"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode != 0 and "No module named 'radixlm'" in out.stderr
