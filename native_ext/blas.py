"""C = alpha * op(A) @ op(B) + beta * C through the same OpenBLAS that numpy's matmul uses.

numpy's matmul cannot scale, accumulate into its output or write into a column slice of a
wider array, and scipy ships a second OpenBLAS
whose thread pool spins against numpy's on a small machine (measured here: a gradient
accumulation through scipy was several times slower right after a numpy product). So
this module finds numpy's own OpenBLAS, declares the one symbol it needs, and calls it
with the caller's alpha, beta and leading dimensions, so a product lands scaled in place in
a row view (the LoRA path adds its low-rank products into the columns of a fused projection
output this way, with no temporary). Where numpy's BLAS cannot be found it falls back to
numpy (a temporary product, scaled and added), which gives the same values up to rounding.

Where oneDNN loads (the onednn-cpu-gomp wheel, x86-64 Linux), the engine's float32 products go to its
dnnl_sgemm instead (KILN_CPU_GEMM: auto, the default, onednn or openblas; FLOAT32_GEMM says which, and a run's
execution identity records it): on the LoRA step's shapes (256 to 1024 token rows against 576 to 3,072 wide
weights) its two threads split the work better than OpenBLAS's and compute a step 15-25% faster on the
project's 2-core machines (docs/engine.md, bench/gemm_libraries.py). oneDNN computes on GNU OpenMP's threads,
which spin for milliseconds after each product; so then Kiln's kernels run on those threads too
(pool.h, kiln_pool_use_openmp) and numpy's own products on one thread: one set of threads, never two
spinning against each other. GNU OpenMP cannot start again in a process forked after its threads started, so
a forked child computes on OpenBLAS (the fork hook below).
"""

import contextlib
import contextvars
import ctypes
import os
import sys
import threading
from pathlib import Path

import numpy as np

from native_ext import onednn
from native_ext.validate import built

# (symbol, integer type) in the order they are tried: numpy >= 2 wheels bundle an ILP64
# scipy-openblas with prefixed and suffixed names; older ones a plain LP64 OpenBLAS
_CANDIDATES = (("scipy_cblas_sgemm64_", ctypes.c_int64), ("cblas_sgemm64_", ctypes.c_int64),
               ("cblas_sgemm", ctypes.c_int))


# the thread-count query and the threads-callback setter beside each sgemm symbol, same prefix and suffix
_THREAD_QUERIES = {"scipy_cblas_sgemm64_": "scipy_openblas_get_num_threads64_",
                   "cblas_sgemm64_": "openblas_get_num_threads64_", "cblas_sgemm": "openblas_get_num_threads"}
_THREAD_SETTERS = {"scipy_cblas_sgemm64_": "scipy_openblas_set_num_threads64_",
                   "cblas_sgemm64_": "openblas_set_num_threads64_", "cblas_sgemm": "openblas_set_num_threads"}
_CALLBACK_SETTERS = {"scipy_cblas_sgemm64_": "scipy_openblas_set_threads_callback_function64_",
                     "cblas_sgemm64_": "openblas_set_threads_callback_function64_",
                     "cblas_sgemm": "openblas_set_threads_callback_function"}


def _load():
    from threadpoolctl import threadpool_info
    numpy_dir = Path(np.__file__).resolve().parent
    roots = (numpy_dir, numpy_dir.parent / "numpy.libs")
    for info in threadpool_info():
        path = Path(info.get("filepath", ""))
        if info.get("user_api") != "blas" or not any(root in path.parents for root in roots):
            continue
        library = ctypes.CDLL(str(path))
        for name, integer in _CANDIDATES:
            function = getattr(library, name, None)
            if function is None:
                continue
            function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer, integer,
                                 ctypes.c_float, ctypes.c_void_p, integer, ctypes.c_void_p, integer,
                                 ctypes.c_float, ctypes.c_void_p, integer]
            function.restype = None
            return function, path, name
    return None, None, None


_SGEMM, LIBRARY_PATH, SYMBOL = _load()  # resolved once at import; read-only afterwards
# gemm() calls it from Cython (native_ext._kernels.cblas_sgemm), not through ctypes: about 1 us a call against 20
_SGEMM_ADDRESS = ctypes.cast(_SGEMM, ctypes.c_void_p).value if _SGEMM is not None else None
_SGEMM_ILP64 = dict(_CANDIDATES).get(SYMBOL) is ctypes.c_int64
_LIBRARY = ctypes.CDLL(str(LIBRARY_PATH)) if SYMBOL else None  # numpy's OpenBLAS, for the symbols beside sgemm


