"""The quantized-matmul C kernel (`kernels/*.c`): compiled once per machine with the system C
compiler into the radixlm cache, loaded with ctypes.

`make install` builds it (`python -m radixlm.runtime.model.qkernel`), so a server's start
only loads it; if it is missing (a new CPU, an edited source, a cleared cache) the first
model loaded with quantized weights builds it, and says so in the log (a few seconds).
The library links the same OpenMP runtime torch uses (`libgomp.so.1`, already loaded by
torch), so `torch.set_num_threads` sets the kernel's threads too.

`RADIXLM_KERNEL=portable` loads the plain-C build (no AVX2) instead of the native one:
the path machines without AVX2 take, kept testable on any x86 machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
import uuid
from functools import cache
from pathlib import Path

from .gguf_convert import cache_root

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).with_name("kernels")
SOURCES = tuple(KERNEL_DIR / n for n in ("qmatmul.c", "gemm8.c", "decode.c", "moe_step.c", "attend.c",
                                         "rotary.c"))
HEADERS = tuple(KERNEL_DIR / n for n in ("common.h", "team.h", "vec.h", "moe_step.h"))
_BASE = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
CFLAGS = ("-march=native", *_BASE)
# The portable path: plain C, no AVX2 (on x86 the x86-64-v2 baseline, elsewhere the default).
PORTABLE_CFLAGS = (("-march=x86-64-v2",) if platform.machine() in ("x86_64", "AMD64") else ()) + _BASE
ENV_SWITCH = "RADIXLM_KERNEL"  # "portable": load the plain-C build
BUILD_TIMEOUT_S = 300  # one build, all its compilers


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded."""


def _cpu_flags() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("flags"):
                return line
    return platform.processor()


