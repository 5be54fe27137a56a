"""native_ext.blas.gemm: the engine's float32 GEMM (oneDNN's where it loads, else numpy's own OpenBLAS) with alpha,
beta and leading dimensions, into row views."""

import numpy as np
import pytest

from native_ext import blas


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (0.37, 1.0), (2.0, 0.5)])
def test_gemm_into_a_column_slice_matches_numpy(trans_a, trans_b, alpha, beta):
    rng = np.random.default_rng(3)
    M, K, N = 7, 5, 4
    wide_a = rng.standard_normal((K if trans_a else M, 11), dtype=np.float32)  # strided rows: views of wider arrays
    wide_b = rng.standard_normal((N if trans_b else K, 9), dtype=np.float32)
    a = wide_a[:, 2:2 + (M if trans_a else K)]
    b = wide_b[:, 1:1 + (K if trans_b else N)]
    out = rng.standard_normal((M, 10), dtype=np.float32)
    before = out.copy()
    expected = alpha * ((a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b)) \
        + beta * before[:, 3:3 + N].astype(np.float64)
    blas.gemm(out[:, 3:3 + N], a, b, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta)
    assert np.allclose(out[:, 3:3 + N], expected, rtol=1e-5, atol=1e-5)
    untouched = np.ones(out.shape, bool)
    untouched[:, 3:3 + N] = False
    assert np.array_equal(out[untouched], before[untouched])  # only the slice is written


def test_gemm_beta_zero_ignores_what_c_held_and_shapes_are_checked():
    a = np.ones((3, 2), np.float32)
    c = np.full((3, 3), np.nan, np.float32)
    blas.gemm(c, a, a, trans_b=True)
    assert np.array_equal(c, np.full((3, 3), 2.0, np.float32))
    with pytest.raises(ValueError, match="do not fit"):
        blas.gemm(c, a, a)
    with pytest.raises(ValueError, match="contiguous last axis"):
        blas.gemm(c, np.ones((3, 4), np.float32)[:, ::2], a, trans_b=True)  # a column-strided view
    with pytest.raises(TypeError, match="float32"):
        blas.gemm(c, a.astype(np.float64), a, trans_b=True)


def test_gemm_is_numpys_blas_and_deterministic():
    assert blas.LIBRARY_PATH is not None  # the same OpenBLAS numpy multiplies with
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 300), dtype=np.float32), rng.standard_normal((48, 300), dtype=np.float32)
    first, second = np.empty((64, 48), np.float32), np.empty((64, 48), np.float32)
    blas.gemm(first, a, b, trans_b=True, alpha=0.5)
    blas.gemm(second, a, b, trans_b=True, alpha=0.5)
    assert np.array_equal(first, second)


