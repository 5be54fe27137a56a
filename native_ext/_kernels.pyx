# cython: language_level=3
"""Cython kernels for the CPU backend: every hot operation except matrix products, and the calls that hand
those to their libraries without ctypes (oneDNN's dnnl_sgemm and dnnl_gemm_bf16bf16f32, OpenBLAS's cblas_sgemm
and, for one row, cblas_sgemv).

Private module: the public, validating entry points are in native_ext.kernels, and each
kernel has a plain numpy twin in native_ext.reference. Kernels take C-contiguous float32
memoryviews and release the GIL; RMSNorm, rotary positions, SwiGLU and the cross-entropy rows run
and Adam on the threads they are given (rows.h, on native_ext._attention's pool), the rest on one, and
no result depends on a thread count.
Dimension letters as in native_ext.reference.
The row kernels themselves are C in kiln_kernels.h (vectorised, cloned per instruction
set); this module hands them raw pointers.
"""

from libc.math cimport exp, expf, log, sqrt, sqrtf, INFINITY
from libc.stdint cimport int64_t, uint16_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset
cimport numpy as cnp

cnp.import_array()

ctypedef float f32


cdef extern from "kiln_kernels.h" nogil:
    void kiln_softmax_causal_forward(float *scores, float scale, int64_t G, int64_t R,
                                     int64_t S, int64_t group_size, int64_t past)
    void kiln_softmax_backward(const float *probs, float *dprobs, float scale, int64_t rows,
                               int64_t S)
    void kiln_log_softmax_gather(const float *logits, const int64_t *targets, float *out,
                                 float *scratch, int64_t N, int64_t V)
    void kiln_to_bf16(const float *x, uint16_t *out, int64_t n)


cdef extern from "rows.h" nogil:
    void kiln_rows_use_pool(void *run)
    void kiln_rmsnorm_forward_rows(const float *x, const float *w, double eps, float *out, float *rstd,
                                   int64_t N, int64_t C, int threads)
    int kiln_rmsnorm_backward_rows(const float *dout, const float *x, const float *w, const float *rstd,
                                   float *dx, float *dw, int64_t N, int64_t C, int threads)
    void kiln_swiglu_forward_rows(const float *gate_up, float *out, int64_t N, int64_t F, int64_t ld,
                                  int threads)
    void kiln_swiglu_backward_rows(const float *dout, const float *gate_up, float *dgate_up, int64_t N,
                                   int64_t F, int64_t ld, int64_t ld_grad, int threads)
    void kiln_rope_forward_rows(const float *x, int64_t sb, int64_t st, int64_t sh, const float *cos,
                                const float *sin, int64_t past, float *out, int64_t B, int64_t T, int64_t NH,
                                int64_t g, int64_t D, int threads)
    void kiln_rope_backward_rows(const float *dout, const float *cos, const float *sin, int64_t past, float *dx,
                                 int64_t sb, int64_t st, int64_t sh, int64_t B, int64_t T, int64_t NH,
                                 int64_t g, int64_t D, int threads)
    void kiln_cross_entropy_rows(float *logits, const int64_t *targets, float *losses, float grad_scale,
                                 const float *row_scales, int64_t ignore_index, int64_t N, int64_t V,
                                 int threads)
    void kiln_adam_update_rows(float *param, const float *grad, float *m, float *v, int64_t n, float b1, float b2,
                               float omb1, float omb2, float wd, int decay, float step_size, float bc2_sqrt,
                               float eps, int threads)


def use_pool(size_t run):
    """Run the row kernels on native_ext._attention's thread pool (the address of its kiln_pool_run)."""
    kiln_rows_use_pool(<void *>run)


def rmsnorm_forward(const f32[:, ::1] x, const f32[::1] weight, double eps,
                    f32[:, ::1] out, f32[::1] rstd, int threads=1):
    if x.shape[0] == 0:
        return
    with nogil:
        kiln_rmsnorm_forward_rows(&x[0, 0], &weight[0], eps, &out[0, 0], &rstd[0], x.shape[0], x.shape[1],
                                  threads)


