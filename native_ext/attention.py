"""The validating public layer over the fused tiled attention in native_ext._attention.

forward() and backward() check dtypes, shapes and contiguity, then call the C kernel, which releases
the GIL and runs on `threads` threads (default: as many as the engine's products compute on at the call,
native_ext.blas.threads()); the bytes are the same for every thread count. The numpy twins with the same arguments are
native_ext.reference's attention_forward and attention_backward. Dimension letters as in trainer/attention.py.
"""

import numpy as np

from native_ext import blas
from native_ext.validate import built
from native_ext.validate import check_array as _check

_attention = built("_attention", "the fused attention kernel")

F32 = np.float32


def _positions(group_size, past, window, block, R):
    for name, value, least in (("group_size", group_size, 1), ("past", past, 0), ("block", block, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer))
                               or window < 1):
        raise ValueError(f"window must be None or a positive integer, got {window!r}")
    if R % group_size:
        raise ValueError(f"rows {R} are not a multiple of group_size {group_size}")


def _cache_view(name, a):
    """A float32 [G,S,D] array whose rows are contiguous (a C-contiguous array, or a view of a longer cache)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != F32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    if a.ndim != 3:
        raise ValueError(f"{name} must have 3 dimensions, got shape {a.shape}")
    G, S, D = a.shape
    if (a.strides[2] != 4 or a.strides[1] != 4 * D or a.strides[0] % 4 or a.strides[0] < 4 * S * D) and G * S * D:
        raise ValueError(f"{name} must have contiguous rows, its head groups a whole number of rows apart")


def _shapes(q, k, v):
    _check("q", q, F32, 3)
    _cache_view("k", k)
    _cache_view("v", v)
    G, R, D = q.shape
    if k.shape[0] != G or k.shape[2] != D or v.shape != k.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} do not fit q {q.shape} ([G,S,D] for q [G,R,D])")
    if G > 1 and k.strides[0] != v.strides[0]:
        raise ValueError("k and v must be views with the same layout")
    return G, R, k.shape[1], D


def _threads(threads):
    threads = blas.threads() if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or not 1 <= threads <= 64:
        raise ValueError(f"threads must be an integer from 1 to 64, got {threads!r}")
    return int(threads)


def forward(q, k, v, scale, group_size, block, past=0, window=None, threads=None):
    """(out [G,R,D], logsumexp [G,R]) of causal attention: row r of q [G,R,D] is the query at position
    past + r // group_size and sees keys 0..that position (the last `window` of them with a window) of
    k, v [G,S,D]; the online softmax walks key blocks of `block` keys."""
    G, R, S, D = _shapes(q, k, v)
    _positions(group_size, past, window, block, R)
    out = np.empty((G, R, D), F32)
    logsumexp = np.empty((G, R), F32)
    if G * R and S and D:
        _attention.forward(q, k, v, out, logsumexp, float(scale), int(group_size), int(past),
                           int(window or 0), int(block), _threads(threads))
    return out, logsumexp


def backward(dout, q, k, v, out, logsumexp, scale, group_size, block, past=0, window=None, threads=None):
    """(dq, dk, dv) of forward() from dout [G,R,D] and the forward's out and logsumexp."""
    G, R, S, D = _shapes(q, k, v)
    _positions(group_size, past, window, block, R)
    for name, a, shape in (("dout", dout, (G, R, D)), ("out", out, (G, R, D)), ("logsumexp", logsumexp, (G, R))):
        _check(name, a, F32, len(shape))
        if a.shape != shape:
            raise ValueError(f"{name} has shape {a.shape}, expected {shape}")
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    delta = np.empty((G, R), F32)
    if G * R and S and D:
        _attention.backward(dout, q, k, v, out, logsumexp, delta, dq, dk, dv, float(scale), int(group_size),
                            int(past), int(window or 0), int(block), _threads(threads))
    else:
        dq[...] = 0
        dk[...] = 0
        dv[...] = 0
    return dq, dk, dv