def _beside(name):
    """The function NAME of numpy's OpenBLAS, or None (no OpenBLAS found, or none by that name)."""
    return getattr(_LIBRARY, name, None) if _LIBRARY is not None and name else None


# its sgemv beside it (same prefix and suffix), for one-row products (generation): _kernels.cblas_sgemv_row
_SGEMV = _beside(SYMBOL.replace("sgemm", "sgemv")) if SYMBOL else None
_SGEMV_ADDRESS = ctypes.cast(_SGEMV, ctypes.c_void_p).value if _SGEMV is not None else None
_THREADS = _beside(_THREAD_QUERIES.get(SYMBOL))
if _THREADS is not None:
    _THREADS.argtypes, _THREADS.restype = [], ctypes.c_int
_SET_THREADS = _beside(_THREAD_SETTERS.get(SYMBOL))
# OpenBLAS >= 0.3.27: the calling thread's own thread count (serve_on_openblas)
_SET_THREADS_HERE = _beside("openblas_set_num_threads_local")
if _SET_THREADS_HERE is not None:
    _SET_THREADS_HERE.argtypes, _SET_THREADS_HERE.restype = [ctypes.c_int], ctypes.c_int
if _SET_THREADS is not None:
    _SET_THREADS.argtypes, _SET_THREADS.restype = [ctypes.c_int], None


def _share_threads():
    """Hand OpenBLAS's threaded jobs to native_ext/pool.h's pool, which Kiln's own parallel kernels use too
    (KILN_OPENBLAS_THREADS=own keeps OpenBLAS's pool). OpenBLAS's idle workers busy-wait for about 2^28
    cycles after every threaded call, so a kernel thread started beside them shares a core with one; the
    pool's threads spin for 0.2 ms and then sleep. The split of every product is OpenBLAS's either way, so
    its results are the same bytes. Returns where the jobs run: "kiln", "openblas" or why not."""
    if os.environ.get("KILN_OPENBLAS_THREADS", "kiln") == "own":
        return "openblas (KILN_OPENBLAS_THREADS=own)"
    function = _beside(_CALLBACK_SETTERS.get(SYMBOL))
    if function is None:
        return "openblas (this OpenBLAS has no threads callback)"
    function.argtypes, function.restype = [ctypes.c_void_p], None
    function(ctypes.c_void_p(_POOL.openblas_callback()))
    return "kiln"


# native_ext/pool.h lives in the _attention extension: one pool per process, loaded here once. POOL_RUN is the
# address of its kiln_pool_run, which native_ext.kernels and native_ext.nf4 hand to their C kernels.
_POOL = built("_attention", "the thread pool and the fused attention kernel")
_KERNELS = built("_kernels", "the Cython kernels")  # float32_rows: gemm's layout checks, in C
POOL_RUN = _POOL.pool_run()
THREAD_POOL = _share_threads() if _SGEMM is not None else "numpy (no OpenBLAS found)"


def threads() -> int:
    """How many threads the engine's products and kernels compute on: oneDNN's OpenMP threads where it computes
    the float32 products, else numpy's OpenBLAS's now (a threadpool_limits scope included; 1 where it cannot be
    asked). native_ext.attention and the row kernels run on as many."""
    route = _ROUTE.get()
    if route is not OPENBLAS and (route is not None or FLOAT32_GEMM == "onednn"):
        return max(1, onednn.compute_threads())
    return max(1, _THREADS()) if _THREADS is not None else 1


def serve_on_openblas():
    """The calling thread computes on numpy's OpenBLAS and Kiln's pthread pool from here on, whatever the process
    does: a completion thread, one of several serving requests side by side. Where oneDNN computes the float32
    products, each calling thread gets GNU OpenMP threads of its own that spin after every product, and eight
    serving threads took the cores from each other (bench/serving.py at 8 clients: 12 tokens/s against
    OpenBLAS's 16; on one OpenMP thread each, 12); on OpenBLAS their products take turns on the one pool. A
    no-op where OpenBLAS computes everything already."""
    if FLOAT32_GEMM != "onednn":
        return
    _ROUTE.set(OPENBLAS)
    _POOL.choose_here(_POOL.HERE_PTHREADS)
    if _SET_THREADS_HERE is not None and _OPENBLAS_THREADS_BEFORE:
        _SET_THREADS_HERE(_OPENBLAS_THREADS_BEFORE)  # numpy's OpenBLAS is held at one thread elsewhere


