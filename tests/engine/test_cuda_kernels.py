"""The CUDA kernels against their numpy twins: on a GPU (skipped, with the probe's reason, without one) and
in the host emulation (the same kernel source compiled by g++ with -DKILN_CUDA_EMULATE: blocks run in turn,
the threads of a block are fibers switching at __syncthreads, and cuBLAS is a plain GEMM), which checks the
kernels' indexing, masking, tiling and barriers on any machine, though not the device's arithmetic.

Tolerances are stated per test as a maximum relative difference (max |gpu - twin| / max |twin|). Where the
arithmetic is the same operation for operation (embedding gather and gradient, NF4 decoding, Adam, scale)
the comparison is exact. Every kernel that reduces is also run twice and compared with `==`: no atomics,
fixed reduction orders, so one device gives the same bits every run.
Dimension letters as in native_ext/reference.py.
"""

import ctypes
from ctypes import byref, c_void_p

import numpy as np
import pytest

from native_ext import cuda, kernels, nf4, reference
from trainer import attention
from tests.engine.conftest import cuda_probe

PROBE = cuda_probe()
# the host emulation is built once per session by conftest.py's emulated_library fixture

F32, I64 = np.float32, np.int64
FP32 = 0  # the precision argument: IEEE FP32, no TF32
rng = np.random.default_rng(17)


