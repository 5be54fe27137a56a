"""The bfloat16 route's scope and operands, on top of native_ext.onednn (which imports no other engine module, so
that native_ext.blas can send the float32 products there): computing(), the scope a bfloat16 model's forward
and backward run in, and to_bf16(), a float32 array's bfloat16 bits."""

import contextlib
import functools

import numpy as np

from native_ext import blas, kernels, onednn


@contextlib.contextmanager
def computing():
    """Everything inside computes on oneDNN's one OpenMP pool: native_ext.blas routes its float32 products
    to dnnl_sgemm and Kiln's kernels to the same OpenMP threads (a serving thread's too), and numpy's OpenBLAS is
    held at one thread, since its idle worker spins for tens of milliseconds after each call and would take a core
    from oneDNN's threads."""
    onednn.require()
    with _blas_pools().limit(limits=1), blas.routed(onednn.sgemm), blas.kernels_on_openmp():
        yield


@functools.cache
def _blas_pools():
    """The BLAS thread pools loaded now (numpy's OpenBLAS among them), found once: limiting them is then cheap
    enough for every generated token (about 12 us, against 0.35 ms for a fresh threadpool_limits)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def to_bf16(x: np.ndarray) -> np.ndarray:
    """A new uint16 array of x's bfloat16 bits (x: 2-d float32)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.uint16)
    kernels.to_bf16(x, out)
    return out