GEMM_ENV = "KILN_CPU_GEMM"
GEMM_CHOICES = ("auto", "onednn", "openblas")


def _choose_gemm() -> tuple:
    """(library, why): "onednn" where KILN_CPU_GEMM (default auto) allows it and oneDNN loads, else "openblas"."""
    asked = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
    if asked not in GEMM_CHOICES:
        raise ValueError(f"{GEMM_ENV}={asked!r}: use one of {', '.join(GEMM_CHOICES)}")
    if asked == "openblas" or _SGEMM is None:
        return "openblas", f"{GEMM_ENV}={asked}" if _SGEMM is not None else "numpy's OpenBLAS not found"
    reason = onednn.float32_unavailable_reason()
    if reason is None:
        return "onednn", f"{GEMM_ENV}={asked}"
    if asked == "onednn":
        print(f"kiln: {GEMM_ENV}=onednn asked, but {reason}; float32 products run on OpenBLAS", file=sys.stderr)
    return "openblas", reason


def _use_onednn():
    """oneDNN's threads compute everything from here on: the products, Kiln's kernels (pool.h on GNU OpenMP);
    numpy's OpenBLAS on one thread. Returns OpenBLAS's thread count before, for a forked child to restore."""
    before = _THREADS() if _THREADS is not None else None
    if _SET_THREADS is not None:
        _SET_THREADS(1)
    _find_openmp()
    _POOL.use_openmp(True)
    os.register_at_fork(after_in_child=_forked_child)
    return before


_OPENMP = threading.Lock()
_openmp_found = False


def _find_openmp():
    """Hands pool.h the GNU OpenMP oneDNN loaded, once (oneDNN must have loaded)."""
    global _openmp_found
    if _openmp_found:  # read without the lock: a child forked while another thread held it must not wait
        return
    with _OPENMP:
        if not _openmp_found:
            _POOL.find_openmp(*onednn.openmp_entry_points())
            _openmp_found = True


@contextlib.contextmanager
def kernels_on_openmp():
    """Kiln's kernels called from this thread run on GNU OpenMP's threads inside, where oneDNN computes the
    products: the bfloat16 scope (native_ext.bf16.computing), whose products only oneDNN computes, in a serving
    thread too (serve_on_openblas put its kernels on the pthreads) and where OpenBLAS computes the float32
    products elsewhere. Kernels on the pthreads beside oneDNN's threads, which spin for milliseconds after each
    product, would share the cores with them."""
    _find_openmp()
    before = _POOL.choose_here(_POOL.HERE_OPENMP)
    try:
        yield
    finally:
        _POOL.choose_here(before)


def _forked_child():
    """In a child forked without exec: GNU OpenMP would wait forever on the parent's threads, so OpenBLAS computes
    the float32 products and pool.h's pthreads run the kernels, on OpenBLAS's thread count from before."""
    global FLOAT32_GEMM, GEMM_NOTE, _DEFAULT_GEMM, _openmp_found
    FLOAT32_GEMM, _DEFAULT_GEMM, _openmp_found = "openblas", None, True  # found: none, for good
    GEMM_NOTE = "a child forked after GNU OpenMP's threads started (OpenMP cannot run here)"
    _POOL.find_openmp(0, 0)
    _POOL.use_openmp(False)
    if _SET_THREADS is not None and _OPENBLAS_THREADS_BEFORE:
        _SET_THREADS(_OPENBLAS_THREADS_BEFORE)


FLOAT32_GEMM, GEMM_NOTE = _choose_gemm()  # which library computes the engine's float32 products, and why
_OPENBLAS_THREADS_BEFORE = _use_onednn() if FLOAT32_GEMM == "onednn" else None
# a gemm with this module's contract that takes every product inside routed(), else None; per thread (a context
# variable), so a serving thread's float32 products never go where a training thread's bfloat16 scope sends its own
_ROUTE = contextvars.ContextVar("kiln_blas_route", default=None)
# where products go outside routed(): oneDNN's sgemm (FLOAT32_GEMM "onednn"), or None for numpy's OpenBLAS
_DEFAULT_GEMM = onednn.sgemm if FLOAT32_GEMM == "onednn" else None
OPENBLAS = "openblas"  # a thread's route that means numpy's OpenBLAS whatever the default (serve_on_openblas)


