"""runtime.cu itself, without a GPU: the real native_ext/cuda/runtime.cu compiled by g++ as C++ (it has no device
code) and linked with fake_cuda_runtime.cpp, a CUDA runtime and cuBLAS on host memory written against the real
cuda_runtime.h and cublas_v2.h. The host emulation the other CUDA tests use replaces runtime.cu entirely, so this
is where its operand swap, transpose flags, leading dimensions, strides, math modes, compute types, handle set-up,
argument guards and error recording are checked.

The fake's GEMMs are a column-major reference that accumulates in double and checks its arguments as cuBLAS
documents, so a product equals numpy's float64 result rounded once to float32 (|difference| <= 2^-24 |expected|
elementwise, plus 1e-12 for two double sums added in different orders). Dimension letters: row-major
C[M,N] = alpha op(A)[M,K] op(B)[K,N] + beta C, as in native_ext/cuda/kiln_cuda.h.
"""

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import sysconfig
from ctypes import byref, c_char_p, c_float, c_int, c_longlong, c_size_t, c_void_p
from pathlib import Path

import numpy as np
import pytest

from native_ext import cuda
from native_ext.cuda import DeviceArray

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "native_ext" / "cuda"
FAKE_SOURCE = Path(__file__).resolve().parent / "fake_cuda_runtime.cpp"
ABI = {name: int(value) for name, value in
       re.findall(r"^#define KILN_CUDA_(\w+) (\d+)", (CUDA_DIR / "kiln_cuda.h").read_text(), re.M)}
NEVER = -(2 ** 63)  # kiln_fake_get's answer for a name it never recorded (LLONG_MIN)

M, N, K = 5, 3, 4  # distinct, so a swapped dimension cannot go unnoticed
BATCH = 3
ALPHA, BETA = 0.75, -1.25  # exact in float32, neither 0 nor 1
WORKSPACE = 1 << 16
PRECISIONS = {0: ("CUBLAS_PEDANTIC_MATH", "CUBLAS_COMPUTE_32F_PEDANTIC"),
              1: ("CUBLAS_TF32_TENSOR_OP_MATH", "CUBLAS_COMPUTE_32F_FAST_TF32"),
              2: ("CUBLAS_DEFAULT_MATH", "CUBLAS_COMPUTE_32F_FAST_16BF")}
TRANSPOSES = [(0, 0), (0, 1), (1, 0), (1, 1)]


def _cuda_include():
    """The CUDA toolkit's include directory (cuda_runtime.h): $CUDA_HOME, $CUDA_PATH, nvcc's, /usr/local/cuda."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    for nvcc in (os.environ.get("KILN_NVCC"), shutil.which("nvcc")):
        if nvcc:
            homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    homes.append("/usr/local/cuda")
    return next((os.path.join(h, "include") for h in homes
                 if h and os.path.isfile(os.path.join(h, "include", "cuda_runtime.h"))), None)


def _cublas_include(cuda_include):
    """cublas_v2.h's directory, where setup.py's find_cublas looks: $KILN_CUBLAS_HOME, the nvidia-cublas wheel
    (CUDA 13 and 12 layouts), then the toolkit."""
    homes = [os.environ.get("KILN_CUBLAS_HOME")]
    for key in ("purelib", "platlib"):
        site = sysconfig.get_paths()[key]
        homes += [os.path.join(site, "nvidia", "cu13"), os.path.join(site, "nvidia", "cublas")]
    homes.append(os.path.dirname(cuda_include))
    return next((os.path.join(h, "include") for h in homes
                 if h and os.path.isfile(os.path.join(h, "include", "cublas_v2.h"))), None)


@pytest.fixture(scope="session")
def runtime_build(tmp_path_factory):
    """runtime.cu and the fake linked into one .so, once per session; every symbol resolved at link time."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to compile runtime.cu for the host")
    cuda_include = _cuda_include()
    if cuda_include is None:
        pytest.skip("the CUDA toolkit's headers (cuda_runtime.h) are not installed: set CUDA_HOME")
    cublas_include = _cublas_include(cuda_include)
    if cublas_include is None:
        pytest.skip("the cuBLAS headers are not installed: `pip install nvidia-cublas` (./dev does)")
    output = tmp_path_factory.mktemp("cuda-runtime-host") / "libkiln_cuda_runtime_host.so"
    subprocess.run([compiler, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
                    "-Wl,--no-undefined", "-I", str(CUDA_DIR), "-isystem", cuda_include, "-isystem", cublas_include,
                    "-x", "c++", str(CUDA_DIR / "runtime.cu"), "-x", "none", str(FAKE_SOURCE), "-o", str(output)],
                   check=True)
    return output


