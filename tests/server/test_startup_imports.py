"""Start-up stays light: what `radixlm serve` and its engine import on the way to "ready"
leaves out what only some requests need (the SDK, package metadata, the tokenizer stack in
the launching process; xgrammar and transformers in the engine, loaded with the first
grammar), and `import radixlm as rl` still gives every SDK name on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _imported(code: str, names: tuple[str, ...]) -> list[str]:
    probe = f"import sys\n{code}\nprint(','.join(m for m in {names!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300, check=True).stdout.strip()
    return [m for m in out.split(",") if m]


def test_the_serve_command_imports_neither_the_sdk_nor_the_tokenizer_stack() -> None:
    code = "import radixlm.runtime.cli, radixlm.runtime.cli.serve, radixlm.runtime.server.launcher"
    heavy = ("radixlm.sdk", "anyio", "importlib.metadata", "jinja2", "tokenizers", "torch",
             "radixlm.runtime.frontend.main", "uvicorn")
    assert _imported(code, heavy) == []


def test_the_engine_loads_grammar_machinery_only_with_the_first_grammar() -> None:
    code = "sys.modules['triton'] = None\nimport radixlm.runtime.engine.engine_main"
    assert _imported(code, ("xgrammar", "transformers", "radixlm.sdk", "anyio")) == []
    # (that grammars still compile, importing xgrammar then, is test_grammar_unit's part)


def test_the_package_gives_the_sdk_names_on_first_use() -> None:
    import radixlm as rl
    from radixlm import sdk

    assert rl.Engine is sdk.Engine and rl.connect is sdk.connect
    assert rl.__all__ == sdk.__all__
    assert set(sdk.__all__) <= set(dir(rl))
    namespace: dict[str, object] = {}
    exec("from radixlm import *", namespace)  # noqa: S102 - the star import's names
    assert set(sdk.__all__) <= set(namespace)
    assert isinstance(rl.__version__, str) and rl.__version__
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = rl.no_such_name  # type: ignore[attr-defined]
