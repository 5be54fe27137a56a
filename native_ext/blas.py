"""C += op(A) @ op(B) through the same OpenBLAS that numpy's matmul uses.

numpy's matmul cannot accumulate into its output, and scipy ships a second OpenBLAS
whose thread pool spins against numpy's on a small machine (measured here: a gradient
accumulation through scipy was several times slower right after a numpy product). So
this module finds numpy's own OpenBLAS, declares the one symbol it needs, and calls it
with beta = 1. Where numpy's BLAS cannot be found it falls back to a temporary product
and an in-place add, which gives the same values up to rounding.
"""

import ctypes
from pathlib import Path

import numpy as np

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
# (symbol, integer type) in the order they are tried: numpy >= 2 wheels bundle an ILP64
# scipy-openblas with prefixed and suffixed names; older ones a plain LP64 OpenBLAS
_CANDIDATES = (("scipy_cblas_sgemm64_", ctypes.c_int64), ("cblas_sgemm64_", ctypes.c_int64),
               ("cblas_sgemm", ctypes.c_int))


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


def _rows(name, array):
    """Leading dimension of a 2-D float32 array whose last axis is contiguous."""
    if array.dtype != np.float32 or array.ndim != 2:
        raise TypeError(f"{name} must be a 2-d float32 array")
    if array.strides[1] != 4 or array.strides[0] % 4 or array.strides[0] < 4 * array.shape[1]:
        raise ValueError(f"{name} must be row-major with a contiguous last axis")
    return array.strides[0] // 4


def accumulate_at_b(c, a, b):
    """c [M,N] += a.T @ b with a [K,M] and b [K,N] (row views with strided rows allowed)."""
    K, M = a.shape
    if b.shape[0] != K or c.shape != (M, b.shape[1]):
        raise ValueError(f"shapes {a.shape}.T @ {b.shape} do not fit {c.shape}")
    if not c.flags.c_contiguous or not c.flags.writeable or c.dtype != np.float32:
        raise ValueError("c must be a writable C-contiguous float32 array")
    lda, ldb = _rows("a", a), _rows("b", b)
    if _SGEMM is None:
        c += a.T @ b
        return
    N = b.shape[1]
    if M == 0 or N == 0 or K == 0:
        return
    _SGEMM(ROW_MAJOR, TRANS, NO_TRANS, M, N, K, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb, 1.0,
           c.ctypes.data, N)
