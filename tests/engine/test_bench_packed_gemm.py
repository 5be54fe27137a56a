"""bench/packed_gemm.py's prototype computes the products it is timed on (numbers, not speed)."""

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import packed_gemm  # noqa: E402
from machine import cpu  # noqa: E402

pytestmark = [
    pytest.mark.skipif(shutil.which("gcc") is None, reason="the prototype is built with gcc, which is absent"),
    pytest.mark.skipif("avx512f" not in cpu()[1], reason="the prototype needs AVX-512 (avx512f), which this CPU lacks"),
]


@pytest.mark.parametrize("threads", [1, 2])
def test_prototype_matches_numpy(threads):
    with tempfile.TemporaryDirectory() as directory:
        lib = packed_gemm.build(directory)
        # measure() raises SystemExit when either product differs from numpy's by 1e-5 relative or more
        results = packed_gemm.measure(lib, rows=64, layers=1, threads=threads)
    assert [(N, K) for N, K, *_ in results] == packed_gemm.SHAPES
    assert all(np.isfinite(r[2:]).all() and min(r[2:]) > 0 for r in results)


def test_a_wrong_product_is_refused(monkeypatch):
    with tempfile.TemporaryDirectory() as directory:
        lib = packed_gemm.build(directory)
        monkeypatch.setattr(lib, "bwd", lambda *args: None)  # leaves dx at zeros
        with pytest.raises(SystemExit, match="input gradient is wrong"):
            packed_gemm.measure(lib, rows=64, layers=1, threads=1)
