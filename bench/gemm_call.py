"""What one call of native_ext.blas.gemm costs beyond its product: microseconds per call for small products on each
route (oneDNN's dnnl_sgemm, numpy's OpenBLAS), side by side with numpy's own np.matmul into a preallocated output
(the reference: numpy's C path to the same OpenBLAS) and with the library called straight through ctypes (what
blas.gemm did before it called from Cython). A LoRA step at context 256 makes about a thousand such calls, and
generation one per product per token.

    python bench/gemm_call.py [--calls 20000]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import describe, gemm_peak  # noqa: E402
from native_ext import blas, onednn  # noqa: E402

SHAPES = [(4, 4, 4), (1, 576, 576), (256, 192, 8)]  # M, K, N: a tiny product, one token's row, a LoRA down product


def per_call(function, calls):
    """Best of five rounds of `calls` calls, microseconds per call."""
    for _ in range(100):
        function()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def ctypes_onednn(c, a, b):
    """dnnl_sgemm through ctypes with the pointers built per call, as blas.gemm called it until 676369f."""
    library = onednn._load()[0]
    M, K = a.shape
    N = b.shape[1]

    def call():
        library.dnnl_sgemm(b"N", b"N", M, N, K, 1.0, a.ctypes.data, a.strides[0] // 4, b.ctypes.data,
                           b.strides[0] // 4, 0.0, c.ctypes.data, c.strides[0] // 4)
    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    print(describe(gemm_peak()))
    onednn_reason = onednn.float32_unavailable_reason()
    print(f"{'M x K x N':>14} {'np.matmul':>10} {'gemm, oneDNN':>13} {'gemm, OpenBLAS':>15} {'ctypes, oneDNN':>15}"
          "  (microseconds per call, best of 5)")
    rng = np.random.default_rng(0)
    for M, K, N in SHAPES:
        a = rng.standard_normal((M, K), dtype=np.float32)
        b = rng.standard_normal((K, N), dtype=np.float32)
        c = np.empty((M, N), np.float32)
        reference = per_call(lambda: np.matmul(a, b, out=c), args.calls)
        with blas.routed(blas.OPENBLAS):
            openblas = per_call(lambda: blas.gemm(c, a, b), args.calls)
        if onednn_reason is None:
            with blas.routed(onednn.sgemm):
                ours = f"{per_call(lambda: blas.gemm(c, a, b), args.calls):13.2f}"
            direct = f"{per_call(ctypes_onednn(c, a, b), args.calls):15.2f}"
        else:
            ours, direct = f"{'-':>13}", f"{'-':>15}"
        print(f"{f'{M} x {K} x {N}':>14} {reference:10.2f} {ours} {openblas:15.2f} {direct}")
    if onednn_reason is not None:
        print(f"oneDNN's columns: {onednn_reason}")


if __name__ == "__main__":
    main()
