"""Import boundaries. The frontend processes (the protocol frontend and the HTTP one) must
not import torch: they only tokenize, validate and route, and torch costs seconds of CPU at
every start; nor anything of the engine but its messages: the frontend speaks to it through
runtime/engine/wire.py (the engine's interface, torch-free) and the rules both share
(runtime/rules.py). The runtime never
imports the SDK (both use the neutral client transport), and the SDK never imports
torch."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import radixlm

# What the launcher's frontend role imports (child.child_main -> run_frontend).
_FRONTEND_IMPORTS = """
import sys
import radixlm.runtime.server.launcher
from radixlm.runtime.frontend import run_frontend
from radixlm.runtime.frontend import (clients, frames, main, prepare, replies, requests,
                                     server, streams, structured, tenants)
# The HTTP frontend is a protocol client like the SDK: it builds its app without them too.
from radixlm.runtime.http.app import build_app
from radixlm.runtime.http.config import HttpConfig
from radixlm.runtime.http import launch
build_app(HttpConfig(engine_endpoint="ipc:///nonexistent"))
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
# The engine's messages (engine/wire.py) are its interface; nothing else of it.
heavy += sorted(m for m in sys.modules if m.startswith("radixlm.runtime.engine.")
                and m != "radixlm.runtime.engine.wire")
