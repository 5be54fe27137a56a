"""BF16 products for a frozen base through oneDNN's `dnnl_gemm_bf16bf16f32` (the library PyTorch's CPU
autocast computes with), loaded with ctypes from the `onednn-cpu-gomp` wheel.

C [M,N] = A [M,K] @ op(B) in float32, from bfloat16 operands (uint16 arrays of their bits, made by
native_ext.kernels.to_bf16): the products of two bfloat16 numbers are exact in float32 and oneDNN
accumulates them in float32, so a result differs from float32 arithmetic only by the operands' rounding.
numpy's twin (native_ext.reference.from_bf16 then a float32 matmul) agrees to float32 summation order.

The route needs the library and a CPU with BF16 dot-product instructions (`avx512_bf16` or `amx_bf16`
in /proc/cpuinfo); without them oneDNN would emulate BF16 several times slower than float32, so
`unavailable_reason()` refuses instead. oneDNN runs on GNU OpenMP: its threads are told to sleep when
idle (OMP_WAIT_POLICY=PASSIVE, unless set), as spinning ones would take the cores from numpy's
OpenBLAS between products. Results are deterministic for one library, CPU and thread count
(`identity()`, recorded in a bfloat16 run's execution identity).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from pathlib import Path

import numpy as np

from native_ext.validate import file_sha256

LIBRARY_ENV = "KILN_ONEDNN_LIBRARY"
LIBRARY_NAME = "libdnnl.so.3"
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")
GOMP_SPINCOUNT = 30_000_000
INSTALL_HINT = "pip install onednn-cpu-gomp (Kiln's runtime installs it on x86-64 Linux)"


def library_path() -> Path:
    """KILN_ONEDNN_LIBRARY, else the wheel's copy in this environment's lib/."""
    given = os.environ.get(LIBRARY_ENV)
    return Path(given) if given else Path(sys.prefix) / "lib" / LIBRARY_NAME


@functools.cache
def cpu_bf16_flags(cpuinfo: Path = CPUINFO) -> tuple:
    """The BF16 dot-product flags this CPU lists (read once)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return ()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return tuple(flag for flag in BF16_FLAGS if flag in value.split())
    return ()


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


@functools.cache
def _load():
    """(library, gemm function, reason): reason is None once both are found."""
    path = library_path()
    if not path.is_file():
        return None, None, f"oneDNN library not found at {path}: {INSTALL_HINT}"
    # libgomp reads this when it loads (next, as oneDNN's dependency): idle threads spin about 30 million
    # times (milliseconds) before they sleep, so the next product finds them awake
    os.environ.setdefault("GOMP_SPINCOUNT", str(GOMP_SPINCOUNT))
    try:
        library = ctypes.CDLL(str(path))
    except OSError as error:
        return None, None, f"oneDNN library {path} does not load: {error}"
    gemm = getattr(library, "dnnl_gemm_bf16bf16f32", None)
    if gemm is None:
        return None, None, f"oneDNN library {path} has no dnnl_gemm_bf16bf16f32"
    dim = ctypes.c_int64
    gemm.argtypes = [ctypes.c_char, ctypes.c_char, dim, dim, dim, ctypes.c_float, ctypes.c_void_p, dim,
                     ctypes.c_void_p, dim, ctypes.c_float, ctypes.c_void_p, dim]
    gemm.restype = ctypes.c_int
    library.dnnl_sgemm.argtypes = gemm.argtypes
    library.dnnl_sgemm.restype = ctypes.c_int
    library.dnnl_version.restype = ctypes.POINTER(_Version)
    return library, gemm, None


def unavailable_reason() -> str | None:
    """None where bfloat16 base products can run here, else why not (CPU first, then the library)."""
    if not cpu_bf16_flags():
        return ("this CPU has no BF16 dot-product instructions (avx512_bf16 or amx_bf16 in /proc/cpuinfo); "
                "base_precision 'bfloat16' needs them")
    return _load()[2]