def rmsnorm_backward(const f32[:, ::1] dout, const f32[:, ::1] x, const f32[::1] weight,
                     const f32[::1] rstd, f32[:, ::1] dx, f32[::1] dweight, int threads=1):
    if x.shape[0] == 0:
        return
    cdef int status
    with nogil:
        status = kiln_rmsnorm_backward_rows(&dout[0, 0], &x[0, 0], &weight[0], &rstd[0], &dx[0, 0],
                                            &dweight[0], x.shape[0], x.shape[1], threads)
    if status != 0:
        raise MemoryError("rmsnorm_backward scratch")


def rope_forward(const f32[:, :, :, :] x, const f32[:, ::1] cos, const f32[:, ::1] sin,
                 Py_ssize_t position_offset, f32[:, :, :, :, ::1] out, int threads=1):
    cdef Py_ssize_t B = x.shape[0], T = x.shape[1], NH = x.shape[2], D = x.shape[3]
    if B * T * NH * D == 0:
        return
    with nogil:
        kiln_rope_forward_rows(&x[0, 0, 0, 0], x.strides[0] // 4, x.strides[1] // 4, x.strides[2] // 4,
                               &cos[0, 0], &sin[0, 0], position_offset, &out[0, 0, 0, 0, 0], B, T, NH,
                               out.shape[3], D, threads)


def rope_backward(const f32[:, :, :, :, ::1] dout, const f32[:, ::1] cos, const f32[:, ::1] sin,
                  Py_ssize_t position_offset, f32[:, :, :, :] dx, int threads=1):
    cdef Py_ssize_t B = dx.shape[0], T = dx.shape[1], NH = dx.shape[2], D = dx.shape[3]
    if B * T * NH * D == 0:
        return
    with nogil:
        kiln_rope_backward_rows(&dout[0, 0, 0, 0, 0], &cos[0, 0], &sin[0, 0], position_offset, &dx[0, 0, 0, 0],
                                dx.strides[0] // 4, dx.strides[1] // 4, dx.strides[2] // 4, B, T, NH,
                                dout.shape[3], D, threads)


def softmax_causal_forward(f32[:, :, ::1] scores, double scale, Py_ssize_t group_size,
                           Py_ssize_t past):
    if scores.shape[0] * scores.shape[1] * scores.shape[2] == 0:
        return
    with nogil:
        kiln_softmax_causal_forward(&scores[0, 0, 0], <float>scale, scores.shape[0],
                                    scores.shape[1], scores.shape[2], group_size, past)


def softmax_backward(const f32[:, :, ::1] probs, f32[:, :, ::1] dprobs, double scale):
    if probs.shape[0] * probs.shape[1] * probs.shape[2] == 0:
        return
    with nogil:
        kiln_softmax_backward(&probs[0, 0, 0], &dprobs[0, 0, 0], <float>scale,
                              probs.shape[0] * probs.shape[1], probs.shape[2])