def _lora_step(threads):
    """One LoRA step's adapter gradients, computed with BLAS at `threads` threads, in a fresh process."""
    import json
    import subprocess
    import sys

    code = f"""
import json, sys
import numpy as np
from threadpoolctl import threadpool_limits
from trainer import DecoderOnlyTransformer, LoraConfig, TransformerConfig
config = TransformerConfig(vocabulary_size=300, maximum_context=64, model_width=96, head_count=6, kv_head_count=2,
                           block_count=2, feed_forward_width=256, loss_route="kt_tape_flce", loss_chunk_tokens=16)
with threadpool_limits({threads}, user_api="blas"), DecoderOnlyTransformer(config) as model:
    model.attach_lora(LoraConfig(rank=4, alpha=8.0))
    rng = np.random.default_rng(1)
    model.load_adapter_state_dict({{n: rng.normal(0, 0.1, v.shape).astype(np.float32)
                                   for n, v in model.adapter_state_dict().items()}})
    tokens = rng.integers(0, 300, (2, 64))
    loss = model.forward_backward(tokens[:, :-1], tokens[:, 1:])
    grads = {{p.name: p.grad.tobytes().hex() for p in model.adapter_parameters()}}
json.dump({{"loss": loss, "grads": grads}}, sys.stdout)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_step_is_bit_identical_across_fresh_processes_at_the_same_thread_count():
    """The envelope's rule for the parallel parts (BLAS threads, the products the LoRA path sends to BLAS):
    the same thread count gives the same bytes, run after run (the thread count is in the execution identity)."""
    for threads in (1, 2):
        first, second = _lora_step(threads), _lora_step(threads)
        assert first == second, f"{threads} thread(s): two runs differ"


@pytest.mark.parametrize("rows,keys", [(2, 1), (1, 3), (1, 1), (3, 2)])
def test_matmul_of_views_with_any_row_stride_matches_numpy(rows, keys):
    """A transposed [rows, 1] slice is a one-row view whose row stride is one float: BLAS refuses such a leading
    dimension (oneDNN's dnnl_sgemm with status 2), so blas.matmul copies it (a GRPO group of two sequences of
    one key each met this in attention's backward)."""
    rng = np.random.default_rng(rows * 10 + keys)
    probs = rng.standard_normal((3, rows, keys), dtype=np.float32)
    dout = rng.standard_normal((3, rows, 5), dtype=np.float32)
    got = blas.matmul(probs.transpose(0, 2, 1), dout)
    assert got.shape == (3, keys, 5)
    assert np.allclose(got, np.matmul(probs.transpose(0, 2, 1), dout), rtol=1e-5, atol=1e-6)
    assert np.allclose(blas.matmul(dout.transpose(0, 2, 1), probs), np.matmul(dout.transpose(0, 2, 1), probs),
                       rtol=1e-5, atol=1e-6)


def _ctypes_products(c, a, b, trans_a, trans_b, alpha, beta):
    """The same product through ctypes, as gemm() called it before it called from Cython: (OpenBLAS's, oneDNN's
    or None where that library is missing)."""
    import ctypes

    from native_ext import onednn

    def pointer(x):
        return ctypes.c_void_p(x.ctypes.data)

    def ld(x):
        return x.strides[0] // 4

    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    N = b.shape[0] if trans_b else b.shape[1]
    out = []
    for_openblas = c.copy()
    blas._SGEMM(101, 112 if trans_a else 111, 112 if trans_b else 111, M, N, K, alpha, pointer(a), ld(a),
                pointer(b), ld(b), beta, pointer(for_openblas), ld(for_openblas))
    out.append(for_openblas)
    library = onednn._load()[0]
    if library is None:
        out.append(None)
    else:
        for_onednn = c.copy()
        status = library.dnnl_sgemm(b"T" if trans_a else b"N", b"T" if trans_b else b"N", M, N, K, alpha,
                                    a.ctypes.data, ld(a), b.ctypes.data, ld(b), beta, for_onednn.ctypes.data,
                                    ld(for_onednn))
        assert status == 0
        out.append(for_onednn)
    return out


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_the_cython_calls_give_the_bytes_of_the_ctypes_calls(trans_a, trans_b):
    """gemm() hands each library the same arguments from Cython (native_ext._kernels) as ctypes did: == on both
    routes, with strided rows, alpha and beta."""
    from native_ext import onednn

    rng = np.random.default_rng(11)
    M, K, N = 37, 70, 29
    a = rng.standard_normal((K if trans_a else M, 90), dtype=np.float32)[:, 3:3 + (M if trans_a else K)]
    b = rng.standard_normal((N if trans_b else K, 80), dtype=np.float32)[:, 5:5 + (K if trans_b else N)]
    c = np.ascontiguousarray(rng.standard_normal((M, 40), dtype=np.float32)[:, :N])
    openblas, onednn_product = _ctypes_products(c, a, b, trans_a, trans_b, 0.75, 0.5)
    with blas.routed(blas.OPENBLAS):
        ours = c.copy()
        blas.gemm(ours, a, b, trans_a=trans_a, trans_b=trans_b, alpha=0.75, beta=0.5)
    assert np.array_equal(ours, openblas)
    if onednn_product is None:
        pytest.skip(f"oneDNN's half: {onednn.float32_unavailable_reason()}")
    ours = c.copy()
    onednn.sgemm(ours, a, b, trans_a=trans_a, trans_b=trans_b, alpha=0.75, beta=0.5)
    assert np.array_equal(ours, onednn_product)


def test_onednn_sgemm_checks_the_layout_itself():
    """onednn.sgemm called directly (tests, benches) refuses what dnnl_sgemm would misread."""
    from native_ext import onednn

    if onednn.float32_unavailable_reason() is not None:
        pytest.skip(onednn.float32_unavailable_reason())
    a = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match="c must be row-major with a contiguous last axis"):
        onednn.sgemm(np.ones((3, 6), np.float32)[:, ::2], a, a, trans_b=True)
    with pytest.raises(TypeError, match="b must be a 2-d float32 array"):
        onednn.sgemm(np.ones((3, 3), np.float32), a, a.astype(np.float64), trans_b=True)
    with pytest.raises(TypeError, match="a must be a 2-d float32 array"):
        onednn.sgemm(np.ones((3, 3), np.float32), a[None], a, trans_b=True)
    with pytest.raises(TypeError):  # not a crash: the Cython call refuses None
        onednn.sgemm(None, a, a, trans_b=True)