print(",".join(heavy))
"""


def test_frontend_imports_no_torch() -> None:
    result = subprocess.run([sys.executable, "-c", _FRONTEND_IMPORTS], capture_output=True,
                            text=True, timeout=120, check=True)
    assert result.stdout.strip() == "", f"the frontend imported: {result.stdout.strip()}"


def test_sampling_reexports_the_torch_free_validation() -> None:
    from radixlm.runtime import rules
    from radixlm.runtime.engine import sampling

    assert sampling.validate_sampling is rules.validate_sampling
    assert sampling.MAX_TOP_LOGPROBS == rules.MAX_TOP_LOGPROBS


# -- who may import whom (DESIGN.md's layout), read from the source --------------------------
# Statically, so an import inside a function (run only on some path) counts as well; a
# module named in a string (importlib, runpy) counts too.

PACKAGE_ROOT = Path(radixlm.__file__).resolve().parent
# The engine side never reaches the SDK; only the CLI entry point hands `radixlm chat` to it.
SDK_FREE = ("runtime/engine", "runtime/frontend", "runtime/http", "runtime/transport")
CLI_ENTRY = "runtime/cli/commands.py"


def _module_name(path: Path) -> str:
    parts = ["radixlm", *path.relative_to(PACKAGE_ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, and of every string
    constant that names a radixlm module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Constant) and _names_a_module(node.value):
            found.append((node.lineno, node.value))
    return found


def _names_a_module(value: object) -> bool:
    """A string that is the dotted name of one of our modules (not a docstring, not a
    logger name like "radixlm.http")."""
    if not (isinstance(value, str) and re.fullmatch(r"radixlm(\.\w+)+", value)):
        return False
    try:
        return importlib.util.find_spec(value) is not None
    except ModuleNotFoundError:
        return False


def _sources(folder: str) -> list[Path]:
    return sorted((PACKAGE_ROOT / folder).rglob("*.py"))


def _offences(files: list[Path], bad: Callable[[str], bool]) -> list[str]:
    return [f"{path.relative_to(PACKAGE_ROOT)}:{line} {name}"
            for path in files for line, name in _imported(path) if bad(name)]


def _is_sdk(name: str) -> bool:
    return name == "radixlm.sdk" or name.startswith("radixlm.sdk.")


def test_the_runtime_never_imports_the_sdk() -> None:
    files = [p for p in _sources("runtime") if p.relative_to(PACKAGE_ROOT).as_posix() != CLI_ENTRY]
    assert all(any(p.relative_to(PACKAGE_ROOT).as_posix().startswith(f) for p in files)
               for f in SDK_FREE)  # the folders exist (a rename must not empty this test)
    assert _offences(files, _is_sdk) == []


def test_the_import_scan_sees_every_form() -> None:
    """The scan the boundary tests rely on finds plain, from-, relative, lazy and string
    imports (a scan that missed one would pass on anything)."""
    sample = PACKAGE_ROOT / "runtime" / "http" / "app.py"
    names = {name for _, name in _imported(sample)}
    assert "radixlm.runtime.http.engine_link.EngineLink" in names
    cli = {name for _, name in _imported(PACKAGE_ROOT / CLI_ENTRY)}
    assert "radixlm.sdk.repl" in cli  # a string naming a module
    model = {name for _, name in _imported(PACKAGE_ROOT / "runtime" / "model" / "runner.py")}
    assert "radixlm.runtime.model.batch.ForwardBatch" in model  # `from .batch import ...`
    lazy = {name for _, name in _imported(PACKAGE_ROOT / CLI_ENTRY)}
    assert "radixlm.runtime.cli.serve.run_serve" in lazy  # inside a function


def test_the_transport_imports_only_the_protocol() -> None:
    """The neutral client transport (the SDK's and the HTTP server's) imports the protocol
    and itself of ours, and never torch."""
    allowed = ("radixlm.runtime.protocol", "radixlm.runtime.transport")

    def bad(name: str) -> bool:
        if name.split(".")[0] in ("torch", "numpy", "transformers"):
            return True
        return name.startswith("radixlm") and not any(
            name == a or name.startswith(a + ".") for a in allowed)

    assert _offences(_sources("runtime/transport"), bad) == []


def test_the_sdk_imports_the_protocol_and_the_transport_only() -> None:
    """... and, for `rl.Engine`, which starts a server process, the torch-free waits on
    child processes, their exit reasons and the start-up spinner (runtime/server/), and
    the declarations of the settings it takes as keywords (runtime/settings.py)."""
    allowed = ("radixlm.runtime.protocol", "radixlm.runtime.transport", "radixlm.sdk",
               "radixlm.runtime.server.children", "radixlm.runtime.server.exits",
               "radixlm.runtime.server.progress", "radixlm.testing", "radixlm.runtime.settings",
               "radixlm.runtime.config", "radixlm.runtime.http.config")
    files = [*_sources("sdk"), *_sources("testing")]

    def bad(name: str) -> bool:
        if name == "radixlm.runtime":  # `from radixlm.runtime import protocol`
            return False
        return name.startswith("radixlm.") and not any(
            name == a or name.startswith(a + ".") for a in allowed)

    offences = _offences(files, bad)
    # The stub's `from radixlm.runtime import protocol as p` is the protocol; rl.Engine
    # runs `python -m radixlm.runtime.cli serve` (a process it starts, not an import).
    expected = re.compile(r"testing/\w+\.py radixlm\.runtime\.protocol|"
                          r"sdk/engine\.py radixlm\.runtime\.cli")
    assert {o for o in offences if not expected.fullmatch(re.sub(r":\d+ ", " ", o))} == set()


_SDK_IMPORTS = """
import importlib, pkgutil, sys
import radixlm as rl
import radixlm.sdk, radixlm.runtime.transport, radixlm.testing
for pkg in (radixlm.sdk, radixlm.runtime.transport):
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{info.name}")
rl.AsyncClient("ipc:///nonexistent")
heavy = sorted(m for m in ("torch", "transformers", "radixlm.runtime.engine",
                           "radixlm.runtime.model", "radixlm.cache") if m in sys.modules)
print(",".join(heavy))
"""


def test_the_sdk_imports_no_torch() -> None:
    """`import radixlm` (the SDK) and every module of it and of the transport load without
    torch, transformers or the engine's packages."""
    result = subprocess.run([sys.executable, "-c", _SDK_IMPORTS], capture_output=True,
                            text=True, timeout=120, check=True)
    assert result.stdout.strip() == "", f"the SDK imported: {result.stdout.strip()}"
