"""The machine a benchmark ran on, printed with every figure: a ratio from one machine does not carry to
another. CPU model and the flags that decide which kernels run, numpy's BLAS, and the measured float32
GEMM peak that "of peak" figures divide by."""

import os
import platform
import time

import numpy as np

# flags that change which GEMM and element-wise kernels run (AVX-512 BF16 and AMX: BF16 routes)
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve")


def cpu() -> tuple:
    """(model name, [flags of FLAGS present]) from /proc/cpuinfo, else the platform's words."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return platform.processor() or platform.machine(), []
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    model = fields.get("model name") or fields.get("CPU part") or platform.machine()
    return model, [f for f in FLAGS if f in flags]


def has_bf16_compute() -> bool:
    """AVX-512-BF16 or AMX: the CPUs where torch's BF16 autocast is a fast route."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu()[1]))


def gemm_peak(repeats=5, n=2048) -> float:
    """FLOP/s of numpy's float32 matmul at n^3, best of `repeats` (the BLAS Kiln computes with)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    np.matmul(a, b)
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def blas() -> str:
    from threadpoolctl import threadpool_info

    infos = [f"{i['internal_api']} {i.get('version')} {i.get('architecture')} x{i['num_threads']}"
             for i in threadpool_info() if i["user_api"] == "blas"]
    return infos[0] if infos else "?"


def describe(peak=None) -> str:
    """One line: CPU, flags, cores, BLAS and the measured sgemm peak."""
    model, flags = cpu()
    peak = gemm_peak() if peak is None else peak
    return (f"machine: {model}; flags {' '.join(flags) or '-'}; {os.cpu_count()} cores; numpy BLAS {blas()}; "
            f"measured float32 GEMM peak (numpy 2048^3) {peak / 1e9:.1f} GFLOP/s")