def _current():
    routed_gemm = _ROUTE.get()
    if routed_gemm is None:
        return _DEFAULT_GEMM
    return None if routed_gemm is OPENBLAS else routed_gemm


@contextlib.contextmanager
def routed(gemm_function):
    """gemm() and matmul() called from this thread go to GEMM_FUNCTION inside (native_ext.bf16.computing)."""
    token = _ROUTE.set(gemm_function)
    try:
        yield
    finally:
        _ROUTE.reset(token)


def route():
    """The gemm this thread's products go to, or None (numpy's OpenBLAS)."""
    return _current()


def matmul(a, b, out=None):
    """np.matmul of float32 2-d matrices or equal stacks of them ([G,M,K] @ [G,K,N]); exactly np.matmul
    unless routed() or oneDNN computes the float32 products, where each matrix product goes to that gemm
    (operands may be transposed views)."""
    routed_gemm = _current()
    if routed_gemm is None:
        return np.matmul(a, b, out=out)
    if a.ndim == 2:
        return matmul(a[None], b[None], None if out is None else out[None])[0]
    G, M, _ = a.shape
    if out is None:
        out = np.empty((G, M, b.shape[2]), np.float32)
    for g in range(G):
        (ag, trans_a), (bg, trans_b) = _row_major(a[g]), _row_major(b[g])
        routed_gemm(out[g], ag, bg, trans_a, trans_b)
    return out


def _row_major(x):
    """(array, transposed) with the array's last axis contiguous and its rows at least that long apart (a
    leading dimension BLAS accepts): x itself, or x.T with transposed, else a contiguous copy. A one-row
    view may have any row stride (a transposed [2, 1] slice: strides 4, 4), which BLAS would refuse."""
    size = x.itemsize
    if x.strides[-1] == size and x.strides[0] >= size * max(1, x.shape[1]) and x.strides[0] % size == 0:
        return x, False
    if x.strides[0] == size and x.strides[1] >= size * max(1, x.shape[0]) and x.strides[1] % size == 0:
        return x.T, True
    return np.ascontiguousarray(x), False


def gemm(c, a, b, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
    """c [M,N] = alpha * op(a) @ op(b) + beta * c, op(x) = x.T where trans_x; every array a 2-d float32
    row view whose last axis is contiguous (rows may be strided: a column slice of a wider array).
    beta = 0 ignores what c held (NaN included), as BLAS does."""
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    Kb, N = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if Kb != K or c.shape != (M, N):
        raise ValueError(f"shapes {'T' if trans_a else ''}{a.shape} @ {'T' if trans_b else ''}{b.shape} "
                         f"do not fit {c.shape}")
    if not c.flags.writeable:
        raise ValueError("c must be writable")
    _KERNELS.float32_rows(a, b, c)
    if M == 0 or N == 0:
        return
    routed_gemm = _current()
    if routed_gemm is not None and K:
        routed_gemm(c, a, b, trans_a, trans_b, alpha, beta)
        return
    if _SGEMM is None or K == 0:
        product = (a.T if trans_a else a) @ (b.T if trans_b else b)
        if beta == 0.0:
            c[...] = np.float32(alpha) * product
        else:
            c *= np.float32(beta)
            c += np.float32(alpha) * product
        return
    if M == 1 and _SGEMV_ADDRESS is not None:  # one row (a token being generated): sgemv, not a packing sgemm
        _KERNELS.cblas_sgemv_row(_SGEMV_ADDRESS, _SGEMM_ILP64, c, a, b, trans_a, trans_b, alpha, beta)
        return
    _KERNELS.cblas_sgemm(_SGEMM_ADDRESS, _SGEMM_ILP64, c, a, b, trans_a, trans_b, alpha, beta)


def accumulate_at_b(c, a, b):
    """c [M,N] += a.T @ b with a [K,M] and b [K,N] (row views with strided rows allowed)."""
    K, M = a.shape
    if b.shape[0] != K or c.shape != (M, b.shape[1]):
        raise ValueError(f"shapes {a.shape}.T @ {b.shape} do not fit {c.shape}")
    if not c.flags.c_contiguous or not c.flags.writeable or c.dtype != np.float32:
        raise ValueError("c must be a writable C-contiguous float32 array")
    gemm(c, a, b, trans_a=True, beta=1.0)
