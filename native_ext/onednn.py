"""BF16 products for a frozen base through oneDNN's `dnnl_gemm_bf16bf16f32` (the library PyTorch's CPU
autocast computes with), loaded with ctypes from the `onednn-cpu-gomp` wheel.

C [M,N] = A [M,K] @ op(B) in float32, from bfloat16 operands (uint16 arrays of their bits, made by
native_ext.kernels.to_bf16): the products of two bfloat16 numbers are exact in float32 and oneDNN
accumulates them in float32, so a result differs from float32 arithmetic only by the operands' rounding.
numpy's twin (native_ext.reference.from_bf16 then a float32 matmul) agrees to float32 summation order.

The route needs the library and a CPU with BF16 dot-product instructions (`avx512_bf16` or `amx_bf16`
in /proc/cpuinfo); without them oneDNN would emulate BF16 several times slower than float32, so
`unavailable_reason()` refuses instead. oneDNN runs on GNU OpenMP: its idle threads spin GOMP_SPINCOUNT
times before they sleep, so the next product finds them awake, and native_ext.blas runs Kiln's kernels on the
same threads while oneDNN computes the float32 products too. Results are deterministic for one library, CPU and
thread count (`identity()`, recorded in the execution identity of a bfloat16 run and of every run whose float32
products oneDNN computes).

Its float32 GEMM, dnnl_sgemm, needs no BF16 instructions: native_ext.blas sends the engine's float32 products
there wherever the library loads (`float32_unavailable_reason()`). GNU OpenMP cannot compute in a child forked
(without exec) after its threads started: it would wait forever for the parent's threads, so such a child is
told why instead (`unavailable_reason`, `float32_unavailable_reason`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

import numpy as np

from native_ext.validate import built, file_sha256

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
    # one setting sizes both libraries: oneDNN's threads follow OPENBLAS_NUM_THREADS unless OMP_NUM_THREADS is set
    if os.environ.get("OPENBLAS_NUM_THREADS") and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"]
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


_computed = False  # whether this process has called oneDNN (its OpenMP threads may have started)
_forked = False  # whether this process is a child forked after that


def _after_fork_in_child():
    global _forked
    _forked = _forked or _computed


os.register_at_fork(after_in_child=_after_fork_in_child)
FORKED_REASON = ("this process was forked after oneDNN's GNU OpenMP threads started, and GNU OpenMP cannot "
                 "compute in such a child (start the process afresh, or fork before the first product)")


def float32_unavailable_reason() -> str | None:
    """None where oneDNN's float32 GEMM (dnnl_sgemm) can compute here, else why not."""
    if _forked:
        return FORKED_REASON
    return _load()[2]


def unavailable_reason() -> str | None:
    """None where bfloat16 base products can run here, else why not (CPU first, then the library)."""
    if not cpu_bf16_flags():
        return ("this CPU has no BF16 dot-product instructions (avx512_bf16 or amx_bf16 in /proc/cpuinfo); "
                "base_precision 'bfloat16' needs them")
    return float32_unavailable_reason()


def openmp_entry_points() -> tuple:
    """The addresses of GOMP_parallel and omp_get_thread_num in the GNU OpenMP oneDNN loaded, for pool.h to run
    Kiln's kernels on oneDNN's threads (native_ext.blas)."""
    gomp = ctypes.CDLL("libgomp.so.1")  # already loaded as oneDNN's dependency: the same copy
    return tuple(ctypes.cast(getattr(gomp, name), ctypes.c_void_p).value
                 for name in ("GOMP_parallel", "omp_get_thread_num"))


def require():
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(reason)


def threads() -> int:
    """The OpenMP threads oneDNN computes with (OMP_NUM_THREADS, else every core); 0 without the library."""
    if _load()[0] is None:
        return 0
    return int(_max_threads()())


@functools.cache
def _max_threads():
    """libgomp's omp_get_max_threads, found once (the kernels ask before every call)."""
    return ctypes.CDLL("libgomp.so.1").omp_get_max_threads  # the loaded one: oneDNN's dependency


def compute_threads() -> int:
    """threads(), for work about to run on GNU OpenMP's threads (Kiln's kernels, native_ext.blas.threads):
    a child forked after it may not compute on them."""
    global _computed
    _computed = True
    return threads()


def identity() -> dict:
    """What a result oneDNN computes depends on beyond the CPU: the library's version and file, the instruction set
    its kernels use (cpu_isa: the CPU's best unless ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA caps it, and a capped
    product has other bytes) and the thread count."""
    if _load()[0] is None:
        return {"version": None, "library_sha256": None, "cpu_isa": None, "threads": None}
    return {**_library_identity(), "threads": threads()}


@functools.cache
def _library_identity() -> dict:
    """The loaded library's version, SHA-256 and effective ISA, read once (admission and every dequeue ask; the
    ISA is fixed once the library has started)."""
    library = _load()[0]
    v = library.dnnl_version().contents
    return {"version": f"{v.major}.{v.minor}.{v.patch}", "library_sha256": file_sha256(library_path()),
            "cpu_isa": _effective_isa(library)}


def _effective_isa(library) -> str | None:
    """The instruction set oneDNN's CPU kernels use ("avx512_core_bf16", "avx2", ...; None where the library
    cannot say)."""
    get, name = getattr(library, "dnnl_get_effective_cpu_isa", None), getattr(library, "dnnl_cpu_isa2str", None)
    if get is None:
        return None
    get.argtypes, get.restype = [], ctypes.c_int
    isa = get()
    if name is None:
        return str(isa)
    name.argtypes, name.restype = [ctypes.c_int], ctypes.c_char_p
    text = (name(isa) or b"").decode("ascii", "replace")
    return text.removeprefix("cpu_isa_") or str(isa)


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
    if M == 0 or N == 0:
        _kernels().dnnl_gemm_bf16(0, c, a, b, trans_b, beta)  # checks the layout, calls nothing
        return
    global _computed
    _computed = True
    status = _kernels().dnnl_gemm_bf16(_bf16_gemm_address(), c, a, b, trans_b, beta)
    if status != 0:
        raise RuntimeError(f"dnnl_gemm_bf16bf16f32 failed with status {status}")


@functools.cache
def _kernels():
    return built("_kernels", "the Cython kernels")


@functools.cache
def _bf16_gemm_address():
    """dnnl_gemm_bf16bf16f32's address (gemm checked the route first with require())."""
    return ctypes.cast(_load()[1], ctypes.c_void_p).value


@functools.cache
def _sgemm_address():
    """dnnl_sgemm's address, for native_ext._kernels.dnnl_sgemm to call without ctypes; RuntimeError without it."""
    library, _, reason = _load()
    if reason is not None:
        raise RuntimeError(reason)
    return ctypes.cast(library.dnnl_sgemm, ctypes.c_void_p).value


def sgemm(c, a, b, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """native_ext.blas.gemm's contract (float32 row views) on oneDNN's dnnl_sgemm (called from Cython:
    _kernels.dnnl_sgemm checks the arrays' layout and releases the GIL)."""
    M = a.shape[1] if trans_a else a.shape[0]
    N = b.shape[0] if trans_b else b.shape[1]
    if M == 0 or N == 0:
        return
    if _forked:
        raise RuntimeError(FORKED_REASON)
    global _computed
    _computed = True
    status = _kernels().dnnl_sgemm(_sgemm_address(), c, a, b, trans_a, trans_b, alpha, beta)
    if status != 0:
        raise RuntimeError(f"dnnl_sgemm failed with status {status}")
