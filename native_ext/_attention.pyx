# cython: language_level=3
"""Cython wrappers of the fused tiled attention in attention.h (forward and backward), and of its row work on one
key block (flash_block_forward, flash_block_backward).

Private module: the validating entry points are in native_ext.attention and the numpy twins in
native_ext.reference. Each wrapper takes C-contiguous float32 memoryviews, releases the GIL and runs
the kernel on that many threads of pool.h's pool (which OpenBLAS also computes on); the bytes do not depend on their number.
"""

from libc.stdint cimport int64_t

ctypedef float f32


cdef extern from "pool.h" nogil:
    void kiln_pool_openblas_callback(int sync, void *dojob, int numjobs, size_t size, void *jobs, int data)
    int kiln_pool_run(int n, void *task, void *arg)
    void kiln_pool_find_openmp(void *parallel, void *thread_num)
    void kiln_pool_use_openmp(int on)
    int kiln_pool_choose_here(int choice)


cdef extern from "attention.h" nogil:
    int kiln_attention_forward(const float *q, const float *k, const float *v, int64_t kv_stride,
                               float *out, float *lse,
                               float scale, int64_t G, int64_t R, int64_t S, int64_t D, int64_t g,
                               int64_t past, int64_t window, int64_t block, int threads)
    int kiln_attention_backward(const float *dout, const float *q, const float *k, const float *v,
                                int64_t kv_stride, const float *out, const float *lse, float *delta, float *dq, float *dk,
                                float *dv, float scale, int64_t G, int64_t R, int64_t S, int64_t D,
                                int64_t g, int64_t past, int64_t window, int64_t block, int threads)
    int kiln_attention_flash_block_forward(float *scores, float *running_max, float *running_sum, float *alpha,
                                           float scale, int64_t G, int64_t R, int64_t S, int64_t g, int64_t past,
                                           int64_t key_start)
    int kiln_attention_flash_block_backward(float *scores, const float *logsumexp, float *dprobs,
                                            const float *delta, float scale, int64_t G, int64_t R, int64_t S,
                                            int64_t g, int64_t past, int64_t key_start)


def openblas_callback():
    """The address of pool.h's OpenBLAS threads callback (native_ext.blas registers it)."""
    return <size_t><void *>kiln_pool_openblas_callback


def find_openmp(size_t parallel, size_t thread_num):
    """Name GNU OpenMP's entry points (the addresses of libgomp's GOMP_parallel and omp_get_thread_num), or none
    when both are 0 (a forked child): kernels can run on OpenMP only after this (native_ext.blas)."""
    kiln_pool_find_openmp(<void *>parallel, <void *>thread_num)


def use_openmp(bint on):
    """Run Kiln's kernels on GNU OpenMP's threads (once found), or on pool.h's pthreads, in every thread that
    made no choice of its own (choose_here)."""
    kiln_pool_use_openmp(on)


HERE_FOLLOWS_PROCESS, HERE_PTHREADS, HERE_OPENMP = 0, 1, 2


def choose_here(int choice):
    """The calling thread's kernels: HERE_FOLLOWS_PROCESS, HERE_PTHREADS or HERE_OPENMP from now on, whatever
    use_openmp said. Returns the choice it replaces (native_ext.blas)."""
    if choice not in (HERE_FOLLOWS_PROCESS, HERE_PTHREADS, HERE_OPENMP):
        raise ValueError(f"choice must be 0, 1 or 2, got {choice}")
    return kiln_pool_choose_here(choice)


def pool_run():
    """The address of pool.h's kiln_pool_run (native_ext.kernels hands it to the row kernels)."""
    return <size_t><void *>kiln_pool_run


def forward(const f32[:, :, ::1] q, const f32[:, :, :] k, const f32[:, :, :] v, f32[:, :, ::1] out,
            f32[:, ::1] lse, double scale, Py_ssize_t group_size, Py_ssize_t past, Py_ssize_t window,
            Py_ssize_t block, int threads):
    cdef int status
    with nogil:
        status = kiln_attention_forward(&q[0, 0, 0], &k[0, 0, 0], &v[0, 0, 0], k.strides[0] // 4, &out[0, 0, 0], &lse[0, 0],
                                        <float>scale, q.shape[0], q.shape[1], k.shape[1], q.shape[2],
                                        group_size, past, window, block, threads)
    if status != 0:
        raise MemoryError("the attention kernel could not allocate its scratch memory")


def backward(const f32[:, :, ::1] dout, const f32[:, :, ::1] q, const f32[:, :, :] k,
             const f32[:, :, :] v, const f32[:, :, ::1] out, const f32[:, ::1] lse, f32[:, ::1] delta,
             f32[:, :, ::1] dq, f32[:, :, ::1] dk, f32[:, :, ::1] dv, double scale, Py_ssize_t group_size,
             Py_ssize_t past, Py_ssize_t window, Py_ssize_t block, int threads):
    cdef int status
    with nogil:
        status = kiln_attention_backward(&dout[0, 0, 0], &q[0, 0, 0], &k[0, 0, 0], &v[0, 0, 0], k.strides[0] // 4,
                                         &out[0, 0, 0],
                                         &lse[0, 0], &delta[0, 0], &dq[0, 0, 0], &dk[0, 0, 0], &dv[0, 0, 0],
                                         <float>scale, q.shape[0], q.shape[1], k.shape[1], q.shape[2],
                                         group_size, past, window, block, threads)
    if status != 0:
        raise MemoryError("the attention kernel could not allocate its scratch memory")


def flash_block_forward(f32[:, :, ::1] scores, f32[:, ::1] running_max, f32[:, ::1] running_sum,
                        f32[:, ::1] alpha, double scale, Py_ssize_t group_size,
                        Py_ssize_t past, Py_ssize_t key_start):
    cdef int status = 0
    if scores.shape[0] * scores.shape[1] * scores.shape[2] == 0:
        return
    with nogil:
        status = kiln_attention_flash_block_forward(&scores[0, 0, 0], &running_max[0, 0], &running_sum[0, 0],
                                                    &alpha[0, 0], <float>scale, scores.shape[0], scores.shape[1],
                                                    scores.shape[2], group_size, past, key_start)
    if status != 0:
        raise MemoryError("the attention row kernel could not allocate its tile")


def flash_block_backward(f32[:, :, ::1] scores, const f32[:, ::1] logsumexp, f32[:, :, ::1] dprobs,
                         const f32[:, ::1] delta, double scale, Py_ssize_t group_size,
                         Py_ssize_t past, Py_ssize_t key_start):
    cdef int status = 0
    if scores.shape[0] * scores.shape[1] * scores.shape[2] == 0:
        return
    with nogil:
        status = kiln_attention_flash_block_backward(&scores[0, 0, 0], &logsumexp[0, 0], &dprobs[0, 0, 0],
                                                     &delta[0, 0], <float>scale, scores.shape[0], scores.shape[1],
                                                     scores.shape[2], group_size, past, key_start)
    if status != 0:
        raise MemoryError("the attention row kernel could not allocate its tile")
