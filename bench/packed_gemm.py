"""A pre-packed float32 GEMM, and padded weight rows, against numpy's OpenBLAS on the frozen base's products (issue 19).

OpenBLAS packs the frozen weight afresh for every product (its `sgemm_itcopy`/`incopy`, 8-19% of a LoRA step's
samples under perf). bench/packed_gemm.c is a prototype that packs each weight once, Wb[K/16][N][16], and multiplies
from there: the forward y = x @ W.T and the input gradient dx = dy @ W, threads on contiguous row ranges. This
script builds it with gcc (-O3 -march=native -fopenmp) into a temporary directory, checks both products against
numpy (relative error below 1e-5), then times, for each of the SmolLM2-135M shape's four group products (q|k|v,
o, gate|up, down; N x K below) over 30 layers' distinct weights (so that weights are cold as in a step), OpenBLAS
and the prototype at one and at two threads, each thread count in its own process. A third column per direction
is OpenBLAS again on the same weights stored with rows padded by PAD floats (a row stride of K + PAD: strides of
2,304 and 6,144 bytes map the rows OpenBLAS packs together onto few cache sets; the results are the same bytes):

    python bench/packed_gemm.py [--rows 256] [--layers 30]

Kiln does not use the prototype (docs/engine.md says what it measured and why); the script keeps the figure
reproducible. It needs gcc and an AVX-512 CPU. Run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, the machine
otherwise idle.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from machine import cpu, describe

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N outputs, K inputs) of q|k|v, o, gate|up, down
PAD = 16  # floats of padding per weight row in the padded column (64 bytes)


def build(directory) -> ctypes.CDLL:
    source = Path(__file__).with_name("packed_gemm.c")
    library = Path(directory) / "packed_gemm.so"
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True)
    lib = ctypes.CDLL(str(library))
    P, N = ctypes.c_void_p, ctypes.c_int64  # pointers, sizes
    lib.pack16.argtypes = [N, N, P, P]
    lib.fwd.argtypes = [N, N, N, P, P, P, P, ctypes.c_int]
    lib.bwd.argtypes = [N, N, N, P, P, P, ctypes.c_int]
    return lib


def _best(function, repeats=5) -> float:
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def measure(lib, rows, layers, threads) -> list:
    """[(N, K, GFLOP/s of OpenBLAS forward, prototype forward, OpenBLAS input gradient, prototype input gradient,
    OpenBLAS forward and input gradient on padded rows, then the six times in ms)]."""
    rng = np.random.default_rng(0)
    results = []
    for N, K in SHAPES:
        weights = [rng.standard_normal((N, K), dtype=np.float32) for _ in range(layers)]
        padded = []
        for w in weights:
            view = np.empty((N, K + PAD), np.float32)[:, :K]  # row stride K + PAD
            view[...] = w
            padded.append(view)
        packed = []
        for w in weights:
            b = np.empty((K // 16, N, 16), np.float32)
            lib.pack16(N, K, w.ctypes.data, b.ctypes.data)
            packed.append(b)
        x = rng.standard_normal((rows, K), dtype=np.float32)
        dy = rng.standard_normal((rows, N), dtype=np.float32)
        y, dx = np.zeros((rows, N), np.float32), np.zeros((rows, K), np.float32)
        xt = np.empty(rows * K, np.float32)

        def forward(b):
            lib.fwd(rows, N, K, x.ctypes.data, b.ctypes.data, y.ctypes.data, xt.ctypes.data, threads)

        def backward(b):
            lib.bwd(rows, N, K, dy.ctypes.data, b.ctypes.data, dx.ctypes.data, threads)

        forward(packed[0])
        backward(packed[0])
        for got, want, name in ((y, x @ weights[0].T, "forward"), (dx, dy @ weights[0], "input gradient")):
            error = float(np.abs(got - want).max() / np.abs(want).max())
            if not error < 1e-5:
                raise SystemExit(f"the prototype's {name} is wrong at N={N} K={K}: relative error {error:.2e}")
        if not (np.array_equal(x @ padded[0].T, x @ weights[0].T) and np.array_equal(dy @ padded[0], dy @ weights[0])):
            raise SystemExit(f"OpenBLAS on padded rows gave other bytes at N={N} K={K}")
        flop = 2.0 * rows * N * K * layers
        timings = (_best(lambda: [np.matmul(x, w.T, out=y) for w in weights]),
                   _best(lambda: [forward(b) for b in packed]),
                   _best(lambda: [np.matmul(dy, w, out=dx) for w in weights]),
                   _best(lambda: [backward(b) for b in packed]),
                   _best(lambda: [np.matmul(x, w.T, out=y) for w in padded]),
                   _best(lambda: [np.matmul(dy, w, out=dx) for w in padded]))
        results.append((N, K, *(flop / t / 1e9 for t in timings), *(t * 1e3 for t in timings)))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="token rows (a multiple of 64)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rows % 64:
        parser.error("--rows must be a multiple of 64 (the prototype's tiles at two threads)")
    if args.child:
        with tempfile.TemporaryDirectory() as directory:
            print(json.dumps(measure(build(directory), args.rows, args.layers, args.child)))
        return
    if "avx512f" not in cpu()[1]:
        raise SystemExit("the prototype needs AVX-512 (avx512f); this CPU has none")
    print(describe())
    print(f"\n{args.rows} rows, {args.layers} layers' distinct weights per shape; GFLOP/s (total ms)")
    for threads in (1, 2):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--layers", str(args.layers),
                              "--child", str(threads)], env=env, check=True, capture_output=True, text=True).stdout
        results = json.loads(out.strip().splitlines()[-1])
        print(f"\n{threads} thread{'s' if threads > 1 else ''}")
        print(f"{'N x K':>12} {'forward OpenBLAS':>17} {'packed':>8} {'padded':>8} {'input grad OpenBLAS':>20} "
              f"{'packed':>8} {'padded':>8}")
        for N, K, f_blas, f_ours, b_blas, b_ours, f_pad, b_pad, *_ in results:
            print(f"{f'{N} x {K}':>12} {f_blas:17.1f} {f_ours:8.1f} {f_pad:8.1f} {b_blas:20.1f} {b_ours:8.1f} "
                  f"{b_pad:8.1f}")
        t = [sum(r[8 + i] for r in results) for i in range(6)]  # ms: blas, packed, blas, packed, padded, padded
        print(f"{'total ms':>12} {t[0]:17.1f} {t[1]:8.1f} {t[4]:8.1f} {t[2]:20.1f} {t[3]:8.1f} {t[5]:8.1f}"
              f"   (both directions: OpenBLAS {t[0] + t[2]:.1f}, packed {t[1] + t[3]:.1f}, padded {t[4] + t[5]:.1f})")


if __name__ == "__main__":
    main()
