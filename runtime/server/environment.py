"""The environment a server's processes run in: OpenMP's waiting policy for the engine
(`engine_environment`), triton kept out where no GPU driver is (`keep_triton_out`), and
whether a device named by the user can run the engine here (`device_problem`)."""

from __future__ import annotations

import os
import sys

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
    torch (libgomp reads it once), hence here.

    Why passive by default: spinning OpenMP threads (between a step's parallel regions,
    and while idle) only pay when each thread owns a core; the engine shares them with its
    frontend, its clients and whatever else runs. (The fused decode step's own barriers
    spin briefly whatever this says: kernels/qmatmul.c, `team_wait`.)
    Measured on 2 cores (SmolLM2 Q4_1, batch-1 decode, tok/s): quiet machine, libgomp's
    default 88-97 vs passive 78-90 (within run-to-run noise); with one other busy
    process, 21-27 vs 48-55."""
    env = dict(os.environ if base is None else base)
    policy = config.omp_wait_policy
    if policy != "default" and "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["OMP_WAIT_POLICY"] = policy
    return env