def rel(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    scale = np.max(np.abs(expected), initial=0.0)
    difference = np.max(np.abs(actual - expected), initial=0.0)
    return difference / scale if scale else difference


def close(actual, expected, tolerance, what):
    difference = rel(actual, expected)
    assert difference <= tolerance, f"{what}: max relative difference {difference:.2e} > {tolerance:.0e}"


def normal(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32)


@pytest.fixture(scope="module")
def blas(lib):
    handle = c_void_p(0)
    cuda.check(lib, lib.kiln_cuda_blas_create(byref(handle), None, 32 << 20), "kiln_cuda_blas_create")
    yield handle.value
    lib.kiln_cuda_blas_destroy(handle.value)


class Gpu:
    """Device copies of numpy arrays for one test, freed at its end; call() runs a kernel and synchronises."""

    def __init__(self, lib):
        self.lib, self.arrays = lib, []

    def put(self, array):
        device = cuda.DeviceArray.from_host(self.lib, array)
        self.arrays.append(device)
        return device

    def zeros(self, shape, dtype=F32):
        device = cuda.DeviceArray.zeros(self.lib, shape, dtype)
        self.arrays.append(device)
        return device

    def call(self, name, *args):
        cuda.check(self.lib, getattr(self.lib, name)(*args), name)
        cuda.check(self.lib, self.lib.kiln_cuda_device_synchronize(), f"{name} (synchronize)")

    def free(self):
        for device in self.arrays:
            device.free()


@pytest.fixture
def gpu(lib):
    arrays = Gpu(lib)
    yield arrays
    arrays.free()


@pytest.mark.skipif(not PROBE["available"], reason=f"no usable GPU: {PROBE['reason']}")
def test_probe_sees_a_capable_device():
    assert PROBE["code"] is None and PROBE["devices"]
    for device in PROBE["devices"]:
        assert tuple(map(int, device["compute_capability"].split("."))) >= (8, 0)
        assert 0 < device["free_memory"] <= device["total_memory"]
    assert PROBE["driver_version"] and PROBE["runtime_version"] and PROBE["cublas_version"]


def test_streams_events_and_copies(lib, gpu):
    stream, start, end = c_void_p(0), c_void_p(0), c_void_p(0)
    gpu.call("kiln_cuda_stream_create", byref(stream))
    gpu.call("kiln_cuda_event_create", byref(start))
    gpu.call("kiln_cuda_event_create", byref(end))
    x = normal(1000)
    a = gpu.put(x)
    b = gpu.zeros(x.shape)
    gpu.call("kiln_cuda_event_record", start.value, stream.value)
    gpu.call("kiln_cuda_memcpy_d2d", b.ptr, a.ptr, x.nbytes, stream.value)
    gpu.call("kiln_cuda_event_record", end.value, stream.value)
    gpu.call("kiln_cuda_stream_synchronize", stream.value)
    gpu.call("kiln_cuda_event_synchronize", end.value)
    elapsed = ctypes.c_float(-1)
    gpu.call("kiln_cuda_event_elapsed_ms", byref(elapsed), start.value, end.value)
    assert elapsed.value >= 0
    np.testing.assert_array_equal(b.to_host(), x)
    for name, handle in (("kiln_cuda_event_destroy", start), ("kiln_cuda_event_destroy", end),
                         ("kiln_cuda_stream_destroy", stream)):
        gpu.call(name, handle.value)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_gemm_is_fp32(gpu, blas, trans_a, trans_b):
    M, N, K = 67, 45, 129
    A = normal(K, M) if trans_a else normal(M, K)
    B = normal(N, K) if trans_b else normal(K, N)
    C = normal(M, N)
    expected = 0.5 * ((A.T if trans_a else A).astype(np.float64) @ (B.T if trans_b else B)) + 2.0 * C
    dc = gpu.put(C)
    gpu.call("kiln_cuda_gemm", blas, trans_a, trans_b, M, N, K, 0.5, gpu.put(A).ptr, A.shape[1], gpu.put(B).ptr,
             B.shape[1], 2.0, dc.ptr, N, FP32)
    close(dc.to_host(), expected, 1e-5, "gemm (FP32, no TF32)")


def rounded(x, mantissa_bits):
    """X's float32 values kept to MANTISSA_BITS (10: TF32, 7: bfloat16), rounded to nearest, ties to even."""
    drop = 23 - mantissa_bits
    bits = np.ascontiguousarray(x, F32).view(np.uint32).astype(np.uint64)
    bits = (bits + (1 << (drop - 1)) - 1 + ((bits >> drop) & 1)) & ~np.uint64((1 << drop) - 1)
    return bits.astype(np.uint32).view(F32)


@pytest.mark.parametrize("precision,bits", [(1, 10), (2, 7)], ids=["tf32", "bf16"])
def test_gemm_on_tensor_cores_rounds_the_operands(request, gpu, blas, precision, bits):
    """Precisions 1 (TF32) and 2 (BF16): the product of the operands rounded to 10 or 7 mantissa bits, accumulated
    in FP32 or better. Against that twin within 1e-6 on the emulation (which rounds to nearest, ties to even) and
    2e-3 on a GPU (whose tensor cores may round the operands otherwise); and further from the FP32 product than
    1e-5, so the precision really is not FP32."""
    M, N, K = 67, 45, 129
    A, B, C = normal(M, K), normal(N, K), normal(M, N)
    twin = 0.5 * (rounded(A, bits).astype(np.float64) @ rounded(B, bits).T.astype(np.float64)) + 2.0 * C
    exact = 0.5 * (A.astype(np.float64) @ B.T.astype(np.float64)) + 2.0 * C
    dc = gpu.put(C)
    gpu.call("kiln_cuda_gemm", blas, 0, 1, M, N, K, 0.5, gpu.put(A).ptr, K, gpu.put(B).ptr, K, 2.0, dc.ptr, N,
             precision)
    emulated = request.node.callspec.params["lib"] == "emulated"
    close(dc.to_host(), twin, 1e-6 if emulated else 2e-3, f"gemm at precision {precision}")
    assert rel(dc.to_host(), exact) > 1e-5, f"precision {precision} computed the FP32 product"
    with pytest.raises(RuntimeError, match="precision must be 0"):
        gpu.call("kiln_cuda_gemm", blas, 0, 1, M, N, K, 0.5, gpu.put(A).ptr, K, gpu.put(B).ptr, K, 2.0, dc.ptr, N, 3)


def test_gemm_strided_batched(gpu, blas):
    batch, M, N, K = 5, 33, 17, 40
    A, B = normal(batch, M, K), normal(batch, N, K)
    dc = gpu.zeros((batch, M, N))
    gpu.call("kiln_cuda_gemm_strided_batched", blas, 0, 1, M, N, K, 1.0, gpu.put(A).ptr, K, M * K, gpu.put(B).ptr,
             K, N * K, 0.0, dc.ptr, N, M * N, batch, FP32)
    close(dc.to_host(), np.matmul(A.astype(np.float64), B.transpose(0, 2, 1)), 1e-5, "strided batched gemm")


def test_embedding_forward_and_its_gradient_are_exact(gpu):
    N, C, V = 300, 72, 41
    table, dout = normal(V, C), normal(N, C)
    tokens = rng.integers(0, V, N).astype(I64)  # many repeats: the gradient's order matters
    out = gpu.zeros((N, C))
    dtokens = gpu.put(tokens)
    gpu.call("kiln_cuda_embedding_forward", dtokens.ptr, gpu.put(table).ptr, out.ptr, N, C, V, None)
    np.testing.assert_array_equal(out.to_host(), table[tokens])
    start = normal(V, C)
    dtable = gpu.put(start)
    gpu.call("kiln_cuda_embedding_backward", gpu.put(dout).ptr, dtokens.ptr, dtable.ptr, N, C, V, None)
    expected = start.copy()
    kernels.embedding_backward(dout, tokens, expected)  # the CPU kernel: token order, float32 adds
    np.testing.assert_array_equal(dtable.to_host(), expected)


def test_rmsnorm_forward_and_backward(gpu, lib):
    N, C, eps = 131, 576, 1e-5
    x, weight, dout = normal(N, C), normal(C), normal(N, C)
    out, rstd = gpu.zeros((N, C)), gpu.zeros((N,))
    dx_ = gpu.put(x)
    gpu.call("kiln_cuda_rmsnorm_forward", dx_.ptr, gpu.put(weight).ptr, eps, out.ptr, rstd.ptr, N, C, None)
    expected_out, expected_rstd = np.empty_like(x), np.empty(N, F32)
    reference.rmsnorm_forward(x, weight, eps, expected_out, expected_rstd)
    close(out.to_host(), expected_out, 1e-6, "rmsnorm out")
    close(rstd.to_host(), expected_rstd, 1e-6, "rmsnorm rstd")
    bytes_ = ctypes.c_size_t(0)
    gpu.call("kiln_cuda_rmsnorm_backward_workspace", N, C, byref(bytes_))
    workspace = gpu.zeros((bytes_.value,), np.uint8)
    dx0, dw0 = normal(N, C), normal(C)  # backward accumulates
    results = []
    for _ in range(2):
        dx, dw = gpu.put(dx0), gpu.put(dw0)
        gpu.call("kiln_cuda_rmsnorm_backward", gpu.put(dout).ptr, dx_.ptr, gpu.put(weight).ptr,
                 gpu.put(expected_rstd).ptr, dx.ptr, dw.ptr, workspace.ptr, N, C, None)
        results.append((dx.to_host(), dw.to_host()))
    expected_dx, expected_dw = dx0.copy(), dw0.copy()
    reference.rmsnorm_backward(dout, x, weight, expected_rstd, expected_dx, expected_dw)
    close(results[0][0], expected_dx, 1e-5, "rmsnorm dx")
    close(results[0][1], expected_dw, 1e-5, "rmsnorm dweight")
    assert all(np.array_equal(a, b) for a, b in zip(*results)), "rmsnorm backward is not deterministic"


def test_rope_forward_and_backward_with_a_strided_input(gpu):
    B, T, KV, g, D, P, offset = 2, 9, 2, 3, 64, 32, 5
    H = KV * g
    fused = normal(B, T, (H + 2 * KV) * D)  # the q/k/v projection output; q is a strided view into it
    x = fused[..., :H * D].reshape(B, T, H, D)
    angles = np.arange(P)[:, None] * (1.0 / 10000 ** (np.arange(0, D, 2) / D))[None, :]
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)  # [P,D/2]
    strides = [s // 4 for s in x.strides[:3]]
    out = gpu.zeros((B, KV, T, g, D))
    dcos, dsin = gpu.put(cos), gpu.put(sin)
    gpu.call("kiln_cuda_rope_forward", gpu.put(fused).ptr, *strides, dcos.ptr, dsin.ptr, P, offset, out.ptr, B, T,
             KV, g, D, None)
    expected = np.empty((B, KV, T, g, D), F32)
    reference.rope_forward(x, cos, sin, offset, expected)
    close(out.to_host(), expected, 1e-6, "rope forward")
    dout = normal(B, KV, T, g, D)
    dfused = gpu.zeros(fused.shape)
    gpu.call("kiln_cuda_rope_backward", gpu.put(dout).ptr, dcos.ptr, dsin.ptr, P, offset, dfused.ptr, *strides, B, T,
             KV, g, D, None)
    expected_dx = np.empty((B, T, H, D), F32)
    reference.rope_backward(dout, cos, sin, offset, expected_dx)
    got = dfused.to_host()
    close(got[..., :H * D].reshape(B, T, H, D), expected_dx, 1e-6, "rope backward")
    assert not got[..., H * D:].any(), "rope backward wrote outside the q columns"


def test_swiglu_forward_and_backward(gpu):
    N, F = 77, 1536
    gate_up, dout = normal(N, 2 * F, scale=3.0), normal(N, F)
    out, dgate_up = gpu.zeros((N, F)), gpu.zeros((N, 2 * F))
    dgu = gpu.put(gate_up)
    gpu.call("kiln_cuda_swiglu_forward", dgu.ptr, out.ptr, N, F, None)
    expected = np.empty((N, F), F32)
    reference.swiglu_forward(gate_up, expected)
    close(out.to_host(), expected, 1e-6, "swiglu forward")
    gpu.call("kiln_cuda_swiglu_backward", gpu.put(dout).ptr, dgu.ptr, dgate_up.ptr, N, F, None)
    expected_grad = np.empty_like(gate_up)
    reference.swiglu_backward(dout, gate_up, expected_grad)
    close(dgate_up.to_host(), expected_grad, 1e-6, "swiglu backward")


@pytest.mark.parametrize("G,T,g,D,past,window", [(3, 37, 3, 64, 0, 0), (2, 70, 1, 128, 0, 0), (2, 20, 2, 32, 13, 0),
                                                 (2, 45, 3, 32, 0, 7), (2, 20, 2, 32, 13, 9), (1, 150, 2, 40, 0, 70),
                                                 (2, 30, 3, 80, 100, 0), (1, 130, 1, 24, 0, 0), (1, 200, 1, 32, 0, 20),
                                                 (1, 100, 3, 40, 30, 25)])
@pytest.mark.parametrize("tile", [0, 32])
def test_attention_forward_and_backward_match_the_dense_twin(gpu, G, T, g, D, past, window, tile):
    """window > 0: the sliding window (Mistral, Phi-3), against the CPU engine's masked dense twin. The kernels
    tile 64 rows by 64 keys (tile 0, the device's choice on a device that holds them: the emulation's 163 KiB, an
    A100's or H100's) or 32 by 32 (what a 99 KiB device takes), and round the head size up to 32, 64 or 128: the
    cases cross several row and key tiles, with a window across tile edges and head sizes that leave zero columns
    (24, 40, 80); the last two windows are narrow enough that whole tiles are skipped (kiln_first_key,
    kiln_row_end)."""
    S = past + T
    R = T * g
    q, k, v, dout = normal(G, R, D), normal(G, S, D), normal(G, S, D), normal(G, R, D)
    scale = 1.0 / np.sqrt(D)
    expected_out, probs = attention.dense_forward(q, k, v, scale, g, past, window or None)
    expected_dq, expected_dk, expected_dv = attention.dense_backward(dout, q, k, v, probs, scale)
    dq_, dk_, dv_ = gpu.put(q), gpu.put(k), gpu.put(v)
    out, lse = gpu.zeros((G, R, D)), gpu.zeros((G, R))
    gpu.call("kiln_cuda_attention_forward", dq_.ptr, dk_.ptr, dv_.ptr, out.ptr, lse.ptr, G, T, g, S, D, past, window,
             scale, tile, None)
    close(out.to_host(), expected_out, 1e-5, "attention out")
    scores = np.matmul(q, k.transpose(0, 2, 1))
    attention.hide_outside_window(scores, g, past, 0, window or None)
    logits = np.where(reference._causal_mask(R, S, g, past, 0), scores * F32(scale), -np.inf).astype(np.float64)
    top = logits.max(-1, keepdims=True)
    close(lse.to_host(), (np.log(np.exp(logits - top).sum(-1, keepdims=True)) + top)[..., 0], 1e-5,
          "attention logsumexp")
    grads = []
    for _ in range(2):
        dq, dk, dv, delta = (gpu.zeros(shape) for shape in ((G, R, D), (G, S, D), (G, S, D), (G, R)))
        gpu.call("kiln_cuda_attention_backward", gpu.put(dout).ptr, dq_.ptr, dk_.ptr, dv_.ptr, out.ptr, lse.ptr,
                 dq.ptr, dk.ptr, dv.ptr, delta.ptr, G, T, g, S, D, past, window, scale, tile, None)
        grads.append([a.to_host() for a in (dq, dk, dv)])
    for name, got, expected in zip(("dq", "dk", "dv"), grads[0], (expected_dq, expected_dk, expected_dv)):
        close(got, expected, 1e-4, f"attention {name}")
    assert all(np.array_equal(a, b) for a, b in zip(*grads)), "attention backward is not deterministic"


@pytest.mark.parametrize("G,T,g,past,window", [(3, 37, 3, 0, 0), (2, 20, 2, 13, 9), (1, 300, 1, 0, 0),
                                               (1, 100, 3, 30, 25)])
def test_attention_probabilities_are_the_masked_softmax(gpu, G, T, g, past, window):
    """The dense algorithm's row work: scores [G,T*g,S] (scale * q.k from a GEMM) become the causal (and windowed)
    softmax in place, 0 where masked, with the row's logsumexp; again from the saved logsumexp, the same bits (the
    backward's recomputed probabilities are the forward's). Rows longer than a CTA's 256 threads (S = 300) and the
    window across them; twice with `==`."""
    S, R = past + T, T * g
    scores = normal(G, R, S, scale=3.0)
    visible = reference._causal_mask(R, S, g, past, 0)
    if window:
        visible &= (past + np.arange(R)[:, None] // g) - np.arange(S)[None, :] < window
    logits = np.where(visible, scores, -np.inf).astype(np.float64)
    top = logits.max(-1, keepdims=True)
    expected_lse = (np.log(np.exp(logits - top).sum(-1, keepdims=True)) + top)[..., 0]
    runs = []
    for _ in range(2):
        probabilities, lse = gpu.put(scores), gpu.zeros((G, R))
        gpu.call("kiln_cuda_attention_probabilities", probabilities.ptr, lse.ptr, 0, G, T, g, S, past, window, None)
        runs.append((probabilities.to_host(), lse.to_host()))
    (p, got_lse), (p2, lse2) = runs
    assert np.array_equal(p, p2) and np.array_equal(got_lse, lse2), "attention probabilities are not deterministic"
    close(got_lse, expected_lse, 1e-6, "logsumexp")
    close(p, np.exp(logits - expected_lse[..., None]), 1e-6, "probabilities")
    assert np.all(p[~np.broadcast_to(visible, p.shape)] == 0.0), "a masked score has a probability"
    recomputed = gpu.put(scores)
    gpu.call("kiln_cuda_attention_probabilities", recomputed.ptr, gpu.put(got_lse).ptr, 1, G, T, g, S, past, window,
             None)
    assert np.array_equal(recomputed.to_host(), p), "probabilities from the saved logsumexp differ from the forward's"


def test_attention_dscores_is_the_softmax_gradient(gpu):
    """dS = p * (dP - rowsum(dout * out)) * scale in place over dP, 0 wherever p is 0."""
    G, T, g, S, D, scale = 2, 30, 3, 41, 24, F32(0.125)
    R = T * g
    p = np.abs(normal(G, R, S))
    p[:, :, 35:] = 0.0
    dp, dout, out = normal(G, R, S), normal(G, R, D), normal(G, R, D)
    delta = np.einsum("grd,grd->gr", dout.astype(np.float64), out)
    dscores = gpu.put(dp)
    gpu.call("kiln_cuda_attention_dscores", dscores.ptr, gpu.put(p).ptr, gpu.put(dout).ptr, gpu.put(out).ptr,
             gpu.zeros((G, R)).ptr, G, T, g, S, D, scale, None)
    got = dscores.to_host()
    close(got, p * (dp - delta[..., None]) * scale, 1e-6, "dscores")
    assert np.all(got[:, :, 35:] == 0.0)


def _cross_entropy_twin(hidden, weight, targets, mode, grad_scale, row_scales, ignore=-100):
    logits = hidden.astype(np.float64) @ weight.T.astype(np.float64)  # [N,V]
    N = len(targets)
    ignored = targets == ignore
    safe = np.where(ignored, 0, targets)
    top = logits.max(1, keepdims=True)
    lse = (np.log(np.exp(logits - top).sum(1, keepdims=True)) + top)[:, 0]
    logp = logits[np.arange(N), safe] - lse
    if mode == 0:
        return np.where(ignored, 0.0, logp), None, None
    grad = np.exp(logits - lse[:, None])
    grad[np.arange(N), safe] -= 1.0
    if mode == 1:
        grad *= grad_scale
        grad[ignored] = 0.0
        losses = np.where(ignored, 0.0, -logp)
    else:
        grad *= row_scales[:, None]
        losses = -logp
    return losses, grad @ weight, grad.T @ hidden


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_fused_linear_cross_entropy_in_chunks(gpu, blas, mode):
    N, C, V, chunk = 45, 96, 1003, 16  # a partial last chunk
    hidden, weight = normal(N, C), normal(V, C, scale=0.2)
    targets = rng.integers(0, V, N).astype(I64)
    targets[[3, 20]] = -100
    row_scales = rng.random(N).astype(F32)
    row_scales[[3, 20]] = 0.0
    grad_scale = 1.0 / N
    per_row = gpu.zeros((N,))
    dhidden = gpu.zeros((N, C)) if mode else None
    head0 = normal(V, C)
    dhead = gpu.put(head0) if mode else None
    workspace = gpu.zeros((chunk, V))
    gpu.call("kiln_cuda_fused_linear_cross_entropy", blas, gpu.put(hidden).ptr, gpu.put(weight).ptr,
             gpu.put(targets).ptr, N, C, V, chunk, mode, grad_scale, gpu.put(row_scales).ptr if mode == 2 else None,
             -100, per_row.ptr, dhidden.ptr if mode else None, dhead.ptr if mode else None, workspace.ptr, FP32)
    losses, expected_dhidden, expected_dhead = _cross_entropy_twin(hidden, weight, targets, mode, grad_scale,
                                                                   row_scales)
    close(per_row.to_host(), losses, 1e-5, f"mode {mode} per-row values")
    if mode:
        close(dhidden.to_host(), expected_dhidden, 1e-5, f"mode {mode} dhidden")
        close(dhead.to_host() - head0, expected_dhead, 1e-5, f"mode {mode} head gradient")


@pytest.mark.parametrize("n,block_size,start,count", [(4096, 64, 0, 4096), (1001, 64, 37, 900), (300, 32, 1, 299)])
def test_nf4_dequantize_is_exact(gpu, n, block_size, start, count):
    x = normal(n)
    packed, absmax = np.zeros((n + 1) // 2, np.uint8), np.zeros(-(-n // block_size), F32)
    nf4.quantize(x, block_size, packed, absmax)
    out = gpu.zeros((count,))
    gpu.call("kiln_cuda_nf4_dequantize", gpu.put(packed).ptr, gpu.put(absmax).ptr, out.ptr, start, count,
             block_size, None)
    expected = np.empty(count, F32)
    nf4.reference_dequantize(packed, block_size, start, expected, absmax)
    np.testing.assert_array_equal(out.to_host(), expected)


def test_nf4_double_quantized_absmax_decodes_exactly(gpu):
    absmax = (rng.random(700) * 3).astype(F32)
    offset = nf4.absmax_mean(absmax)
    codes, scales = np.zeros(700, np.uint8), np.zeros(-(-700 // nf4.ABSMAX_BLOCK_SIZE), F32)
    nf4.quantize_absmax(absmax, offset, codes, scales)
    decoded = gpu.zeros((700,))
    gpu.call("kiln_cuda_nf4_decode_absmax", gpu.put(codes).ptr, gpu.put(scales).ptr,
             gpu.put(np.ascontiguousarray(nf4.DYNAMIC_MAP)).ptr, float(offset), decoded.ptr, 700, None)
    expected = nf4.DYNAMIC_MAP[codes] * np.repeat(scales, nf4.ABSMAX_BLOCK_SIZE)[:700] + F32(offset)
    np.testing.assert_array_equal(decoded.to_host(), expected.astype(F32))


def test_nf4_linear_dequantizes_tiles_then_multiplies(gpu, blas):
    N, K, M, block_size, tile_rows = 19, 192, 130, 64, 48  # a partial last tile
    weight, x = normal(M, K), normal(N, K)
    packed, absmax = np.zeros(M * K // 2, np.uint8), np.zeros(M * K // block_size, F32)
    nf4.quantize(weight.reshape(-1), block_size, packed, absmax)
    dense = np.empty(M * K, F32)
    nf4.reference_dequantize(packed, block_size, 0, dense, absmax)
    out = gpu.zeros((N, M))
    gpu.call("kiln_cuda_nf4_linear", blas, gpu.put(x).ptr, gpu.put(packed).ptr, gpu.put(absmax).ptr, block_size,
             out.ptr, 0.0, gpu.zeros((tile_rows, K)).ptr, tile_rows, N, K, M, FP32)
    close(out.to_host(), x.astype(np.float64) @ dense.reshape(M, K).T, 1e-5, "nf4 linear")


def test_lora_forward_and_backward(gpu, blas):
    N, K, M, r, scaling = 29, 64, 80, 8, 2.0
    x, A, B, dout = normal(N, K), normal(r, K), normal(M, r), normal(N, M)
    base = normal(N, M)
    out, xa = gpu.put(base), gpu.zeros((N, r))
    dx_, dA_, dB_ = gpu.put(x), gpu.put(A), gpu.put(B)
    gpu.call("kiln_cuda_lora_forward", blas, dx_.ptr, dA_.ptr, dB_.ptr, scaling, xa.ptr, out.ptr, N, K, M, r, FP32)
    x64 = x.astype(np.float64)
    expected_xa = x64 @ A.T
    close(xa.to_host(), expected_xa, 1e-5, "lora xa")
    close(out.to_host(), base + scaling * expected_xa @ B.T, 1e-5, "lora out")
    dA0, dB0, dx0 = normal(r, K), normal(M, r), normal(N, K)
    dA, dB, dx, dxa = gpu.put(dA0), gpu.put(dB0), gpu.put(dx0), gpu.zeros((N, r))
    gpu.call("kiln_cuda_lora_backward", blas, dx_.ptr, dA_.ptr, dB_.ptr, xa.ptr, gpu.put(dout).ptr, scaling, dA.ptr,
             dB.ptr, dx.ptr, dxa.ptr, N, K, M, r, FP32)
    expected_dxa = scaling * dout.astype(np.float64) @ B
    close(dB.to_host() - dB0, scaling * dout.T.astype(np.float64) @ expected_xa, 1e-5, "lora dB")
    close(dA.to_host() - dA0, expected_dxa.T @ x64, 1e-5, "lora dA")
    close(dx.to_host() - dx0, expected_dxa @ A, 1e-5, "lora dx")


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adam_matches_the_cpu_kernel_bit_for_bit(gpu, weight_decay):
    n = 10007
    param, grad, m, v = normal(n), normal(n), normal(n, scale=0.1), np.abs(normal(n, scale=0.01))
    step = 7
    args = (1e-3, 0.9, 0.999, 1e-8, weight_decay, 1.0 - 0.9 ** step, 1.0 - 0.999 ** step)
    dp, dm, dv = gpu.put(param), gpu.put(m), gpu.put(v)
    gpu.call("kiln_cuda_adam_update", dp.ptr, gpu.put(grad).ptr, dm.ptr, dv.ptr, n, *args, None)
    kernels.adam_update(param, grad, m, v, *args)
    np.testing.assert_array_equal(dp.to_host(), param)
    np.testing.assert_array_equal(dm.to_host(), m)
    np.testing.assert_array_equal(dv.to_host(), v)


def test_gradient_norm_and_clip(gpu):
    tensors = [normal(n) for n in (1, 300, 70001, 1 << 20)]
    workspace, sums, norm = gpu.zeros((cuda.NORM_BLOCKS,), np.float64), gpu.zeros((len(tensors),), np.float64), \
        gpu.zeros((1,), np.float64)
    device = [gpu.put(t) for t in tensors]
    values = []
    for _ in range(2):
        for i, t in enumerate(device):
            gpu.call("kiln_cuda_sum_squares", t.ptr, t.shape[0], workspace.ptr, sums.ptr + 8 * i, None)
        gpu.call("kiln_cuda_global_norm", sums.ptr, len(tensors), norm.ptr, None)
        values.append(norm.to_host()[0])
    expected = np.sqrt(sum(float(np.dot(t.astype(np.float64), t)) for t in tensors))
    assert abs(values[0] - expected) <= 1e-12 * expected
    assert values[0] == values[1], "the gradient norm is not deterministic"
    factor = np.float32(1.0 / (values[0] + 1e-6))  # trainer/runs/step.py's clip factor
    gpu.call("kiln_cuda_scale", device[2].ptr, tensors[2].shape[0], float(factor), None)
    np.testing.assert_array_equal(device[2].to_host(), tensors[2] * factor)


# -- launches: the emulation checks each launch's configuration against the device's limits (grid x below 2^31,
# y and z at most 65535, 1024 threads, 48 KiB of dynamic shared memory unless the kernel's attribute allows more, up
# to an A100's 163 KiB), and its test hooks run an entry point dry (configurations and arguments checked, no memory
# touched) or make a launch fail


@pytest.fixture
def emulation(emulated_library):
    """The host emulation with its kiln_emu_* test hooks bound, put back as loaded after the test."""
    library = cuda.open_library(emulated_library)
    for name, argtypes in (("kiln_emu_set_dry_run", [ctypes.c_int]), ("kiln_emu_fail_next_launch", [ctypes.c_int]),
                           ("kiln_emu_set_thread_order", [ctypes.c_int]),
                           ("kiln_emu_set_shared_optin", [ctypes.c_size_t]), ("kiln_emu_reset", [])):
        getattr(library, name).argtypes, getattr(library, name).restype = argtypes, None
    library.kiln_emu_reset()
    yield library
    library.kiln_emu_reset()


NOWHERE = 16  # a non-null device address for a dry run, which never reads or writes it


def _attention_dry(library, D, backward, tile=0):
    """The attention forward (or backward) at head size D over a small GQA shape, run dry: its status."""
    p, G, T, g = NOWHERE, 2, 9, 2
    if backward:
        return library.kiln_cuda_attention_backward(p, p, p, p, p, p, p, p, p, p, G, T, g, T, D, 0, 0, 0.125, tile,
                                                    None)
    return library.kiln_cuda_attention_forward(p, p, p, p, p, G, T, g, T, D, 0, 0, 0.125, tile, None)


def test_the_attention_shared_bytes_the_library_exports_are_what_its_launches_request(emulation):
    """kiln_cuda_attention_shared_bytes is the least a block's shared memory must hold for the attention kernels (their
    32-row tiles): on a device whose opt-in limit (kiln_emu_set_shared_optin, which kiln_cuda_device_shared_memory
    reports) is exactly the exported forward (backward) figure, the forward (both backward kernels) launch; a byte
    less and the launch is refused (cudaErrorInvalidValue, naming the kernel and its bytes). So the probe's
    attention_head_size_limit, computed from those figures, is the head size that runs: on an A100's 163 KiB and on
    the 99 KiB of compute 8.6, 8.9 and 12.0 (RTX 30/40/50-series, A10, L4) every head size trains and decodes (the
    99 KiB device with tiles of 32 at head sizes past 64); a device of 48 KiB would take head sizes up to 64."""
    emulation.kiln_emu_set_dry_run(1)
    per_block = ctypes.c_size_t(0)
    assert emulation.kiln_cuda_device_shared_memory(0, byref(per_block)) == 0 and per_block.value == 163 << 10
    tiers = cuda.attention_shared_memory(emulation)
    for D in (1, 16, 32, 33, 64, 80, 96, 128):
        forward, backward = ctypes.c_size_t(0), ctypes.c_size_t(0)
        assert emulation.kiln_cuda_attention_shared_bytes(D, byref(forward), byref(backward)) == 0
        for is_backward, need in ((False, forward.value), (True, backward.value)):
            emulation.kiln_emu_set_shared_optin(need)
            assert emulation.kiln_cuda_device_shared_memory(0, byref(per_block)) == 0 and per_block.value == need
            assert _attention_dry(emulation, D, is_backward) == 0, (D, is_backward, cuda.last_error(emulation))
            emulation.kiln_emu_set_shared_optin(need - 1)
            assert _attention_dry(emulation, D, is_backward) == 1, (D, is_backward)
            assert f"needs {need} bytes of shared memory per block" in cuda.last_error(emulation)
    for per_block_bytes in (163 << 10, 99 << 10, 120 << 10, 48 << 10):
        emulation.kiln_emu_set_shared_optin(per_block_bytes)
        limits = cuda.attention_head_size_limit(tiers, per_block_bytes)
        for D in range(1, cuda.ATTENTION_MAX_HEAD + 1):
            assert (_attention_dry(emulation, D, False) == 0) == (D <= limits["decoding"]), (per_block_bytes, D)
            assert (_attention_dry(emulation, D, True) == 0) == (D <= limits["training"]), (per_block_bytes, D)
    assert cuda.attention_head_size_limit(tiers, 163 << 10) == {"training": 128, "decoding": 128}
    assert cuda.attention_head_size_limit(tiers, 99 << 10) == {"training": 128, "decoding": 128}
    assert cuda.attention_head_size_limit(tiers, 48 << 10) == {"training": 64, "decoding": 64}


def test_a_device_short_of_shared_memory_takes_tiles_of_32_and_always_the_same(emulation):
    """Tile 0 is the device's choice: 64 rows and keys where its opt-in shared memory per block holds those kernels
    (an A100's 163 KiB at head size 128), 32 where it does not (99 KiB): the same bits as asking for that tile, every
    run. A tile asked for that the device cannot hold is refused naming the kernel and its bytes (head size 128's
    64-row forward needs 122112 bytes; 99 KiB is 101376); a tile other than 0, 32 or 64 is a bad argument."""
    gpu = Gpu(emulation)
    G, T, g, D = 2, 70, 2, 128
    R = T * g
    q, k, v, dout = normal(G, R, D), normal(G, T, D), normal(G, T, D), normal(G, R, D)

    def run(tile):
        out, lse = gpu.zeros((G, R, D)), gpu.zeros((G, R))
        dq, dk, dv = gpu.zeros((G, R, D)), gpu.zeros((G, T, D)), gpu.zeros((G, T, D))
        q_, k_, v_ = gpu.put(q), gpu.put(k), gpu.put(v)
        gpu.call("kiln_cuda_attention_forward", q_.ptr, k_.ptr, v_.ptr, out.ptr, lse.ptr, G, T, g, T, D, 0, 0, 0.125,
                 tile, None)
        gpu.call("kiln_cuda_attention_backward", gpu.put(dout).ptr, q_.ptr, k_.ptr, v_.ptr, out.ptr, lse.ptr, dq.ptr,
                 dk.ptr, dv.ptr, gpu.zeros((G, R)).ptr, G, T, g, T, D, 0, 0, 0.125, tile, None)
        return [a.to_host() for a in (out, lse, dq, dk, dv)]

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(a, b))

    try:
        sixty_four, thirty_two = run(64), run(32)
        assert not same(sixty_four, thirty_two)  # other sums, so the tile is seen in the bits
        assert same(run(0), sixty_four)  # 163 KiB, as loaded
        emulation.kiln_emu_set_shared_optin(99 << 10)
        assert same(run(0), thirty_two) and same(run(0), thirty_two)
        p = NOWHERE
        assert emulation.kiln_cuda_attention_forward(p, p, p, p, p, G, T, g, T, D, 0, 0, 0.125, 64, None) == 1
        assert "attention_forward_kernel needs 122112 bytes" in cuda.last_error(emulation)
        assert emulation.kiln_cuda_attention_forward(p, p, p, p, p, G, T, g, T, D, 0, 0, 0.125, 48, None) == 2001
        assert "tile must be 0" in cuda.last_error(emulation)
    finally:
        gpu.free()


LAUNCHES = {  # entry point -> (its first kernel, its arguments with no memory behind them: run dry)
    "kiln_cuda_swiglu_forward": ("swiglu_forward_kernel", (None, None, 7, 24, None)),
    "kiln_cuda_rmsnorm_backward": ("rmsnorm_backward_dx_kernel",
                                   (None, None, None, None, None, None, NOWHERE, 7, 24, None)),
    "kiln_cuda_attention_forward": ("attention_forward_kernel",
                                    (None, None, None, None, None, 2, 9, 2, 9, 64, 0, 0, 0.125, 0, None)),
    "kiln_cuda_cross_entropy_rows": ("cross_entropy_rows_kernel", (None, None, None, 1, 1.0, None, -100, 7, 23, None)),
}


@pytest.mark.parametrize("entry", sorted(LAUNCHES))
def test_a_failed_launch_comes_back_as_its_status_naming_the_kernel(emulation, entry):
    """A launch the device refuses (cudaErrorLaunchOutOfResources, 701, made to happen by the emulation's hook) is the
    entry point's status, and kiln_cuda_last_error() names the kernel that failed, not only cudaGetLastError."""
    kernel, arguments = LAUNCHES[entry]
    emulation.kiln_emu_set_dry_run(1)
    assert getattr(emulation, entry)(*arguments) == 0, cuda.last_error(emulation)
    emulation.kiln_emu_fail_next_launch(701)
    assert getattr(emulation, entry)(*arguments) == 701
    assert kernel in cuda.last_error(emulation), cuda.last_error(emulation)


# name: (C, F, V, H, KV, D) of the models the backend is for, from SmolLM2-135M to the largest head counts
MODEL_SHAPES = {"SmolLM2-135M": (576, 1536, 49152, 9, 3, 64), "SmolLM2-1.7B": (2048, 8192, 49152, 32, 32, 64),
                "Llama-3-8B": (4096, 14336, 128256, 32, 8, 128), "Qwen2.5-7B": (3584, 18944, 152064, 28, 4, 128),
                "Qwen3-32B": (5120, 25600, 151936, 64, 8, 128)}


def _model_step_calls(blas, C, F, V, H, KV, D, B, T, window, rank=64, block_size=64):
    """(entry point, arguments) of each kernel call a training step, and a decoding step, make at these shapes, as
    trainer/cuda_model.py and cuda_decode.py make them, with no memory behind the pointers (for a dry run)."""
    p, N, g, G = NOWHERE, B * T, H // KV, B * KV
    W3, R = (H + 2 * KV) * D, T * g
    calls = [("kiln_cuda_embedding_forward", (p, p, p, N, C, V, None)),
             ("kiln_cuda_embedding_backward", (p, p, p, N, C, V, None))]
    for rows, width in ((N, C), (N * H, D), (N * KV, D)):  # the block's norms, and Qwen3's per-head q and k norms
        calls += [("kiln_cuda_rmsnorm_forward", (p, p, 1e-6, p, p, rows, width, None)),
                  ("kiln_cuda_rmsnorm_backward", (p, p, p, p, p, p, p, rows, width, None))]
    for group in (g, 1):  # q, then k (and v's layout move)
        calls += [("kiln_cuda_rope_forward", (p, T * W3, W3, D, p, p, T, 0, p, B, T, KV, group, D, None)),
                  ("kiln_cuda_rope_backward", (p, p, p, T, 0, p, T * W3, W3, D, B, T, KV, group, D, None))]
    calls += [("kiln_cuda_swiglu_forward", (p, p, N, F, None)), ("kiln_cuda_swiglu_backward", (p, p, p, N, F, None)),
              ("kiln_cuda_attention_forward", (p, p, p, p, p, G, T, g, T, D, 0, window, 0.125, 0, None)),
              ("kiln_cuda_attention_backward", (p, p, p, p, p, p, p, p, p, p, G, T, g, T, D, 0, window, 0.125, 0,
                                                None)),
              # decoding
              ("kiln_cuda_attention_forward", (p, p, p, p, p, G, 1, g, T, D, T - 1, window, 0.125, 0, None)),
              ("kiln_cuda_attention_probabilities", (p, p, 0, 1, T, g, T, 0, window, None)),  # dense, one group
              ("kiln_cuda_attention_dscores", (p, p, p, p, p, 1, T, g, T, D, 0.125, None))]
    for chunk in (64, N):  # the fused route's chunks, and the full logits
        calls += [("kiln_cuda_fused_linear_cross_entropy",
                   (blas, p, p, p, N, C, V, chunk, mode, 1.0, p, -100, p, p if mode else None, None, p, 0))
                  for mode in (0, 1, 2)]
    calls += [("kiln_cuda_nf4_dequantize", (p, p, p, 0, F * C, block_size, None)),
              ("kiln_cuda_nf4_decode_absmax", (p, p, p, 0.0, p, F * C // block_size, None)),
              ("kiln_cuda_nf4_linear", (blas, p, p, p, block_size, p, 0.0, p, 131072 // C, N, C, F, 0)),
              ("kiln_cuda_lora_forward", (blas, p, p, p, 2.0, p, p, N, C, F, rank, 0)),
              ("kiln_cuda_lora_backward", (blas, p, p, p, p, p, 2.0, p, p, p, p, N, C, F, rank, 0)),
              ("kiln_cuda_gemm_strided_batched", (blas, 0, 1, R, T, D, 0.125, p, D, R * D, p, D, T * D, 0.0, p, T,
                                                  R * T, G, 2)),
              ("kiln_cuda_adam_update", (p, p, p, p, V * C, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001, None)),
              ("kiln_cuda_sum_squares", (p, V * C, p, p, None)), ("kiln_cuda_scale", (p, V * C, 0.5, None))]
    return calls


@pytest.fixture
def emulated_blas(emulation):
    handle = c_void_p(0)
    cuda.check(emulation, emulation.kiln_cuda_blas_create(byref(handle), None, 0), "kiln_cuda_blas_create")
    yield handle.value
    emulation.kiln_cuda_blas_destroy(handle.value)


@pytest.mark.parametrize("shared_kib", [163, 99])
@pytest.mark.parametrize("model", sorted(MODEL_SHAPES))
def test_every_launch_of_a_real_models_step_is_one_the_device_takes(emulation, emulated_blas, model, shared_kib):
    """Batches of 8 x 4096 tokens (N = 32768 rows; the full logits [N,V] pass 2^32 elements), head sizes 64 and 128,
    a sliding window of 4096 and none, through every entry point a step calls, run dry: each launch's grid, threads
    and dynamic shared memory within the device's limits (and the kernel's shared-memory attribute), each GEMM's
    dimensions within cuBLAS's int. On an A100's 163 KiB of shared memory per block, and on the 99 KiB of an RTX
    30/40-series GPU (whose attention at head size 128 takes tiles of 32)."""
    emulation.kiln_emu_set_dry_run(1)
    emulation.kiln_emu_set_shared_optin(shared_kib << 10)
    for window in (0, 1024):
        for entry, arguments in _model_step_calls(emulated_blas, *MODEL_SHAPES[model], B=8, T=4096, window=window):
            status = getattr(emulation, entry)(*arguments)
            assert status == 0, f"{model}: {entry}{arguments[-9:]}: status {status}: {cuda.last_error(emulation)}"


def test_rmsnorm_backward_takes_more_weight_chunks_than_grid_y_holds(emulation):
    """The weight gradient sums rows in chunks of 64: Qwen3-32B's query-head norm over a step of 16 x 4096 tokens
    has 64 heads x 65536 = 2^22 rows, so 65536 chunks, one more than a grid's y dimension takes (65535). Run dry."""
    emulation.kiln_emu_set_dry_run(1)
    status = emulation.kiln_cuda_rmsnorm_backward(*[NOWHERE] * 7, 1 << 22, 128, None)
    assert status == 0, cuda.last_error(emulation)
    # the columns' blocks take grid.y instead: a width past 65535 * 256 is refused before any launch
    assert emulation.kiln_cuda_rmsnorm_backward(*[NOWHERE] * 7, 64, 65535 * 256 + 1, None) == 2001
    assert "65535 * 256" in cuda.last_error(emulation)


def test_no_kernel_result_depends_on_the_order_its_threads_run_between_barriers(emulation):
    """On a device a block's threads run between two barriers in no fixed order; the emulation runs them by index,
    reversed, or shuffled afresh each round. Every kernel that shares memory across threads (the block reductions
    of RMSNorm, cross-entropy, the gradient norm and the dense softmax; the attention tiles, windowed, with a past,
    GQA, head sizes 40 and 128 over partial tiles of 64 rows and, at 128, of 32) gives the same bits in all three
    orders: no thread reads what another writes in the same interval."""
    gpu = Gpu(emulation)
    G, T, g, past, window = 2, 70, 3, 20, 45
    S, R = past + T, T * g
    N, C, V = 70, 300, 517
    inputs = {"x": normal(N, C), "w": normal(C), "dout": normal(N, C), "logits": normal(N, V, scale=4.0),
              "targets": rng.integers(0, V, N).astype(I64), "scores": normal(G, R, S, scale=3.0)}
    inputs["targets"][[0, 9]] = -100
    attention_inputs = {(D, tile): [normal(G, n, D) for n in (R, S, S, R)]  # q, k, v, dout
                        for D, tile in ((40, 0), (128, 0), (128, 32))}

    def run():
        out = {}
        x = gpu.put(inputs["x"])
        normed, rstd = gpu.zeros((N, C)), gpu.zeros((N,))
        gpu.call("kiln_cuda_rmsnorm_forward", x.ptr, gpu.put(inputs["w"]).ptr, 1e-5, normed.ptr, rstd.ptr, N, C, None)
        size = ctypes.c_size_t(0)
        gpu.call("kiln_cuda_rmsnorm_backward_workspace", N, C, byref(size))
        dx, dw = gpu.zeros((N, C)), gpu.zeros((C,))
        gpu.call("kiln_cuda_rmsnorm_backward", gpu.put(inputs["dout"]).ptr, x.ptr, gpu.put(inputs["w"]).ptr, rstd.ptr,
                 dx.ptr, dw.ptr, gpu.zeros((size.value,), np.uint8).ptr, N, C, None)
        logits, per_row = gpu.put(inputs["logits"]), gpu.zeros((N,))
        gpu.call("kiln_cuda_cross_entropy_rows", logits.ptr, gpu.put(inputs["targets"]).ptr, per_row.ptr, 1, 0.25,
                 None, -100, N, V, None)
        sums = gpu.zeros((2,), np.float64)
        gpu.call("kiln_cuda_sum_squares", logits.ptr, N * V, gpu.zeros((cuda.NORM_BLOCKS,), np.float64).ptr,
                 sums.ptr, None)
        scores, lse = gpu.put(inputs["scores"]), gpu.zeros((G, R))
        gpu.call("kiln_cuda_attention_probabilities", scores.ptr, lse.ptr, 0, G, T, g, S, past, window, None)
        out.update(normed=normed, rstd=rstd, dx=dx, dw=dw, dlogits=logits, per_row=per_row, sums=sums, p=scores,
                   p_lse=lse)
        for (D, tile), (q, k, v, dout) in attention_inputs.items():
            q, k, v, dout = (gpu.put(a) for a in (q, k, v, dout))
            att, att_lse = gpu.zeros((G, R, D)), gpu.zeros((G, R))
            gpu.call("kiln_cuda_attention_forward", q.ptr, k.ptr, v.ptr, att.ptr, att_lse.ptr, G, T, g, S, D, past,
                     window, 0.125, tile, None)
            dq, dk, dv = gpu.zeros((G, R, D)), gpu.zeros((G, S, D)), gpu.zeros((G, S, D))
            gpu.call("kiln_cuda_attention_backward", dout.ptr, q.ptr, k.ptr, v.ptr, att.ptr, att_lse.ptr, dq.ptr,
                     dk.ptr, dv.ptr, gpu.zeros((G, R)).ptr, G, T, g, S, D, past, window, 0.125, tile, None)
            out.update({f"{name}{D}-{tile}": a for name, a in (("att", att), ("lse", att_lse), ("dq", dq),
                                                                 ("dk", dk), ("dv", dv))})
        return {name: a.to_host() for name, a in out.items()}

    try:
        by_index = run()
        for order in (1, 2):
            emulation.kiln_emu_set_thread_order(order)
            for name, value in run().items():
                assert np.array_equal(value, by_index[name]), f"{name} changes with the threads' order ({order})"
    finally:
        gpu.free()