def swiglu_forward(const f32[:, :] gate_up, f32[:, ::1] out, int threads=1):
    """gate_up [N, 2F] with a contiguous last axis and any row stride (checked by native_ext.kernels)."""
    if out.shape[0] * out.shape[1] == 0:
        return
    with nogil:
        kiln_swiglu_forward_rows(&gate_up[0, 0], &out[0, 0], out.shape[0], out.shape[1],
                                 gate_up.strides[0] // 4, threads)


def swiglu_backward(const f32[:, ::1] dout, const f32[:, :] gate_up, f32[:, :] dgate_up, int threads=1):
    """gate_up and dgate_up [N, 2F] with contiguous last axes and any row strides (checked by native_ext.kernels)."""
    if dout.shape[0] * dout.shape[1] == 0:
        return
    with nogil:
        kiln_swiglu_backward_rows(&dout[0, 0], &gate_up[0, 0], &dgate_up[0, 0], dout.shape[0],
                                  dout.shape[1], gate_up.strides[0] // 4, dgate_up.strides[0] // 4, threads)


def cross_entropy_forward_backward(f32[:, ::1] logits, const int64_t[::1] targets,
                                   f32[::1] losses, double grad_scale, int64_t ignore_index, int threads=1):
    if logits.shape[0] * logits.shape[1] == 0:
        return
    with nogil:
        kiln_cross_entropy_rows(&logits[0, 0], &targets[0], &losses[0], <float>grad_scale, NULL,
                                ignore_index, logits.shape[0], logits.shape[1], threads)


def weighted_cross_entropy(f32[:, ::1] logits, const int64_t[::1] targets, f32[::1] losses,
                           const f32[::1] row_scales, int threads=1):
    if logits.shape[0] * logits.shape[1] == 0:
        return
    with nogil:
        kiln_cross_entropy_rows(&logits[0, 0], &targets[0], &losses[0], 1.0, &row_scales[0], -1,
                                logits.shape[0], logits.shape[1], threads)


def log_softmax_gather(const f32[:, ::1] logits, const int64_t[::1] targets, f32[::1] out):
    if logits.shape[0] * logits.shape[1] == 0:
        return
    cdef float *scratch = <float *>malloc(logits.shape[1] * sizeof(float))
    if scratch == NULL:
        raise MemoryError("log_softmax_gather scratch")
    with nogil:
        kiln_log_softmax_gather(&logits[0, 0], &targets[0], &out[0], scratch, logits.shape[0],
                                logits.shape[1])
    free(scratch)


def embedding_backward(const f32[:, ::1] dout, const int64_t[::1] tokens, f32[:, ::1] dtable):
    cdef Py_ssize_t N = dout.shape[0], C = dout.shape[1], n, c
    cdef int64_t t
    with nogil:
        for n in range(N):
            t = tokens[n]
            for c in range(C):
                dtable[t, c] = dtable[t, c] + dout[n, c]


def adam_update(f32[::1] param, const f32[::1] grad, f32[::1] m, f32[::1] v,
                double learning_rate, double beta1, double beta2, double epsilon,
                double weight_decay, double bias_correction1, double bias_correction2, int threads=1):
    if param.shape[0] == 0:
        return
    with nogil:
        kiln_adam_update_rows(&param[0], &grad[0], &m[0], &v[0], param.shape[0], <float>beta1,
                              <float>beta2, <float>(1.0 - beta1), <float>(1.0 - beta2),
                              <float>weight_decay, weight_decay != 0.0,
                              <float>(learning_rate / bias_correction1), <float>sqrt(bias_correction2),
                              <float>epsilon, threads)


def to_bf16(const f32[:, ::1] x, uint16_t[:, ::1] out):
    if x.shape[0] * x.shape[1] == 0:
        return
    with nogil:
        kiln_to_bf16(&x[0, 0], &out[0, 0], x.shape[0] * x.shape[1])


# A float32 GEMM's call, without ctypes: native_ext.blas.gemm ran 992 products a LoRA step at context 256, and
# building three ctypes pointers and six leading dimensions in Python cost about 15 us of each call's 21.
ctypedef int (*kiln_dnnl_sgemm_fn)(char, char, int64_t, int64_t, int64_t, float, const float *, int64_t,
                                   const float *, int64_t, float, float *, int64_t) noexcept nogil


cdef int64_t _row_floats(str name, cnp.ndarray array) except -1:  # array: never None (callers' "not None")
    """Floats between two rows of a 2-d float32 array whose last axis is contiguous (native_ext.blas._rows)."""
    if cnp.PyArray_TYPE(array) != cnp.NPY_FLOAT32 or cnp.PyArray_NDIM(array) != 2:
        raise TypeError(f"{name} must be a 2-d float32 array")
    cdef cnp.npy_intp row = cnp.PyArray_STRIDE(array, 0)
    if cnp.PyArray_STRIDE(array, 1) != 4 or row % 4 or row < 4 * cnp.PyArray_DIM(array, 1):
        raise ValueError(f"{name} must be row-major with a contiguous last axis")
    return row // 4


def float32_rows(cnp.ndarray a not None, cnp.ndarray b not None, cnp.ndarray c not None):
    """(lda, ldb, ldc) of three 2-d float32 row views; TypeError or ValueError naming the first that is not."""
    return _row_floats("a", a), _row_floats("b", b), _row_floats("c", c)


cdef struct kiln_float32_product:
    int64_t M, N, K, lda, ldb, ldc
    const float *A
    const float *B
    float *C


cdef int _float32_product(kiln_float32_product *p, cnp.ndarray c, cnp.ndarray a, cnp.ndarray b, bint trans_a,
                          bint trans_b) except -1:
    """P's sizes, leading dimensions and pointers for c = op(a) @ op(b), the three arrays' layout checked."""
    p.lda, p.ldb, p.ldc = _row_floats("a", a), _row_floats("b", b), _row_floats("c", c)
    p.M = cnp.PyArray_DIM(a, 1) if trans_a else cnp.PyArray_DIM(a, 0)
    p.K = cnp.PyArray_DIM(a, 0) if trans_a else cnp.PyArray_DIM(a, 1)
    p.N = cnp.PyArray_DIM(b, 0) if trans_b else cnp.PyArray_DIM(b, 1)
    p.A, p.B, p.C = <const float *>cnp.PyArray_DATA(a), <const float *>cnp.PyArray_DATA(b), <float *>cnp.PyArray_DATA(c)
    return 0


def dnnl_sgemm(size_t function, cnp.ndarray c not None, cnp.ndarray a not None, cnp.ndarray b not None,
               bint trans_a, bint trans_b, float alpha, float beta):
    """c [M,N] = alpha * op(a) @ op(b) + beta * c by oneDNN's dnnl_sgemm at address FUNCTION, without the GIL;
    returns its status (0 when it computed). Every array a 2-d float32 row view (checked); the caller checks
    that the shapes fit."""
    cdef kiln_float32_product p
    _float32_product(&p, c, a, b, trans_a, trans_b)
    cdef int status
    if p.M == 0 or p.N == 0:
        return 0
    with nogil:
        status = (<kiln_dnnl_sgemm_fn>function)(b"T"[0] if trans_a else b"N"[0], b"T"[0] if trans_b else b"N"[0],
                                                p.M, p.N, p.K, alpha, p.A, p.lda, p.B, p.ldb, beta, p.C, p.ldc)
    return status


ctypedef void (*kiln_cblas_sgemm64_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                                       const float *, int64_t, float, float *, int64_t) noexcept nogil
ctypedef void (*kiln_cblas_sgemm32_fn)(int, int, int, int, int, int, float, const float *, int,
                                       const float *, int, float, float *, int) noexcept nogil


def cblas_sgemm(size_t function, bint ilp64, cnp.ndarray c not None, cnp.ndarray a not None,
                cnp.ndarray b not None, bint trans_a, bint trans_b, float alpha, float beta):
    """The same product by OpenBLAS's cblas_sgemm at address FUNCTION (row-major; 64-bit integers where ilp64,
    else 32-bit), without the GIL. The caller checks that the shapes fit and that K > 0."""
    cdef kiln_float32_product p
    _float32_product(&p, c, a, b, trans_a, trans_b)
    cdef int ta = 112 if trans_a else 111, tb = 112 if trans_b else 111  # CblasTrans, CblasNoTrans
    # (and 101 below: CblasRowMajor)
    if p.M == 0 or p.N == 0:
        return
    if not ilp64 and max(p.M, p.N, p.K, p.lda, p.ldb, p.ldc) > 2147483647:
        raise ValueError("a dimension does not fit this OpenBLAS's 32-bit integers")
    with nogil:
        if ilp64:
            (<kiln_cblas_sgemm64_fn>function)(101, ta, tb, p.M, p.N, p.K, alpha, p.A, p.lda, p.B, p.ldb, beta, p.C,
                                              p.ldc)
        else:
            (<kiln_cblas_sgemm32_fn>function)(101, ta, tb, <int>p.M, <int>p.N, <int>p.K, alpha, p.A, <int>p.lda,
                                              p.B, <int>p.ldb, beta, p.C, <int>p.ldc)


ctypedef int (*kiln_dnnl_gemm_bf16_fn)(char, char, int64_t, int64_t, int64_t, float, const uint16_t *, int64_t,
                                       const uint16_t *, int64_t, float, float *, int64_t) noexcept nogil


cdef int64_t _row_items(str name, cnp.ndarray array) except -1:  # array: never None
    """Items between two rows of a 2-d array whose last axis is contiguous (native_ext.onednn's check)."""
    cdef cnp.npy_intp size = cnp.PyArray_ITEMSIZE(array), row
    if cnp.PyArray_NDIM(array) != 2 or cnp.PyArray_STRIDE(array, 1) != size or cnp.PyArray_STRIDE(array, 0) % size:
        raise ValueError(f"{name} must be a 2-d row-major array with a contiguous last axis")
    row = cnp.PyArray_STRIDE(array, 0)
    return row // size


def dnnl_gemm_bf16(size_t function, cnp.ndarray c not None, cnp.ndarray a not None, cnp.ndarray b not None,
                   bint trans_b, float beta):
    """c [M,N] (float32) = a [M,K] @ op(b) + beta * c from bfloat16 bits (uint16) by oneDNN's
    dnnl_gemm_bf16bf16f32 at address FUNCTION, without the GIL; returns its status. The caller checks the
    dtypes and that the shapes fit; the layout is checked here."""
    cdef int64_t lda = _row_items("a", a), ldb = _row_items("b", b), ldc = _row_items("c", c)
    cdef int64_t M = cnp.PyArray_DIM(a, 0), K = cnp.PyArray_DIM(a, 1)
    cdef int64_t N = cnp.PyArray_DIM(b, 0) if trans_b else cnp.PyArray_DIM(b, 1)
    cdef const uint16_t *A = <const uint16_t *>cnp.PyArray_DATA(a)
    cdef const uint16_t *B = <const uint16_t *>cnp.PyArray_DATA(b)
    cdef float *C = <float *>cnp.PyArray_DATA(c)
    cdef int status
    if M == 0 or N == 0:
        return 0
    with nogil:
        status = (<kiln_dnnl_gemm_bf16_fn>function)(b"N"[0], b"T"[0] if trans_b else b"N"[0], M, N, K, 1.0, A, lda,
                                                    B, ldb, beta, C, ldc)
    return status


ctypedef void (*kiln_cblas_sgemv64_fn)(int, int, int64_t, int64_t, float, const float *, int64_t, const float *,
                                       int64_t, float, float *, int64_t) noexcept nogil
ctypedef void (*kiln_cblas_sgemv32_fn)(int, int, int, int, float, const float *, int, const float *, int, float,
                                       float *, int) noexcept nogil


def cblas_sgemv_row(size_t function, bint ilp64, cnp.ndarray c not None, cnp.ndarray a not None,
                    cnp.ndarray b not None, bint trans_a, bint trans_b, float alpha, float beta):
    """A one-row product, c [1,N] = alpha * op(a) [1,K] @ op(b) + beta * c, by OpenBLAS's cblas_sgemv at address
    FUNCTION: op(b).T times op(a)'s row, without the GIL. OpenBLAS's sgemm packs all of b for one row (3.5-7 times
    as long on one token's products); its sgemv reads b once. With beta 0 the row is zeroed first, so what c held
    (NaN included) is ignored, as sgemm does. The caller checks that the shapes fit and that M is 1 and K > 0."""
    cdef kiln_float32_product p
    _float32_product(&p, c, a, b, trans_a, trans_b)
    cdef int64_t step = p.lda if trans_a else 1  # op(a)'s row: a's column when a is [K,1]
    # row-major b: [N,K] times the row (no transpose) when trans_b, else [K,N] transposed
    cdef int order = 101, transpose = 111 if trans_b else 112
    cdef int64_t rows = cnp.PyArray_DIM(b, 0), columns = cnp.PyArray_DIM(b, 1)
    if p.M != 1:
        raise ValueError(f"a one-row product, not {p.M} rows")
    if p.N == 0:
        return
    if not ilp64 and max(rows, columns, p.ldb, step) > 2147483647:
        raise ValueError("a dimension does not fit this OpenBLAS's 32-bit integers")
    with nogil:
        if beta == 0.0:
            memset(p.C, 0, sizeof(float) * p.N)
        if ilp64:
            (<kiln_cblas_sgemv64_fn>function)(order, transpose, rows, columns, alpha, p.B, p.ldb, p.A, step, beta,
                                              p.C, 1)
        else:
            (<kiln_cblas_sgemv32_fn>function)(order, transpose, <int>rows, <int>columns, alpha, p.B, <int>p.ldb,
                                              p.A, <int>step, beta, p.C, 1)