@pytest.mark.parametrize("ilp64", [True, False])
def test_cblas_call_hands_over_row_major_arguments_in_either_integer_width(ilp64):
    """_kernels.cblas_sgemm calls the function at the address it is given with CblasRowMajor, the transposes,
    M, N, K, alpha, the three data pointers and leading dimensions, as 64-bit integers (an ILP64 OpenBLAS, what
    numpy bundles) or 32-bit ones (an LP64 OpenBLAS): a recording function stands in for OpenBLAS."""
    import ctypes

    from native_ext import _kernels

    integer = ctypes.c_int64 if ilp64 else ctypes.c_int
    seen = []
    prototype = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer, integer,
                                 ctypes.c_float, ctypes.c_void_p, integer, ctypes.c_void_p, integer, ctypes.c_float,
                                 ctypes.c_void_p, integer)
    record = prototype(lambda *args: seen.append(args))
    a = np.ones((5, 12), np.float32)[:, 2:9]  # [5, 7], rows 12 apart
    b = np.ones((4, 7), np.float32)  # trans_b: [7, 4]
    c = np.ones((5, 10), np.float32)[:, :4]
    _kernels.cblas_sgemm(ctypes.cast(record, ctypes.c_void_p).value, ilp64, c, a, b, False, True, 0.5, 2.0)
    assert seen == [(101, 111, 112, 5, 4, 7, 0.5, a.ctypes.data, 12, b.ctypes.data, 7, 2.0, c.ctypes.data, 10)]


def test_dnnl_call_hands_over_its_arguments():
    """_kernels.dnnl_sgemm calls dnnl_sgemm's signature: 'N'/'T', M, N, K, alpha, pointers and leading dimensions
    (64-bit), and returns its status."""
    import ctypes

    from native_ext import _kernels

    seen = []
    dim = ctypes.c_int64
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char, ctypes.c_char, dim, dim, dim, ctypes.c_float,
                                 ctypes.c_void_p, dim, ctypes.c_void_p, dim, ctypes.c_float, ctypes.c_void_p, dim)
    record = prototype(lambda *args: seen.append(args) or 7)
    a = np.ones((6, 3), np.float32)  # trans_a: [3, 6]
    b = np.ones((6, 9), np.float32)[:, 1:5]
    c = np.ones((3, 4), np.float32)
    status = _kernels.dnnl_sgemm(ctypes.cast(record, ctypes.c_void_p).value, c, a, b, True, False, 1.5, 0.0)
    assert status == 7
    assert seen == [(b"T", b"N", 3, 4, 6, 1.5, a.ctypes.data, 3, b.ctypes.data, 9, 0.0, c.ctypes.data, 4)]


