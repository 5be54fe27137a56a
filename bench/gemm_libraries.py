"""The LoRA step's GEMM shapes on numpy's OpenBLAS (what native_ext.blas.gemm calls) against Intel MKL's and
oneDNN's (native_ext.onednn, base_precision "bfloat16") float32 and BF16 GEMMs, side by side, each library in its
own process (their thread pools slow each other in one).

MKL is not a Kiln dependency: install it into the environment first (`pip install mkl`, which brings
intel-openmp and tbb) or name its libmkl_rt with --mkl. Without it the MKL columns say so. oneDNN is one
(`onednn-cpu-gomp`); its columns give the loader's reason where it cannot run.

    python bench/gemm_libraries.py [--threads 2] [--mkl /path/to/libmkl_rt.so.3]
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# M x K x N (and whether B is transposed): the frozen base's forward and input-gradient products, the
# output projection's, at contexts 256 and 1024 of the SmolLM2-135M shape
SHAPES = [(256, 576, 960, True), (256, 576, 576, True), (256, 576, 3072, True), (256, 1536, 576, True),
          (256, 960, 576, False), (256, 3072, 576, False), (960, 256, 576, False), (1024, 576, 960, True),
          (1024, 576, 3072, True), (1024, 1536, 576, True), (256, 576, 49152, True), (1024, 576, 49152, True)]
LIBRARIES = ("openblas", "mkl-fp32", "mkl-bf16", "onednn-fp32", "onednn-bf16")


def find_mkl(given):
    if given:
        return Path(given)
    for candidate in sorted((Path(sys.prefix) / "lib").glob("libmkl_rt.so*")):
        return candidate
    return None


def measure(library: str, mkl_path, threads: int) -> list:
    """GFLOP/s per shape, in this process."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    if library == "openblas":
        threadpool_limits(threads, "blas")
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        os.environ["KILN_CPU_GEMM"] = "openblas"  # native_ext.blas.gemm on numpy's OpenBLAS, not oneDNN's
        from native_ext import blas
    elif library.startswith("onednn"):
        threadpool_limits(1, "blas")  # as native_ext.bf16.computing holds it: one pool owns the cores
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from native_ext import bf16, onednn
        os.environ["OMP_NUM_THREADS"] = str(threads)  # before libgomp loads, with oneDNN
        onednn.require()
    else:
        threadpool_limits(1, "blas")  # numpy's OpenBLAS quiet: no spinning pool beside MKL's
        mkl = ctypes.CDLL(str(mkl_path))
        mkl.MKL_Set_Num_Threads(threads)
        gemm = mkl.cblas_sgemm if library == "mkl-fp32" else mkl.cblas_gemm_bf16bf16f32
        gemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                              ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        gemm.restype = None
    rates = []
    for M, K, N, transposed in SHAPES:
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((N, K) if transposed else (K, N)).astype(np.float32)
        c = np.zeros((M, N), np.float32)
        if library == "openblas":
            def call():
                blas.gemm(c, a, b, trans_b=transposed)
        elif library == "onednn-fp32":
            def call():
                onednn.sgemm(c, a, b, trans_b=transposed)
        elif library == "onednn-bf16":
            a16, b16 = bf16.to_bf16(a), bf16.to_bf16(b)  # the frozen weight is converted once; so is a here

            def call():
                onednn.gemm(c, a16, b16, trans_b=transposed)
        else:
            if library == "mkl-bf16":  # the upper 16 bits: bfloat16 by truncation
                a, b = (a.view(np.uint32) >> 16).astype(np.uint16), (b.view(np.uint32) >> 16).astype(np.uint16)

            def call():
                gemm(101, 111, 112 if transposed else 111, M, N, K, 1.0, a.ctypes.data, K, b.ctypes.data,
                     K if transposed else N, 0.0, c.ctypes.data, N)
        flops = 2 * M * N * K
        repeats = max(5, int(3e9 / flops))
        call()
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        rates.append(flops * repeats / (time.perf_counter() - start) / 1e9)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mkl", help="libmkl_rt to load (default: the one in this environment's lib/)")
    parser.add_argument("--child", choices=LIBRARIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    mkl_path = find_mkl(args.mkl)
    if args.child:
        print(json.dumps(measure(args.child, mkl_path, args.threads)))
        return 0
    results = {}
    for library in LIBRARIES:
        if library.startswith("onednn"):
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from native_ext import onednn
            if onednn.unavailable_reason():
                results[library] = onednn.unavailable_reason()
                continue
        elif library != "openblas" and (mkl_path is None or not mkl_path.is_file()):
            results[library] = "not installed (pip install mkl, or --mkl PATH)"
            continue
        command = [sys.executable, __file__, "--child", library, "--threads", str(args.threads)]
        if mkl_path is not None:
            command += ["--mkl", str(mkl_path)]
        done = subprocess.run(command, capture_output=True, text=True)
        results[library] = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else \
            f"failed: {done.stderr.strip().splitlines()[-1:]}"
    print(f"GFLOP/s, {args.threads} threads, each library in its own process")
    print(f"{'M x K x N':>22}  " + "  ".join(f"{name:>9}" for name in LIBRARIES))
    for index, (M, K, N, transposed) in enumerate(SHAPES):
        cells = [f"{results[name][index]:9.1f}" if isinstance(results[name], list) else f"{'-':>9}"
                 for name in LIBRARIES]
        print(f"{M:>6} x {K:>5} x {N:>6}{' T' if transposed else '  '}  " + "  ".join(cells))
    for name in LIBRARIES:
        if isinstance(results[name], str):
            print(f"{name}: {results[name]}")
    print(json.dumps({"threads": args.threads, "shapes": SHAPES, "gflops": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
