"""NF4 quantization (trainer.quantization) against bitsandbytes, and its kernels against twins.

Everything here is compared with == on bytes: packed nibbles as uint8, every float32 as
its uint32 bit pattern. bitsandbytes runs on the CPU with torch.compile disabled (its
fallback dequantizer is compiled otherwise, seconds per shape; eager and compiled both
compute code * absmax, one float32 product). Its double-quantization offset is
torch.mean, whose CPU sum splits over threads above 32768 elements, so the one test with
more blocks than that pins torch to one thread.
"""

import tracemalloc
import zlib

import numpy as np
import pytest

from native_ext import nf4
from trainer.quantization import (
    BLOCK_SIZES,
    NF4Tensor,
    dequantize_nf4,
    dequantize_rows,
    quantize_nf4,
)

torch = pytest.importorskip("torch")
bnb_functional = pytest.importorskip(
    "bitsandbytes.functional", reason="bitsandbytes is the NF4 reference: pip install bitsandbytes")

F32 = np.float32


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def bits(array):
    """The bytes of an array, for == comparisons that also see -0.0 and NaN payloads."""
    array = np.asarray(array)
    return array.view(np.uint32) if array.dtype == F32 else array


def assert_same(actual, expected, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    differ = np.flatnonzero(bits(actual).reshape(-1) != bits(expected).reshape(-1))
    assert differ.size == 0, (f"{what}: {differ.size} of {actual.size} differ, first at "
                              f"{differ[0]}: {actual.reshape(-1)[differ[0]]!r} != "
                              f"{expected.reshape(-1)[differ[0]]!r}")


@pytest.fixture(scope="module")
def bnb():
    with torch._dynamo.config.patch(disable=True):
        yield bnb_functional


def bnb_reference(bnb, x, block_size, double):
    """bitsandbytes' state and dequantization of x, as numpy arrays."""
    packed, state = bnb.quantize_4bit(torch.from_numpy(x), quant_type="nf4",
                                      blocksize=block_size, compress_statistics=double)
    result = {"packed": packed.numpy().reshape(-1),
              "dequantized": bnb.dequantize_4bit(packed, state).numpy().reshape(-1)}
    if double:
        result.update(absmax_codes=state.absmax.numpy(), absmax_scales=state.state2.absmax.numpy(),
                      offset=state.offset.numpy().reshape(()), map=state.state2.code.numpy())
        assert state.state2.blocksize == 256
    else:
        result["absmax"] = state.absmax.numpy()
    return result


def assert_matches_bnb(bnb, x, block_size, double, what):
    expected = bnb_reference(bnb, x, block_size, double)
    q = quantize_nf4(x, block_size, double_quantization=double)
    assert_same(q.packed, expected["packed"], f"{what} packed")
    if double:
        assert_same(q.absmax_codes, expected["absmax_codes"], f"{what} absmax codes")
        assert_same(q.absmax_scales, expected["absmax_scales"], f"{what} second-level absmax")
        assert_same(np.asarray(q.offset), expected["offset"], f"{what} offset")
        assert_same(nf4.DYNAMIC_MAP, expected["map"], f"{what} dynamic map")
    else:
        assert_same(q.absmax, expected["absmax"], f"{what} absmax")
    dequantized = dequantize_nf4(q)
    assert dequantized.shape == x.shape
    assert_same(dequantized.reshape(-1), expected["dequantized"], f"{what} dequantized")


def rounding_splits(absmax):
    """Values x near absmax * midpoint for which x / absmax and x * (1 / absmax) lie on
    different sides of that NF4 midpoint."""
    midpoints = (nf4.NF4_CODE[:-1] + nf4.NF4_CODE[1:]) / F32(2)
    near = (midpoints * absmax)[:, None]  # [15,1]
    x = (near + np.arange(-4, 5) * np.spacing(near)).astype(F32).reshape(-1)  # [135]
    midpoint = np.repeat(midpoints, 9)  # [135]
    split = (x / absmax > midpoint) != (x * (F32(1) / absmax) > midpoint)
    assert split.sum() >= 4
    return x[split]


def cases(block_size, double):
    """(name, array) pairs that exercise one block size."""
    rng = rng_for("cases", block_size, double)
    B = block_size
    for n in (1, 2, 7, 63, 65, 1001, 4097):  # odd counts pad the last low nibble
        yield f"n={n}", rng.standard_normal(n).astype(F32)
    yield "2-D, last block partial", rng.standard_normal((5, B + 6)).astype(F32)
    yield "2-D, whole blocks", (rng.standard_normal((3, B)) * 0.02).astype(F32)
    zeros = rng.standard_normal(3 * B + 5).astype(F32)
    zeros[B:2 * B] = 0.0  # an all-zero block: absmax 0, scaled by 1 / 1e-38
    zeros[3 * B:] = 0.0  # an all-zero partial block: torch stores the clamped 1e-38
    yield "zero blocks", zeros
    yield "all zeros", np.zeros(2 * B + 3, F32)
    magnitudes = rng.standard_normal(4 * B + 1).astype(F32) * F32(1e30)
    magnitudes[::7] *= F32(1e-35)
    yield "large magnitudes", magnitudes
    if not double:  # near FLT_MAX the reciprocal is subnormal (and the mean would overflow)
        yield "near FLT_MAX", (rng.uniform(-1, 1, 2 * B + 1) * 3.4e38).astype(F32)
    # values whose x / absmax and x * (1 / absmax) straddle a midpoint: full blocks multiply
    # by the reciprocal, the partial last block divides
    splits = np.concatenate([[F32(5.2772126)], rounding_splits(F32(5.2772126))])[:B]
    yield "division vs reciprocal", np.concatenate([np.resize(splits, B), splits[:B - 1]])
    # every NF4 midpoint exactly, in a block whose absmax is 1: ties must go to the lower code
    midpoints = (nf4.NF4_CODE[:-1] + nf4.NF4_CODE[1:]) / F32(2)
    ties = np.resize(np.concatenate([[1.0], midpoints, -midpoints]).astype(F32), B)
    yield "ties", np.concatenate([ties, ties[: B // 2 + 1]])
    tiny = np.zeros(3 * B, F32)  # subnormal absmax 6, 0 and 3 x 2^-149: second-level 1/scale
    tiny[0], tiny[2 * B] = np.array([6, 3], np.uint32).view(F32)  # is inf, 0 * inf is NaN
    yield "subnormal", tiny


def test_tables_are_bitsandbytes(bnb):
    assert_same(nf4.NF4_CODE, bnb.get_4bit_type("nf4", device="cpu").numpy(), "NF4 code")
    assert_same(nf4.DYNAMIC_MAP, bnb.create_dynamic_map(signed=True).numpy(), "dynamic map")


@pytest.mark.parametrize("double", [False, True], ids=["absmax", "double"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_matches_bitsandbytes(bnb, block_size, double):
    for name, x in cases(block_size, double):
        assert_matches_bnb(bnb, x, block_size, double, f"block {block_size}, {name}")


def test_bitsandbytes_refuses_other_block_sizes(bnb):
    for block_size in (16, 8192):
        with pytest.raises(ValueError):
            bnb.quantize_4bit(torch.ones(64), quant_type="nf4", blocksize=block_size)


def test_offset_beyond_one_thread_sum(bnb):
    # 33000 absmax values: above torch's 32768 grain the mean's sum is split per thread
    x = rng_for("many blocks").standard_normal((33000, 32)).astype(F32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert_matches_bnb(bnb, x, 32, True, "33000 blocks")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 31, 64, 100, 4099, 70001, 300007, 17_000_003])
def test_absmax_mean_is_torch_mean(n):
    absmax = np.abs(rng_for("mean", n).standard_normal(n)).astype(F32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = torch.from_numpy(absmax).mean().numpy().reshape(())
    finally:
        torch.set_num_threads(threads)
    assert_same(np.asarray(nf4.absmax_mean(absmax)), expected, f"mean of {n}")


def test_absmax_quantizer_is_bitsandbytes_quantize_blockwise(bnb):
    # 2^20 values, dense enough to land in the narrow bands where bitsandbytes' fused
    # index computation and a two-rounding one disagree; every 256-block holds a 1.0 or a
    # random scale
    rng = rng_for("blockwise")
    values = rng.uniform(-1, 1, 1 << 20).astype(F32)
    values[::256] = 1.0
    values[(1 << 19)::256] = rng.uniform(0.1, 10, 1 << 11).astype(F32)
    values[(1 << 19):] *= np.repeat(rng.uniform(1e-3, 1e3, 1 << 11), 256).astype(F32)
    codes, state = bnb.quantize_blockwise(torch.from_numpy(values), blocksize=256)
    mine = np.empty(values.shape[0], np.uint8), np.empty(values.shape[0] // 256, F32)
    nf4.quantize_absmax(values, 0.0, *mine)
    assert_same(mine[0], codes.numpy(), "codes")
    assert_same(mine[1], state.absmax.numpy(), "scales")
    theirs = np.empty_like(mine[0]), np.empty_like(mine[1])
    nf4.reference_quantize_absmax(values, 0.0, *theirs)
    assert_same(theirs[0], mine[0], "twin codes")


# -- kernels against their numpy twins -------------------------------------------------------


def twins(kernel, twin, inputs, outputs):
    """Run kernel and twin on fresh copies of the output buffers; return both results."""
    mine = [o.copy() for o in outputs]
    theirs = [o.copy() for o in outputs]
    result = (kernel(*inputs, *mine), twin(*inputs, *theirs))
    return mine, theirs, result


@pytest.mark.parametrize("block_size", [32, 64, 256, 4096])
def test_quantize_kernel_matches_twin(block_size):
    rng = rng_for("quantize twin", block_size)
    for n in (1, 5, block_size, block_size + 1, 3 * block_size - 1, 10_001):
        x = (rng.standard_normal(n) * rng.choice([1e-20, 1.0, 1e20])).astype(F32)
        x[rng.integers(0, n, n // 5)] = 0.0
        packed = np.full((n + 1) // 2, 0xAA, np.uint8)
        absmax = np.full(-(-n // block_size), np.nan, F32)
        mine, theirs, (bad_k, bad_t) = twins(
            lambda *a: nf4.quantize(*a), lambda *a: nf4.reference_quantize(*a),
            (x, block_size), (packed, absmax))
        assert bad_k == bad_t == -1
        for k, t, name in zip(mine, theirs, ("packed", "absmax")):
            assert_same(k, t, f"n={n} {name}")


def test_quantize_kernel_reports_the_first_non_finite():
    x = np.ones(300, F32)
    x[[77, 200]] = [np.inf, np.nan]
    packed, absmax = np.empty(150, np.uint8), np.empty(5, F32)
    assert nf4.quantize(x, 64, packed, absmax) == 77
    assert nf4.reference_quantize(x, 64, packed, absmax) == 77


@pytest.mark.parametrize("double", [False, True])
def test_dequantize_kernel_matches_twin(double):
    rng = rng_for("dequantize twin", double)
    n, block_size = 5001, 64
    x = rng.standard_normal(n).astype(F32)
    q = quantize_nf4(x, block_size, double_quantization=double)
    for start, count in [(0, n), (1, 100), (63, 2), (64, 64), (4999, 2), (5000, 1), (17, 0)]:
        out_k = np.full(count, np.nan, F32)
        out_t = out_k.copy()
        if double:
            state = (q.absmax_codes, q.absmax_scales, q.offset)
            nf4.dequantize_double(q.packed, block_size, start, out_k, *state)
            nf4.reference_dequantize_double(q.packed, block_size, start, out_t, *state)
        else:
            nf4.dequantize(q.packed, block_size, start, out_k, q.absmax)
            nf4.reference_dequantize(q.packed, block_size, start, out_t, q.absmax)
        assert_same(out_k, out_t, f"elements {start}..{start + count}")


# each x86 version of the dequantizer's inner loop, asked for by name in a fresh process (it is chosen once)
DEQUANTIZE_CHILD = """
import hashlib, sys, zlib
import numpy as np
from native_ext import nf4
from trainer.quantization import quantize_nf4

digest = hashlib.sha256()
for double in (False, True):
    x = np.random.default_rng(zlib.crc32(b"pairs")).standard_normal(9001).astype(np.float32)
    q = quantize_nf4(x, 64, double_quantization=double)
    for start, count in [(0, 9001), (1, 8999), (63, 130), (64, 64), (3, 31), (5, 33), (8999, 2), (17, 0)]:
        out = np.full(count, np.nan, np.float32)
        if double:
            nf4.dequantize_double(q.packed, 64, start, out, q.absmax_codes, q.absmax_scales, q.offset)
        else:
            nf4.dequantize(q.packed, 64, start, out, q.absmax)
        digest.update(out.tobytes())
print(digest.hexdigest())
"""


@pytest.mark.parametrize("version,flag", [("portable", None), ("avx2", "avx2"), ("avx512", "avx512f")])
def test_every_dequantizer_version_gives_the_twins_bytes(version, flag):
    """The register-table versions (AVX2, AVX-512) and the portable loop: the same bytes as the numpy twin."""
    import os
    import subprocess
    import sys

    from trainer.runs.execution import device_identity

    if flag is not None and flag not in (device_identity()["cpu_flags"] or ()):
        pytest.skip(f"this CPU has no {flag}: the {version} version cannot run here")
    expected = __import__("hashlib").sha256()
    for double in (False, True):
        x = np.random.default_rng(zlib.crc32(b"pairs")).standard_normal(9001).astype(F32)
        q = quantize_nf4(x, 64, double_quantization=double)
        for start, count in [(0, 9001), (1, 8999), (63, 130), (64, 64), (3, 31), (5, 33), (8999, 2), (17, 0)]:
            out = np.full(count, np.nan, F32)
            if double:
                nf4.reference_dequantize_double(q.packed, 64, start, out, q.absmax_codes, q.absmax_scales, q.offset)
            else:
                nf4.reference_dequantize(q.packed, 64, start, out, q.absmax)
            expected.update(out.tobytes())
    env = {**os.environ, "KILN_NF4_PAIRS": version}
    out = subprocess.run([sys.executable, "-c", DEQUANTIZE_CHILD], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == expected.hexdigest()


@pytest.mark.parametrize("n", [1, 7, 8, 31, 32, 33, 257, 4099, 70001])
def test_absmax_mean_kernel_matches_twin(n):
    absmax = np.abs(rng_for("mean twin", n).standard_normal(n)).astype(F32) * F32(1e3)
    assert_same(np.asarray(nf4.absmax_mean(absmax)), np.asarray(nf4.reference_absmax_mean(absmax)),
                f"mean of {n}")


def test_quantize_absmax_kernel_matches_twin():
    rng = rng_for("absmax twin")
    tiny = np.array([6, 0, 3], np.uint32).view(F32)  # scale 3 x 2^-149: 1/scale is inf
    for absmax in (np.abs(rng.standard_normal(1000)).astype(F32), np.full(300, 0.5, F32),
                   np.array([2.0], F32), tiny):
        offset = nf4.absmax_mean(absmax)
        codes = np.full(absmax.shape[0], 0xAA, np.uint8)
        scales = np.full(-(-absmax.shape[0] // 256), np.nan, F32)
        mine, theirs, _ = twins(nf4.quantize_absmax, nf4.reference_quantize_absmax,
                                (absmax, offset), (codes, scales))
        for k, t, name in zip(mine, theirs, ("codes", "scales")):
            assert_same(k, t, f"{absmax.shape[0]} absmax {name}")


# -- row dequantization --------------------------------------------------------------------


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("shape,block_size", [((37, 45), 32), ((9, 1000), 64), ((3, 4096), 4096),
                                              ((1, 7), 64)])
def test_dequantize_rows_equals_slices_of_the_whole(shape, block_size, double):
    x = rng_for("rows", shape, block_size).standard_normal(shape).astype(F32)
    q = quantize_nf4(x, block_size, double_quantization=double)
    whole = dequantize_nf4(q)
    rows = shape[0]
    ranges = {(0, rows), (0, 1), (rows - 1, rows), (rows // 2, rows), (rows // 3, rows // 3),
              (1, max(1, rows - 1))}
    for start, end in sorted(ranges):
        out = np.full((end - start, shape[1]), np.nan, F32)
        assert dequantize_rows(q, start, end, out) is out
        assert_same(out, whole[start:end], f"rows {start}..{end}")


def test_dequantize_rows_allocates_no_full_weight():
    rows, cols = 1024, 1024  # a 4 MiB FP32 weight
    q = quantize_nf4(rng_for("memory").standard_normal((rows, cols)).astype(F32),
                     double_quantization=True)
    out = np.empty((16, cols), F32)
    tracemalloc.start()
    try:
        for start in range(0, rows, 16):
            dequantize_rows(q, start, start + 16, out)
        _, rows_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        dequantize_nf4(q)  # the control: tracemalloc does see numpy's buffers
        _, whole_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert whole_peak >= rows * cols * 4
    assert rows_peak < 16 * 1024, f"dequantize_rows allocated {rows_peak} bytes"


# -- the NF4Tensor and its validation ----------------------------------------------------------


def test_nbytes_counts_packed_and_scales():
    x = np.ones((10, 101), F32)  # 1010 elements: 505 bytes, 16 blocks of 64
    assert quantize_nf4(x).nbytes == 505 + 16 * 4
    assert quantize_nf4(x, double_quantization=True).nbytes == 505 + 16 + 4 + 4
    assert quantize_nf4(x, 4096).nbytes == 505 + 4


def test_state_is_read_only_and_rebuildable():
    x = rng_for("rebuild").standard_normal((8, 24)).astype(F32)
    q = quantize_nf4(x, 32, double_quantization=True)
    with pytest.raises(ValueError):
        q.packed[0] = 0
    copy = NF4Tensor(q.packed.copy(), q.shape, q.block_size, absmax_codes=q.absmax_codes.copy(),
                     absmax_scales=q.absmax_scales.copy(), offset=float(q.offset))
    assert_same(dequantize_nf4(copy), dequantize_nf4(q), "rebuilt")


def test_refuses_bad_input():
    good = np.ones((4, 64), F32)
    with pytest.raises(TypeError, match="float32"):
        quantize_nf4(good.astype(np.float64))
    with pytest.raises(TypeError, match="numpy array"):
        quantize_nf4([[1.0, 2.0]])
    for bad in (np.nan, np.inf, -np.inf):
        x = good.copy()
        x[2, 5] = bad
        with pytest.raises(ValueError, match=r"non-finite value: element \(2, 5\)"):
            quantize_nf4(x)
    for block_size in (16, 100, 8192, True, 64.5):
        with pytest.raises(ValueError, match="block_size"):
            quantize_nf4(good, block_size)
    with pytest.raises(ValueError, match="empty"):
        quantize_nf4(np.ones((0, 3), F32))
    with pytest.raises(ValueError, match="double quantization overflows"):
        quantize_nf4(np.full(256, 3e38, F32), 32, double_quantization=True)


def test_refuses_bad_rows_and_state():
    q = quantize_nf4(np.ones((4, 64), F32))
    with pytest.raises(ValueError, match="outside"):
        dequantize_rows(q, 3, 5, np.empty((2, 64), F32))
    with pytest.raises(ValueError, match="expected"):
        dequantize_rows(q, 0, 2, np.empty((3, 64), F32))
    with pytest.raises(TypeError, match="float32"):
        dequantize_rows(q, 0, 2, np.empty((2, 64)))
    with pytest.raises(ValueError, match="contiguous"):
        dequantize_rows(q, 0, 2, np.empty((64, 2), F32).T)
    with pytest.raises(ValueError, match="2-D"):
        dequantize_rows(quantize_nf4(np.ones(64, F32)), 0, 1, np.empty((1, 64), F32))
    with pytest.raises(ValueError, match="expected"):
        NF4Tensor(q.packed[:-1].copy(), q.shape, 64, absmax=q.absmax)
    with pytest.raises(ValueError, match="either absmax"):
        NF4Tensor(q.packed, q.shape, 64, absmax=q.absmax, offset=0.0)
    with pytest.raises(ValueError, match="needs absmax"):
        NF4Tensor(q.packed, q.shape, 64)


def test_dequantizing_gives_the_same_bytes_on_any_thread_count():
    """A range longer than one chunk of nf4_parallel.h (65,536 elements), from an odd start, on 1, 2 and 3 threads
    of the shared pool, plain and double-quantized: the bytes of one call on one thread."""
    from native_ext import _nf4

    x = np.random.default_rng(zlib.crc32(b"threads")).standard_normal(300_001).astype(F32)
    for double in (False, True):
        q = quantize_nf4(x, 64, double_quantization=double)
        outputs = []
        for threads in (1, 2, 3):
            out = np.full(270_001, np.nan, F32)
            if double:
                _nf4.dequantize_double(q.packed, 64, 17, out, q.absmax_codes, q.absmax_scales, nf4.DYNAMIC_MAP,
                                       F32(q.offset), threads)
            else:
                _nf4.dequantize(q.packed, 64, 17, out, q.absmax, threads)
            outputs.append(out.tobytes())
        assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
        expected = np.full(270_001, np.nan, F32)
        if double:
            nf4.reference_dequantize_double(q.packed, 64, 17, expected, q.absmax_codes, q.absmax_scales, q.offset)
        else:
            nf4.reference_dequantize(q.packed, 64, 17, expected, q.absmax)
        assert outputs[0] == expected.tobytes()