def test_bf16_call_hands_over_its_arguments():
    """_kernels.dnnl_gemm_bf16 calls dnnl_gemm_bf16bf16f32's signature with bfloat16 bits' pointers and leading
    dimensions in items (runs on any CPU: a recording function stands in for oneDNN), and checks the layout."""
    import ctypes

    from native_ext import _kernels

    seen = []
    dim = ctypes.c_int64
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char, ctypes.c_char, dim, dim, dim, ctypes.c_float,
                                 ctypes.c_void_p, dim, ctypes.c_void_p, dim, ctypes.c_float, ctypes.c_void_p, dim)
    record = prototype(lambda *args: seen.append(args) or 0)
    address = ctypes.cast(record, ctypes.c_void_p).value
    a = np.ones((4, 20), np.uint16)[:, 3:11]  # [4, 8], rows 20 apart
    b = np.ones((5, 8), np.uint16)  # trans_b: [8, 5]
    c = np.ones((4, 6), np.float32)[:, :5]
    assert _kernels.dnnl_gemm_bf16(address, c, a, b, True, 1.0) == 0
    assert seen == [(b"N", b"T", 4, 5, 8, 1.0, a.ctypes.data, 20, b.ctypes.data, 8, 1.0, c.ctypes.data, 6)]
    with pytest.raises(ValueError, match="b must be a 2-d row-major array with a contiguous last axis"):
        _kernels.dnnl_gemm_bf16(address, c, a, np.ones((5, 16), np.uint16)[:, ::2], True, 1.0)
    assert len(seen) == 1


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (0.37, 1.0), (2.0, 0.5)])
def test_a_one_row_product_on_openblas_takes_sgemv(trans_a, trans_b, alpha, beta):
    """One row (a generated token's products on the serving threads' OpenBLAS route) goes to sgemv: numpy's product
    within float32 rounding, strided views, beta 0 ignoring a NaN, only the row's slice written; and the same
    bytes every call."""
    assert blas._SGEMV_ADDRESS is not None  # numpy's OpenBLAS has one beside its sgemm
    rng = np.random.default_rng(5)
    K, N = 300, 70
    a = rng.standard_normal((K, 4) if trans_a else (2, K + 5), dtype=np.float32)
    a = a[:, 1:2] if trans_a else a[1:2, 5:]  # [K,1] (rows 4 apart) or [1,K]
    b = rng.standard_normal((N, K + 3) if trans_b else (K, N + 9), dtype=np.float32)
    b = b[:, 3:] if trans_b else b[:, :N]
    out = rng.standard_normal((1, N + 4), dtype=np.float32)
    out[0, 2] = np.nan
    before = out.copy()
    expected = alpha * ((a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b)) \
        + (beta * before[:, :N].astype(np.float64) if beta else 0.0)
    with blas.routed(blas.OPENBLAS):
        blas.gemm(out[:, :N], a, b, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta)
        again = before.copy()
        blas.gemm(again[:, :N], a, b, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta)
    if beta == 0.0:
        assert np.isfinite(out[:, :N]).all()
    np.testing.assert_allclose(out[:, :N][np.isfinite(expected)], expected[np.isfinite(expected)], rtol=1e-4,
                               atol=1e-4)
    assert np.array_equal(out[:, N:], before[:, N:])
    assert np.array_equal(out, again, equal_nan=True)


@pytest.mark.parametrize("trans_b", [False, True])
def test_sgemv_call_hands_over_bs_rows_and_the_rows_step(trans_b):
    """_kernels.cblas_sgemv_row: row-major b, not transposed when op(b) is b.T ([N,K] times the row), else
    transposed; a's row read with step lda where a is [K,1]; recorded by a stand-in for OpenBLAS."""
    import ctypes

    from native_ext import _kernels

    seen = []
    dim = ctypes.c_int64
    prototype = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, dim, dim, ctypes.c_float, ctypes.c_void_p, dim,
                                 ctypes.c_void_p, dim, ctypes.c_float, ctypes.c_void_p, dim)
    record = prototype(lambda *args: seen.append(args))
    a = np.ones((6, 3), np.float32)[:, :1]  # trans_a: [6,1], rows 3 apart: op(a) is one row of 6
    b = np.ones((5, 6), np.float32) if trans_b else np.ones((6, 5), np.float32)
    c = np.full((1, 5), np.nan, np.float32)
    _kernels.cblas_sgemv_row(ctypes.cast(record, ctypes.c_void_p).value, True, c, a, b, True, trans_b, 2.0, 0.0)
    rows, columns = b.shape
    assert seen == [(101, 111 if trans_b else 112, rows, columns, 2.0, b.ctypes.data, b.shape[1], a.ctypes.data, 3,
                     0.0, c.ctypes.data, 1)]
    assert np.array_equal(c, np.zeros((1, 5), np.float32))  # beta 0: zeroed before the call
    with pytest.raises(ValueError, match="one-row"):
        _kernels.cblas_sgemv_row(0, True, np.ones((2, 5), np.float32), np.ones((2, 6), np.float32), b, False,
                                 trans_b, 1.0, 0.0)