def library_path(cflags: tuple[str, ...] = CFLAGS, directory: Path | None = None) -> Path:
    """Where the compiled kernel for these sources, these flags and this CPU lives."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    h.update(" ".join(cflags).encode() + _cpu_flags().encode())
    return (directory or cache_root() / "kernels") / f"qmatmul-{h.hexdigest()[:16]}.so"


def build(verbose: bool = False, cflags: tuple[str, ...] = CFLAGS,
          directory: Path | None = None) -> Path:
    """Compile the kernel unless this exact build exists; atomic (temp file + rename)."""
    target = library_path(cflags, directory)
    if target.exists():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise KernelBuildError(
            "quantized weights need a C compiler (cc/gcc) to build their kernel; install gcc"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    objs = tmp.with_name(tmp.name + ".o")  # a directory of the sources' objects
    objs.mkdir()
    try:
        _compile_each(cc, cflags, objs, verbose)
        _link(cc, cflags, objs, tmp, verbose)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(objs, ignore_errors=True)
    return target


def _compile_each(cc: str, cflags: tuple[str, ...], objs: Path, verbose: bool) -> None:
    """Every source to its object in `objs`, as many compilers at once as there are CPUs:
    on 2 cores a build takes ~7 s instead of ~13 (qmatmul.c alone is about half of it)."""
    jobs = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    todo = list(SOURCES)
    running: list[tuple[subprocess.Popen[bytes], Path]] = []
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    try:
        while todo or running:
            while todo and len(running) < jobs:
                src = todo.pop(0)
                cmd = [cc, *cflags, "-c", "-o", str(objs / f"{src.stem}.o"), str(src)]
                if verbose:
                    print(" ".join(cmd))
                log_path = objs / f"{src.stem}.log"  # (a file, not a pipe: nothing blocks on it)
                with open(log_path, "wb") as err:
                    running.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err), log_path))
            finished = [r for r in running if r[0].poll() is not None]
            for proc, log_path in finished:
                running.remove((proc, log_path))
                if proc.returncode != 0:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise KernelBuildError(f"compiling the kernel failed:\n{tail}")
            if time.monotonic() > deadline:
                raise KernelBuildError(f"compiling the kernel took over {BUILD_TIMEOUT_S} s")
            if not finished:  # (a slot just freed starts the next source at once)
                time.sleep(0.02)
    finally:
        for proc, _ in running:
            proc.kill()
            proc.wait()


def _link(cc: str, cflags: tuple[str, ...], objs: Path, out: Path, verbose: bool) -> None:
    """The sources' objects in `objs` linked into the library `out`."""
    cmd = [cc, *cflags, "-o", str(out), *(str(objs / f"{src.stem}.o") for src in SOURCES), "-lm"]
    if verbose:
        print(" ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise KernelBuildError(f"linking the kernel failed:\n{done.stderr[-2000:]}")


G8_PLAIN, G8_GLU, G8_NORM = 0, 1, 2  # q_gemm8_input's kinds (kernels/common.h, g8input)


class Kernel:
    """Typed entry points of the loaded library (pointers passed as ints)."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        i64, vp, c_int, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self.path = path

        def fn(name: str, args: list, res=None):
            f = getattr(lib, name)
            f.argtypes, f.restype = args, res
            return f

        # products and dequantization read a matrix as tiles of 8 rows (q_pack, once)
        self.q_matmul = fn("q_matmul", [vp, i64, i64, i64, vp, c_int, i64, vp, i64, vp, c_int, vp])
        # a matrix of row blocks of several types: desc {rows, qtype, tiles} per part
        self.q_matmul_parts = fn("q_matmul_parts", [vp, i64, i64, i64, vp, c_int, vp, i64, vp, c_int, vp])
        # ... with the rows from which activations are int8 (gemm8.c) as the last argument
        self.q_matmul_rows = fn("q_matmul_rows", [vp, i64, i64, i64, vp, c_int, vp, i64, vp, c_int, vp, i64])
        # in(x) @ W^T with int8 activations, in() formed as each row is quantized: G8_GLU
        # (rows [gate | up]: silu(gate) * up, a prefill's MLP), G8_NORM (RMS norm times a weight)
        self.q_gemm8_input = fn("q_gemm8_input", [vp, i64, i64, i64, vp, c_int, vp, i64, vp, c_int, c_int, vp,
                                                  f32, vp])  # fmt: skip
        self.q_matmul_scratch_bytes = fn("q_matmul_scratch_bytes", [i64, i64], i64)
        self.q_matmul_scratch_bytes8 = fn("q_matmul_scratch_bytes8", [i64, i64, c_int], i64)
        self.gemm8_min_rows = int(fn("q_gemm8_min_rows", [], i64)())  # from here: int8 activations
        outlier_rms = fn("gemm8_outlier_rms", [c_int], f32)  # int8 rows keep values above this x RMS exact
        self.gemm8_outlier_rms = float(outlier_rms(G8_PLAIN))
        self.gemm8_outlier_rms_glu = float(outlier_rms(G8_GLU))  # (SiLU(gate) x up formed in the product)
        # prefill attention (attend.c; AVX-512 builds, else attend_supported 0)
        self.attend_supported = bool(fn("attend_supported", [], c_int)())
        self.attend_prefill = fn("attend_prefill", [vp, i64, i64, i64, i64, i64, vp, vp, i64, i64, c_int, vp,
                                                    i64, i64, i64, f32, vp], c_int)  # fmt: skip
        # a prefill's q / k heads rotated in place (rotary.c; 0: head dim not supported)
        self.rope_rows = fn("rope_rows", [vp, i64, i64, i64, i64, vp, vp, i64, vp, f32], c_int)
        self.block_elems = fn("block_elems", [c_int], c_int)
        self.q_tiled_bytes = fn("q_tiled_bytes", [c_int, i64, i64], i64)
        self.q_pack = fn("q_pack", [vp, c_int, i64, i64, vp])
        self.q_unpack_rows = fn("q_unpack_rows", [vp, c_int, i64, i64, vp])
        self.q_dequant_rows = fn("q_dequant_rows", [vp, c_int, i64, vp, i64, vp])
        self.q_gather_rows = fn("q_gather_rows", [vp, c_int, i64, i64, vp])
        self.simd = int(fn("kernel_simd", [], c_int)())  # 2: AVX2 + FMA + F16C, 0: plain C
        self.kq_unit = int(fn("q_kq_unit", [], c_int)())  # bytes of a K-quant code unit (common.h)
        self.decode_rows_work_floats = fn("decode_rows_work_floats", [i64] * 6 + [vp], i64)
        self.decode_rows = fn("decode_rows", [vp, i64, i64, i64, vp, vp, c_int, i64, i64, i64, i64,
                                              f32, vp, vp, vp, vp, vp], c_int)  # fmt: skip
        self.decode_work_floats = fn("decode_work_floats", [i64] * 6, i64)
        self.moe_work_floats = fn("moe_work_floats", [i64] * 6, i64)
        self.moe_check = fn("moe_check", [vp, i64], c_int)
        # a step's embedding rows and RoPE factors (-1: an id outside the embedding)
        self.decode_inputs = fn("decode_inputs", [vp, c_int, i64, i64, vp, vp, i64, vp, vp, i64, i64, f32, vp, vp,
                                                  vp], c_int)  # fmt: skip
        self.decode_layers = fn("decode_layers", [vp, i64, i64, vp, vp, c_int, i64, i64, i64, i64,
                                                  f32, vp, vp, vp, i64, vp, vp, vp], c_int)  # fmt: skip


def load(path: Path) -> Kernel:
    """A kernel library at `path` (a build of these sources), loaded."""
    import torch  # noqa: F401 - torch's libgomp must be loaded first so the kernel shares it

    try:
        return Kernel(ctypes.CDLL(str(path)), path)
    except OSError as e:
        raise KernelBuildError(f"loading {path} failed: {e}") from e


@cache
def kernel() -> Kernel:
    """The kernel for this process: the cached build for this CPU (the native one, or the
    portable one under RADIXLM_KERNEL=portable), built first if it is missing."""
    choice = os.environ.get(ENV_SWITCH, "native")
    if choice not in ("native", "portable"):
        raise KernelBuildError(f"{ENV_SWITCH}={choice!r}: use 'native' or 'portable'")
    flags = PORTABLE_CFLAGS if choice == "portable" else CFLAGS
    path = library_path(flags)
    if not path.exists():
        t0 = time.perf_counter()
        log.warning("building the quantized-weight kernel into %s (make install builds it "
                    "ahead of time)", path.parent)  # fmt: skip
        build(cflags=flags)
        log.warning("kernel built in %.1f s", time.perf_counter() - t0)
    return load(path)


if __name__ == "__main__":  # make install: build this machine's kernel into the cache
    print(build(verbose="-v" in sys.argv[1:]))
