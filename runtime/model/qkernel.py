"""The quantized-matmul C kernel (`kernels/qmatmul.c`): compiled once per machine with the
system C compiler into the radixlm cache, loaded with ctypes.

`make install` builds it (`qkernel.build()`); otherwise the first
model loaded with quantized weights builds it (about a second). The library links the
same OpenMP runtime torch uses (`libgomp.so.1`, already loaded by torch), so
`torch.set_num_threads` sets the kernel's threads too.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import uuid
from functools import cache
from pathlib import Path

from .gguf_convert import cache_root

SOURCE = Path(__file__).with_name("kernels") / "qmatmul.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# Without AVX-512: the kernel's plain C path (tests compare it with the native build).
PORTABLE_CFLAGS = ("-O3", "-march=x86-64-v2", "-fopenmp", "-shared", "-fPIC", "-std=c11")


class KernelBuildError(RuntimeError):
    """The C kernel could not be compiled or loaded."""


def _cpu_flags() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("flags"):
                return line
    return platform.processor()


def library_path(cflags: tuple[str, ...] = CFLAGS, directory: Path | None = None) -> Path:
    """Where the compiled kernel for this source, these flags and this CPU lives."""
    key = SOURCE.read_bytes() + " ".join(cflags).encode() + _cpu_flags().encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return (directory or cache_root() / "kernels") / f"qmatmul-{digest}.so"


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
    cmd = [cc, *cflags, "-o", str(tmp), str(SOURCE), "-lm"]
    if verbose:
        print(" ".join(cmd))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise KernelBuildError(f"compiling {SOURCE.name} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


class Kernel:
    """Typed entry points of the loaded library (pointers passed as ints)."""

    def __init__(self, lib: ctypes.CDLL):
        i64, vp, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        u8p = vp
        self.q_matmul = lib.q_matmul
        self.q_matmul.argtypes = [vp, i64, i64, i64, u8p, vp, vp, c_int, i64, vp, i64, vp, c_int,
                                  vp]  # fmt: skip
        self.q_matmul.restype = None
        self.q_matmul_scratch_bytes = lib.q_matmul_scratch_bytes
        self.q_matmul_scratch_bytes.argtypes = [i64, i64]
        self.q_matmul_scratch_bytes.restype = i64
        self.q_dequant_rows = lib.q_dequant_rows
        self.q_dequant_rows.argtypes = [u8p, vp, vp, c_int, i64, vp, i64, vp]
        self.q_dequant_rows.restype = None
        self.q_repack = lib.q_repack
        self.q_repack.argtypes = [u8p, c_int, i64, i64, u8p, vp, vp]
        self.q_repack.restype = None
        self.q_unpack = lib.q_unpack
        self.q_unpack.argtypes = [u8p, vp, vp, c_int, i64, i64, u8p]
        self.q_unpack.restype = None
        self.has_vnni = bool(lib.kernel_has_vnni())
        self.decode_rows_work_floats = lib.decode_rows_work_floats
        self.decode_rows_work_floats.argtypes = [i64] * 6 + [vp]
        self.decode_rows_work_floats.restype = i64
        self.decode_rows = lib.decode_rows
        self.decode_rows.argtypes = [vp, i64, i64, i64, vp, vp, i64, i64, i64, i64,
                                     ctypes.c_float, vp, vp, vp, vp, vp]  # fmt: skip
        self.decode_rows.restype = c_int
        self.decode_work_floats = lib.decode_work_floats
        self.decode_work_floats.argtypes = [i64] * 6
        self.decode_work_floats.restype = i64
        self.decode_layers = lib.decode_layers
        self.decode_layers.argtypes = [vp, i64, i64, vp, vp, i64, i64, i64, i64, ctypes.c_float,
                                       vp, vp, vp, i64, vp]  # fmt: skip
        self.decode_layers.restype = c_int


@cache
def kernel() -> Kernel:
    """The kernel, built if needed (one load per process; a handle, not mutable state)."""
    import torch  # noqa: F401 - torch's libgomp must be loaded first so the kernel shares it

    path = build()
    try:
        return Kernel(ctypes.CDLL(str(path)))
    except OSError as e:
        raise KernelBuildError(f"loading {path} failed: {e}") from e