class Fake:
    """The fake's own exports: what runtime.cu called it with, and one-shot failures to inject."""

    def __init__(self, library):
        self._library = library
        for name, restype, argtypes in (("kiln_fake_get", c_longlong, [c_char_p]),
                                        ("kiln_fake_handle", c_longlong, [c_char_p]),
                                        ("kiln_fake_constant", c_longlong, [c_char_p]),
                                        ("kiln_fake_allocation_bytes", c_longlong, [c_void_p]),
                                        ("kiln_fake_fail", None, [c_char_p, c_int]),
                                        ("kiln_fake_clear", None, [])):
            function = getattr(library, name)
            function.restype, function.argtypes = restype, argtypes

    def _known(self, function, name):
        value = function(name.encode())
        assert value != NEVER, f"{function.__name__}({name!r}): never recorded"
        return value

    def get(self, name):
        return self._known(self._library.kiln_fake_get, name)

    def handle(self, field):
        """FIELD of the handle cublasCreate made last (it must still be live)."""
        return self._known(self._library.kiln_fake_handle, field)

    def constant(self, name):
        return self._known(self._library.kiln_fake_constant, name)

    def allocation_bytes(self, pointer):
        return self._library.kiln_fake_allocation_bytes(pointer)

    def fail(self, function, status):
        self._library.kiln_fake_fail(function.encode(), status)

    def clear(self):
        self._library.kiln_fake_clear()


@pytest.fixture(scope="session")
def loaded(runtime_build):
    """(library, fake): the kiln_cuda_* exports bound through native_ext.cuda's SYMBOLS table."""
    library = ctypes.CDLL(str(runtime_build), mode=os.RTLD_LOCAL)
    exported = {name for name in cuda.elf_dynamic_symbols(runtime_build) if name.startswith("kiln_cuda_")}
    defined = set(re.findall(r"^[a-z].*?\b(kiln_cuda_\w+)\(", (CUDA_DIR / "runtime.cu").read_text(), re.M))
    assert exported == defined, f"exported {sorted(exported ^ defined)} differ from runtime.cu's definitions"
    assert exported <= set(cuda.SYMBOLS), f"not in SYMBOLS: {sorted(exported - set(cuda.SYMBOLS))}"
    for name in exported:
        function = getattr(library, name)
        function.restype, function.argtypes = cuda.SYMBOLS[name]
    return library, Fake(library)


@pytest.fixture
def library(loaded):
    return loaded[0]


@pytest.fixture
def fake(loaded):
    """The fake, with no failure pending before the test and every injected failure consumed after it."""
    loaded[1].clear()
    yield loaded[1]
    pending = loaded[1].get("pending_failures")
    loaded[1].clear()
    assert pending == 0, "a failure the test injected was never returned: runtime.cu did not make that call"


def _message(library):
    return cuda.last_error(library)


@contextlib.contextmanager
def _blas(library, stream=None, workspace_bytes=WORKSPACE):
    handle = c_void_p(0)
    cuda.check(library, library.kiln_cuda_blas_create(byref(handle), stream, workspace_bytes), "kiln_cuda_blas_create")
    try:
        yield handle.value
    finally:
        cuda.check(library, library.kiln_cuda_blas_destroy(handle.value), "kiln_cuda_blas_destroy")


@contextlib.contextmanager
def _stream(library):
    stream = c_void_p(0)
    cuda.check(library, library.kiln_cuda_stream_create(byref(stream)), "kiln_cuda_stream_create")
    try:
        yield stream.value
    finally:
        cuda.check(library, library.kiln_cuda_stream_destroy(stream.value), "kiln_cuda_stream_destroy")


def _counts(fake):
    return {name: fake.get(name) for name in ("live_allocations", "live_handles", "live_streams", "live_events")}


