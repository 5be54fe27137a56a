"""bench/gemm_call.py: its ctypes column computes the product blas.gemm computes (the same dnnl_sgemm call), and
the script runs and prints one row per shape (the arithmetic and the output, not the timing)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gemm_call  # noqa: E402

from native_ext import blas, onednn  # noqa: E402


def test_the_ctypes_column_is_the_same_product():
    if onednn.float32_unavailable_reason() is not None:
        pytest.skip(onednn.float32_unavailable_reason())
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((9, 13), dtype=np.float32), rng.standard_normal((13, 6), dtype=np.float32)
    direct, ours = np.empty((9, 6), np.float32), np.empty((9, 6), np.float32)
    gemm_call.ctypes_onednn(direct, a, b)()
    with blas.routed(onednn.sgemm):
        blas.gemm(ours, a, b)
    assert np.array_equal(direct, ours)


def test_the_script_prints_a_row_per_shape():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gemm_call.py"), "--calls", "20"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if " x " in line and "M x K" not in line]
    assert [row.split()[0:5:2] for row in rows] == [[str(m), str(k), str(n)] for m, k, n in gemm_call.SHAPES]