def require():
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)


def threads() -> int:
    """The OpenMP threads oneDNN computes with (OMP_NUM_THREADS, else every core); 0 without the library."""
    if _load()[0] is None:
        return 0
    return int(ctypes.CDLL("libgomp.so.1").omp_get_max_threads())  # the loaded one: oneDNN's dependency


def identity() -> dict:
    """What a bfloat16 result depends on beyond the CPU: the library's version, file and thread count."""
    if _load()[0] is None:
        return {"version": None, "library_sha256": None, "threads": None}
    return {**_library_identity(), "threads": threads()}


@functools.cache
def _library_identity() -> dict:
    """The loaded library's version and SHA-256, read once (admission and every dequeue ask)."""
    v = _load()[0].dnnl_version().contents
    return {"version": f"{v.major}.{v.minor}.{v.patch}", "library_sha256": file_sha256(library_path())}


def _rows(name, array):
    if array.ndim != 2 or array.strides[1] != array.itemsize or array.strides[0] % array.itemsize:
        raise ValueError(f"{name} must be a 2-d row-major array with a contiguous last axis")
    return array.strides[0] // array.itemsize


def gemm(c, a, b, trans_b=False, beta=0.0):
    """c [M,N] (float32) = a [M,K] @ op(b) + beta * c, a and b bfloat16 bits (uint16); op(b) = b.T
    where trans_b (b [N,K]), else b [K,N]. Raises RuntimeError where the route is unavailable."""
    require()
    if a.dtype != np.uint16 or b.dtype != np.uint16 or c.dtype != np.float32:
        raise TypeError("a and b must be bfloat16 bits (uint16), c float32")
    M, K = a.shape
    Kb, N = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if Kb != K or c.shape != (M, N):
        raise ValueError(f"shapes {a.shape} @ {'T' if trans_b else ''}{b.shape} do not fit {c.shape}")
    if not c.flags.writeable:
        raise ValueError("c must be writable")
    lda, ldb, ldc = _rows("a", a), _rows("b", b), _rows("c", c)
    if M == 0 or N == 0:
        return
    status = _load()[1](b"N", b"T" if trans_b else b"N", M, N, K, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb,
                        float(beta), c.ctypes.data, ldc)
    if status != 0:
        raise RuntimeError(f"dnnl_gemm_bf16bf16f32 failed with status {status}")


def sgemm(c, a, b, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """native_ext.blas.gemm's contract (float32 row views) on oneDNN's dnnl_sgemm."""
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    N = b.shape[0] if trans_b else b.shape[1]
    if M == 0 or N == 0:
        return
    status = _load()[0].dnnl_sgemm(b"T" if trans_a else b"N", b"T" if trans_b else b"N", M, N, K, float(alpha),
                                   a.ctypes.data, _rows("a", a), b.ctypes.data, _rows("b", b), float(beta),
                                   c.ctypes.data, _rows("c", c))
    if status != 0:
        raise RuntimeError(f"dnnl_sgemm failed with status {status}")


@contextlib.contextmanager
def computing():
    """Every product inside runs on oneDNN's one OpenMP pool: native_ext.blas routes its float32 products
    to dnnl_sgemm, and numpy's OpenBLAS is held at one thread, since its idle worker spins for tens of
    milliseconds after each call and would take a core from oneDNN's threads."""
    from native_ext import blas

    require()
    with _blas_pools().limit(limits=1), blas.routed(sgemm):
        yield


@functools.cache
def _blas_pools():
    """The BLAS thread pools loaded now (numpy's OpenBLAS among them), found once: limiting them is then cheap
    enough for every generated token (about 12 us, against 0.35 ms for a fresh threadpool_limits)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def to_bf16(x: np.ndarray) -> np.ndarray:
    """A new uint16 array of x's bfloat16 bits (x: 2-d float32)."""
    from native_ext import kernels

    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.uint16)
    kernels.to_bf16(x, out)
    return out