def _assert_rounded(actual, expected, what):
    """ACTUAL (float32) is EXPECTED (float64) rounded once to float32."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, what
    excess = np.abs(actual - expected) - (2.0 ** -24 * np.abs(expected) + 1e-12)
    assert np.all(excess <= 0), f"{what}: off by up to {np.max(excess):.3e} beyond float32 rounding"


def _operands(rng, trans_a, trans_b, batch=None):
    """Stored A, B and C with leading dimensions past their rows (A by 2, B by 1, C by 3: all different), and
    with a batch, a spare row between matrices (strides past rows * ld). Returns the arrays and the views
    op(A) [.., M, K], op(B) [.., K, N], C [.., M, N] the product reads."""
    lead = () if batch is None else (batch,)
    spare = 0 if batch is None else 1
    a_rows, a_columns = (K, M) if trans_a else (M, K)  # row-major storage of A: op(A) = A^T when trans_a
    b_rows, b_columns = (N, K) if trans_b else (K, N)
    a = rng.standard_normal(lead + (a_rows + spare, a_columns + 2)).astype(np.float32)
    b = rng.standard_normal(lead + (b_rows + spare, b_columns + 1)).astype(np.float32)
    c = rng.standard_normal(lead + (M + spare, N + 3)).astype(np.float32)
    a_view = a[..., :a_rows, :a_columns]
    b_view = b[..., :b_rows, :b_columns]
    op_a = np.swapaxes(a_view, -1, -2) if trans_a else a_view
    op_b = np.swapaxes(b_view, -1, -2) if trans_b else b_view
    return a, b, c, op_a, op_b


def _expected(op_a, op_b, c):
    return ALPHA * (op_a.astype(np.float64) @ op_b.astype(np.float64)) + BETA * c[..., :M, :N].astype(np.float64)


@contextlib.contextmanager
def _on_device(library, *arrays):
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(DeviceArray.from_host(library, array)) for array in arrays]


def _gemm(library, blas, trans_a, trans_b, a, b, c, precision=0, **changes):
    """kiln_cuda_gemm on device copies of A, B, C (ld = the stored row length); CHANGES overrides an argument.
    Returns (status, C after)."""
    with _on_device(library, a, b, c) as (da, db, dc):
        arguments = dict(M=M, N=N, K=K, lda=a.shape[-1], ldb=b.shape[-1], ldc=c.shape[-1], precision=precision)
        arguments.update(changes)
        status = library.kiln_cuda_gemm(blas, trans_a, trans_b, arguments["M"], arguments["N"], arguments["K"], ALPHA,
                                    da.ptr, arguments["lda"], db.ptr, arguments["ldb"], BETA, dc.ptr,
                                    arguments["ldc"], arguments["precision"])
        return status, dc.to_host()


def _batched(library, blas, trans_a, trans_b, a, b, c, precision=0, **changes):
    """kiln_cuda_gemm_strided_batched over the leading axis of A, B, C (stride = one matrix with its spare row)."""
    with _on_device(library, a, b, c) as (da, db, dc):
        arguments = dict(M=M, N=N, K=K, lda=a.shape[-1], ldb=b.shape[-1], ldc=c.shape[-1], batch=a.shape[0],
                         precision=precision)
        arguments.update(changes)
        status = library.kiln_cuda_gemm_strided_batched(
            blas, trans_a, trans_b, arguments["M"], arguments["N"], arguments["K"], ALPHA, da.ptr, arguments["lda"],
            a[0].size, db.ptr, arguments["ldb"], b[0].size, BETA, dc.ptr, arguments["ldc"], c[0].size,
            arguments["batch"], arguments["precision"])
        return status, dc.to_host()


@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
def test_gemm_on_row_major_views_equals_numpy_and_leaves_the_padding(library, fake, trans_a, trans_b):
    a, b, c, op_a, op_b = _operands(np.random.default_rng(10 * trans_a + trans_b), trans_a, trans_b)
    with _blas(library) as blas:
        status, out = _gemm(library, blas, trans_a, trans_b, a, b, c)
    assert status == 0, _message(library)
    _assert_rounded(out[:, :N], _expected(op_a, op_b, c), f"C, trans_a={trans_a} trans_b={trans_b}")
    assert np.array_equal(out[:, N:], c[:, N:]), "columns of C past N were written"
    # row-major C = op(A) op(B) went to cuBLAS as column-major C^T = op(B)^T op(A)^T: B first, N and M swapped
    op = {0: fake.constant("CUBLAS_OP_N"), 1: fake.constant("CUBLAS_OP_T")}
    called = {key: fake.get(f"gemm.{key}") for key in ("transa", "transb", "m", "n", "k", "lda", "ldb", "ldc")}
    assert called == {"transa": op[trans_b], "transb": op[trans_a], "m": N, "n": M, "k": K,
                      "lda": b.shape[1], "ldb": a.shape[1], "ldc": c.shape[1]}
    assert fake.get("gemm.batched") == 0


@pytest.mark.parametrize("trans_a,trans_b", TRANSPOSES)
def test_strided_batched_gemm_equals_numpy_per_matrix_and_leaves_the_gaps(library, fake, trans_a, trans_b):
    a, b, c, op_a, op_b = _operands(np.random.default_rng(20 + 10 * trans_a + trans_b), trans_a, trans_b, BATCH)
    with _blas(library) as blas:
        status, out = _batched(library, blas, trans_a, trans_b, a, b, c)
    assert status == 0, _message(library)
    _assert_rounded(out[:, :M, :N], _expected(op_a, op_b, c), f"C, trans_a={trans_a} trans_b={trans_b}")
    written = np.zeros(c.shape, bool)
    written[:, :M, :N] = True
    assert np.array_equal(out[~written], c[~written]), "C's padding columns or spare rows were written"
    called = tuple(fake.get(f"gemm.{key}") for key in ("batched", "batch", "m", "n"))
    assert called == (1, BATCH, N, M)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("entry", ["gemm", "strided_batched"])
def test_each_precision_sets_its_math_mode_and_compute_type(library, fake, precision, entry):
    rng = np.random.default_rng(30)
    run = _gemm if entry == "gemm" else _batched
    a, b, c, _, _ = _operands(rng, 0, 1, None if entry == "gemm" else BATCH)
    math, compute = PRECISIONS[precision]
    with _blas(library) as blas:
        for asked in ((precision + 1) % 3, precision):  # another precision first: its mode must not linger
            status, _ = run(library, blas, 0, 1, a, b, c, precision=asked)
            assert status == 0, _message(library)
        assert fake.get("gemm.math") == fake.constant(math), f"precision {precision}: not {math}"
        assert fake.get("gemm.compute") == fake.constant(compute), f"precision {precision}: not {compute}"
        assert fake.get("gemm.algo") == fake.constant("CUBLAS_GEMM_DEFAULT")


@pytest.mark.parametrize("precision", [3, -1])
def test_an_unknown_precision_is_refused_naming_the_precisions(library, fake, precision):
    a, b, c, _, _ = _operands(np.random.default_rng(40), 0, 0)
    with _blas(library) as blas:
        calls = fake.get("gemm.calls")
        status, out = _gemm(library, blas, 0, 0, a, b, c, precision=precision)
        assert status == ABI["BAD_ARGUMENT"]
        assert "precision must be 0 (FP32), 1 (TF32) or 2 (BF16)" in _message(library)
        status, _ = _batched(library, blas, 0, 0, *_operands(np.random.default_rng(41), 0, 0, BATCH)[:3],
                             precision=precision)
        assert status == ABI["BAD_ARGUMENT"]
        assert fake.get("gemm.calls") == calls
    assert np.array_equal(out, c)


def _small_gemm(library, blas):
    a, b, c, _, _ = _operands(np.random.default_rng(50), 0, 0)
    status, _ = _gemm(library, blas, 0, 0, a, b, c)
    assert status == 0, _message(library)


def test_blas_create_sets_the_stream_the_workspace_pedantic_math_and_no_atomics(library, fake):
    before = _counts(fake)
    with _stream(library) as stream, _stream(library) as other:
        assert fake.get("stream.flags") == fake.constant("cudaStreamNonBlocking")
        with _blas(library, stream, WORKSPACE) as blas:
            workspace = fake.handle("workspace")
            assert fake.allocation_bytes(workspace) == WORKSPACE
            assert (fake.handle("user_workspace"), fake.handle("workspace_bytes")) == (1, WORKSPACE)
            assert fake.handle("stream") == stream
            assert fake.handle("math") == fake.constant("CUBLAS_PEDANTIC_MATH")
            assert fake.handle("atomics") == fake.constant("CUBLAS_ATOMICS_NOT_ALLOWED")
            _small_gemm(library, blas)
            assert (fake.get("gemm.stream"), fake.get("gemm.workspace")) == (stream, workspace)
            assert fake.get("gemm.atomics") == fake.constant("CUBLAS_ATOMICS_NOT_ALLOWED")
            # cublasSetStream resets a handle to cuBLAS's default workspace pool: the fixed one must be set again
            assert library.kiln_cuda_blas_set_stream(blas, other) == 0, _message(library)
            _small_gemm(library, blas)
            assert fake.get("gemm.stream") == other
            assert (fake.get("gemm.user_workspace"), fake.get("gemm.workspace"),
                    fake.get("gemm.workspace_bytes")) == (1, workspace, WORKSPACE), "the fixed workspace was dropped"
        assert fake.allocation_bytes(workspace) == -1, "destroy left the workspace allocated"
    assert _counts(fake) == before


def test_a_failed_workspace_allocation_destroys_the_handle_and_names_the_workspace(library, fake):
    before = _counts(fake)
    fake.fail("cudaMalloc", fake.constant("cudaErrorMemoryAllocation"))
    handle = c_void_p(0)
    status = library.kiln_cuda_blas_create(byref(handle), None, WORKSPACE)
    assert status == fake.constant("cudaErrorMemoryAllocation")
    assert _message(library).startswith("cudaMalloc(cuBLAS workspace): cudaErrorMemoryAllocation"), _message(library)
    assert handle.value is None
    assert _counts(fake) == before, "the cuBLAS handle or an allocation leaked"


def test_a_failed_cublas_create_is_reported_with_its_status(library, fake):
    before = _counts(fake)
    fake.fail("cublasCreate", fake.constant("CUBLAS_STATUS_ALLOC_FAILED"))
    handle = c_void_p(0)
    status = library.kiln_cuda_blas_create(byref(handle), None, WORKSPACE)
    assert status == ABI["BLAS_STATUS_BASE"] + fake.constant("CUBLAS_STATUS_ALLOC_FAILED")
    assert _message(library) == (f"cublasCreate: CUBLAS_STATUS_ALLOC_FAILED (cublasStatus "
                             f"{fake.constant('CUBLAS_STATUS_ALLOC_FAILED')})")
    assert handle.value is None
    assert _counts(fake) == before


@pytest.mark.parametrize("function", ["cublasSetStream", "cublasSetWorkspace", "cublasSetMathMode",
                                      "cublasSetAtomicsMode"])
def test_a_failed_handle_setting_frees_the_handle_and_the_workspace(library, fake, function):
    before = _counts(fake)
    fake.fail(function, fake.constant("CUBLAS_STATUS_NOT_SUPPORTED"))
    handle = c_void_p(0)
    status = library.kiln_cuda_blas_create(byref(handle), None, WORKSPACE)
    assert status == ABI["BLAS_STATUS_BASE"] + fake.constant("CUBLAS_STATUS_NOT_SUPPORTED")
    assert _message(library).startswith(function), _message(library)
    assert handle.value is None
    assert _counts(fake) == before, "the cuBLAS handle or the workspace leaked"


@pytest.mark.parametrize("argument", ["M", "N", "K", "lda", "ldb", "ldc", "batch"])
@pytest.mark.parametrize("value", [2 ** 31, -1])
def test_a_dimension_outside_int_is_refused_before_cublas(library, fake, argument, value):
    rng = np.random.default_rng(60)
    with _blas(library) as blas:
        calls = fake.get("gemm.calls")
        runs = [(_batched, _operands(rng, 0, 0, BATCH))] + ([] if argument == "batch" else
                                                             [(_gemm, _operands(rng, 0, 0))])
        for run, (a, b, c, _, _) in runs:
            status, out = run(library, blas, 0, 0, a, b, c, **{argument: value})
            assert status == ABI["BAD_ARGUMENT"], f"{run.__name__} {argument}={value}: {status}"
            assert "a GEMM dimension is negative or above 2^31-1" in _message(library)
            assert np.array_equal(out, c)
        assert fake.get("gemm.calls") == calls


def test_a_dimension_of_2_to_the_31_minus_1_passes_the_guard(library, fake):
    a, b, c, _, _ = _operands(np.random.default_rng(61), 0, 0)
    with _blas(library) as blas:
        status, out = _gemm(library, blas, 0, 0, a, b, c, M=2 ** 31 - 1)
    assert fake.get("gemm.n") == 2 ** 31 - 1, "cuBLAS was not called with M as its n"
    # the fake refuses a C that reaches past its allocation, where a GPU would fault
    assert status == ABI["BLAS_STATUS_BASE"] + fake.constant("CUBLAS_STATUS_EXECUTION_FAILED")
    assert np.array_equal(out, c)


@pytest.mark.parametrize("changes", [dict(M=0), dict(N=0), dict(batch=0)])
def test_an_empty_product_returns_0_without_calling_cublas(library, fake, changes):
    rng = np.random.default_rng(62)
    with _blas(library) as blas:
        calls = fake.get("gemm.calls")
        runs = [(_batched, _operands(rng, 1, 0, BATCH))] + ([] if "batch" in changes else
                                                             [(_gemm, _operands(rng, 1, 0))])
        for run, (a, b, c, _, _) in runs:
            status, out = run(library, blas, 1, 0, a, b, c, **changes)
            assert status == 0, _message(library)
            assert np.array_equal(out, c)
        assert fake.get("gemm.calls") == calls


def test_cublas_invalid_value_comes_back_as_its_status_naming_the_call(library, fake):
    rng = np.random.default_rng(63)
    invalid = ABI["BLAS_STATUS_BASE"] + fake.constant("CUBLAS_STATUS_INVALID_VALUE")
    detail = f"CUBLAS_STATUS_INVALID_VALUE (cublasStatus {fake.constant('CUBLAS_STATUS_INVALID_VALUE')})"
    with _blas(library) as blas:
        a, b, c, _, _ = _operands(rng, 0, 0)
        status, out = _gemm(library, blas, 0, 0, a, b, c, lda=K - 1)  # A [M,K] row-major needs lda >= K
        assert status == invalid
        assert _message(library).startswith("cublasGemmEx(") and _message(library).endswith(detail), _message(library)
        assert np.array_equal(out, c)
        a, b, c, _, _ = _operands(rng, 0, 0, BATCH)
        status, out = _batched(library, blas, 0, 0, a, b, c, ldc=N - 1)  # C [M,N] row-major needs ldc >= N
        assert status == invalid
        assert _message(library).startswith("cublasGemmStridedBatchedEx(") and _message(library).endswith(detail)
        assert np.array_equal(out, c)


def test_memcpy_round_trips_bytes_and_memset_fills_a_range(library, fake):
    data = np.random.default_rng(70).integers(0, 256, 1000, dtype=np.uint8)
    before = _counts(fake)
    with _stream(library) as stream, DeviceArray(library, data.shape, np.uint8) as first, \
            DeviceArray(library, data.shape, np.uint8) as second:
        assert library.kiln_cuda_memcpy_h2d(first.ptr, data.ctypes.data, data.nbytes, stream) == 0, _message(library)
        assert (fake.get("memcpy.kind"), fake.get("memcpy.stream")) == (fake.constant("cudaMemcpyHostToDevice"),
                                                                         stream)
        back = np.zeros_like(data)
        synchronized = fake.get("stream_synchronize.calls")
        assert library.kiln_cuda_memcpy_d2h(back.ctypes.data, first.ptr, data.nbytes, stream) == 0, _message(library)
        assert fake.get("memcpy.kind") == fake.constant("cudaMemcpyDeviceToHost")
        # the host buffer may be reused at once: the copy's stream is synchronised before returning
        assert fake.get("stream_synchronize.calls") == synchronized + 1
        assert fake.get("stream_synchronize.stream") == stream
        assert np.array_equal(back, data)
        assert library.kiln_cuda_memcpy_d2d(second.ptr, first.ptr, data.nbytes, stream) == 0, _message(library)
        assert fake.get("memcpy.kind") == fake.constant("cudaMemcpyDeviceToDevice")
        assert library.kiln_cuda_memset(second.ptr + 100, 0x3C, 200, stream) == 0, _message(library)
        assert fake.get("memset.stream") == stream
        expected = data.copy()
        expected[100:300] = 0x3C
        assert np.array_equal(second.to_host(), expected)
        assert np.array_equal(first.to_host(), data)
    assert _counts(fake) == before
    status = library.kiln_cuda_free(data.ctypes.data)  # not device memory
    assert status == 1
    assert _message(library) == "cudaFree(pointer): cudaErrorInvalidValue (cudaError 1: invalid argument)"


def test_device_properties_and_versions_pass_through(library, fake):
    value = c_int(-1)
    assert library.kiln_cuda_abi_version(byref(value)) == 0 and value.value == cuda.ABI_VERSION == ABI["ABI_VERSION"]
    assert library.kiln_cuda_device_count(byref(value)) == 0 and value.value == 1
    assert library.kiln_cuda_driver_version(byref(value)) == 0 and value.value == 13010
    assert library.kiln_cuda_runtime_version(byref(value)) == 0 and value.value == 13000
    assert library.kiln_cuda_cublas_version(byref(value)) == 0 and value.value == 13 * 10000 + 1 * 100 + 2
    name = ctypes.create_string_buffer(256)
    major, minor, multiprocessors, total = c_int(0), c_int(0), c_int(0), c_size_t(0)
    status = library.kiln_cuda_device_properties(0, name, 256, byref(major), byref(minor), byref(total),
                                             byref(multiprocessors))
    assert status == 0, _message(library)
    assert (name.value, major.value, minor.value, total.value, multiprocessors.value) == (
        b"Fake GPU 9.0", 9, 0, 80 << 30, 132)
    short = ctypes.create_string_buffer(b"\xff" * 8)
    assert library.kiln_cuda_device_properties(0, short, 5, byref(major), byref(minor), byref(total),
                                           byref(multiprocessors)) == 0
    assert short.raw[:6] == b"Fake\0\xff", "the name overran the buffer size it was given"
    free_bytes, total_bytes = c_size_t(0), c_size_t(0)
    with DeviceArray(library, (1000,), np.float32):
        assert library.kiln_cuda_mem_info(byref(free_bytes), byref(total_bytes)) == 0
        assert free_bytes.value == total_bytes.value - fake.get("allocated_bytes") and total_bytes.value == 80 << 30
    assert library.kiln_cuda_set_device(0) == 0
    assert library.kiln_cuda_set_device(1) == fake.constant("cudaErrorInvalidDevice")
    assert _message(library).startswith("cudaSetDevice(device): cudaErrorInvalidDevice"), _message(library)
    calls = fake.get("device_synchronize.calls")
    assert library.kiln_cuda_device_synchronize() == 0 and fake.get("device_synchronize.calls") == calls + 1


def test_events_time_a_stream_and_are_destroyed(library, fake):
    before = _counts(fake)
    start, end = c_void_p(0), c_void_p(0)
    with _stream(library) as stream:
        assert library.kiln_cuda_event_create(byref(start)) == 0 and library.kiln_cuda_event_create(byref(end)) == 0
        assert library.kiln_cuda_event_record(start, stream) == 0 and fake.get("event_record.stream") == stream
        assert library.kiln_cuda_event_record(end, stream) == 0
        assert library.kiln_cuda_event_synchronize(end) == 0
        milliseconds = c_float(-1.0)
        assert library.kiln_cuda_event_elapsed_ms(byref(milliseconds), start, end) == 0, _message(library)
        assert milliseconds.value == 0.25  # the fake's clock advances 0.25 ms per record
        assert library.kiln_cuda_event_destroy(start) == 0 and library.kiln_cuda_event_destroy(end) == 0
    assert _counts(fake) == before


def test_the_devices_opt_in_shared_memory_per_block_is_the_runtimes_attribute(library, fake):
    """kiln_cuda_device_shared_memory asks cudaDeviceGetAttribute for cudaDevAttrMaxSharedMemoryPerBlockOptin of the
    device it is given (the fake answers 227 KiB, a compute 9.0 device's), and a failure is its status, named."""
    per_block = c_size_t(1)
    assert library.kiln_cuda_device_shared_memory(0, byref(per_block)) == 0, _message(library)
    assert per_block.value == 227 << 10
    assert fake.get("device_attribute.attribute") == fake.constant("cudaDevAttrMaxSharedMemoryPerBlockOptin")
    assert fake.get("device_attribute.device") == 0
    per_block = c_size_t(1)
    assert library.kiln_cuda_device_shared_memory(1, byref(per_block)) == fake.constant("cudaErrorInvalidDevice")
    assert per_block.value == 0, "a failed query leaves no stale figure behind"
    assert fake.get("device_attribute.device") == 1
    assert _message(library).startswith("cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, "
                                        "device): cudaErrorInvalidDevice"), _message(library)
