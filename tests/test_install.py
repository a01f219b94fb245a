"""The package installs as `radixlm` with a plain (non-editable) `pip install .` and
imports from any working directory — not only because the repo root is on sys.path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["cache", "tokenizer", "runtime", "sdk", "testing"]


@pytest.fixture(scope="module")
def plain_install(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(REPO)],
        check=True, capture_output=True, text=True, timeout=240,
    )
    (target.parent / "pip-output.txt").write_text(out.stdout + out.stderr)
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
    assert (plain_install / "radixlm" / "py.typed").is_file()  # type hints are public


def test_transformers_is_a_runtime_dependency_exactly_when_the_product_imports_it() -> None:
    """Tests use transformers as their reference; the package declares it as a runtime
    dependency only because (and as long as) one of its own modules imports it."""
    import ast
    from importlib.metadata import requires

    importers = []
    for path in sorted(REPO.glob("*.py")) + sorted(
            p for sub in SUBPACKAGES for p in (REPO / sub).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "transformers" for n in names):
                importers.append(path.relative_to(REPO))
    declared = [r for r in requires("radixlm") or [] if r.startswith("transformers")]
    runtime = [r for r in declared if "extra ==" not in r]
    assert bool(runtime) == bool(importers), (importers, declared)
    assert declared, "tests need transformers: `make install` must install it"


def test_the_build_is_quiet_and_ships_the_kernel_source(plain_install: Path) -> None:
    """Every folder with package data is a package of the configuration: no setuptools
    warning (it was 40 lines in `make demo`), and the C kernel's source is installed."""
    output = (plain_install.parent / "pip-output.txt").read_text()
    assert "absent from the `packages` configuration" not in output, output
    assert (plain_install / "radixlm" / "runtime" / "model" / "kernels" / "qmatmul.c").is_file()
