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
    """FLOP/s of numpy's float32 matmul at n^3 on every core, best of `repeats`. On every core even after the
    engine has loaded: where oneDNN computes Kiln's float32 products, native_ext.blas holds numpy's OpenBLAS
    at one thread (onednn_gemm_peak measures oneDNN's own)."""
    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    with threadpool_limits(limits=os.cpu_count(), user_api="blas"):
        np.matmul(a, b)
        best = np.inf
        for _ in range(repeats):
            start = time.perf_counter()
            np.matmul(a, b)
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


ONEDNN_PEAK = """
import sys, time
import numpy as np
from native_ext import onednn
if onednn.float32_unavailable_reason():
    print("nan"); sys.exit()
n, repeats = int(sys.argv[1]), int(sys.argv[2])
a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
c = np.empty((n, n), np.float32)
onednn.sgemm(c, a, b)
best = np.inf
for _ in range(repeats):
    start = time.perf_counter()
    onednn.sgemm(c, a, b)
    best = min(best, time.perf_counter() - start)
print(2 * n**3 / best)
"""


def onednn_gemm_peak(repeats=5, n=2048) -> float:
    """FLOP/s of oneDNN's dnnl_sgemm at n^3 on every core (in a child process, so that its OpenMP threads never
    spin beside this one's), or NaN where it does not load."""
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run([sys.executable, "-c", ONEDNN_PEAK, str(n), str(repeats)], capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[1], check=False)
    try:
        return float(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return float("nan")


def blas() -> str:
    from threadpoolctl import threadpool_info

    infos = [f"{i['internal_api']} {i.get('version')} {i.get('architecture')} x{i['num_threads']}"
             for i in threadpool_info() if i["user_api"] == "blas"]
    return infos[0] if infos else "?"


def describe(peak=None) -> str:
    """One line: CPU, flags, cores, BLAS and the measured sgemm peak."""
    model, flags = cpu()
    peak = gemm_peak() if peak is None else peak
    onednn = onednn_gemm_peak()
    return (f"machine: {model}; flags {' '.join(flags) or '-'}; {os.cpu_count()} cores; numpy BLAS {blas()}; "
            f"measured float32 GEMM peak (numpy 2048^3) {peak / 1e9:.1f} GFLOP/s"
            + (f"; oneDNN's float32 GEMM at 2048^3 {onednn / 1e9:.1f} GFLOP/s" if onednn == onednn else ""))
