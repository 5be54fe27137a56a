/* What the .cu files of libkiln_cuda.so share: status recording, the check macros, the cuBLAS
 * handle, launch geometry. Not installed as an API; kiln_cuda.h is the ABI. */
#ifndef KILN_CUDA_INTERNAL_H
#define KILN_CUDA_INTERNAL_H

#ifdef KILN_CUDA_EMULATE  /* the host emulation the tests build (kiln_cuda_emulate.h) */
#include "kiln_cuda_emulate.h"
#else
#include <cublas_v2.h>
#include <cuda_runtime.h>
/* a kernel launch, and a kernel's dynamic shared memory, spelled so the host emulation can redefine them */
#define KILN_LAUNCH(kernel, grid, block, shared, stream) kernel<<<(grid), (block), (shared), (stream)>>>
#define KILN_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

#include "kiln_cuda.h"
#include "kiln_cuda_index.h"

/* record the failure for kiln_cuda_last_error() and return its status; not exported */
#define KILN_INTERNAL __attribute__((visibility("hidden")))
KILN_INTERNAL int kiln_record_cuda(cudaError_t error, const char *where);
KILN_INTERNAL int kiln_record_cublas(cublasStatus_t status, const char *where);
KILN_INTERNAL int kiln_record_argument(const char *where, const char *message);

#define KILN_CUDA(expr)                                                     \
    do {                                                                    \
        cudaError_t kiln_error_ = (expr);                                   \
        if (kiln_error_ != cudaSuccess) return kiln_record_cuda(kiln_error_, #expr); \
    } while (0)
#define KILN_BLAS(expr)                                                     \
    do {                                                                    \
        cublasStatus_t kiln_status_ = (expr);                               \
        if (kiln_status_ != CUBLAS_STATUS_SUCCESS) return kiln_record_cublas(kiln_status_, #expr); \
    } while (0)
#define KILN_REQUIRE(condition, message)                                    \
    do {                                                                    \
        if (!(condition)) return kiln_record_argument(__func__, message);   \
    } while (0)
/* after a kernel launch: the launch error, if any, names the kernel (a string literal) */
#define KILN_LAUNCHED(name)                                                 \
    do {                                                                    \
        cudaError_t kiln_error_ = cudaGetLastError();                       \
        if (kiln_error_ != cudaSuccess) return kiln_record_cuda(kiln_error_, "launching " name); \
    } while (0)
/* a call that itself returns a Kiln status */
#define KILN_TRY(expr)                                                      \
    do {                                                                    \
        int kiln_status_ = (expr);                                          \
        if (kiln_status_ != 0) return kiln_status_;                         \
    } while (0)

struct KilnBlas {
    cublasHandle_t handle;
    void *workspace;
    size_t workspace_bytes;
    cudaStream_t stream;
};

static inline cudaStream_t kiln_stream(void *stream) { return (cudaStream_t)stream; }

static inline unsigned kiln_grid(int64_t work, int threads) {
    int64_t blocks = kiln_ceil_div(work, threads);
    return (unsigned)(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
}

#define KILN_THREADS 256

/* full unrolling of a loop of compile-time length, where nvcc compiles (g++'s emulation build has no such pragma) */
#ifdef __CUDACC__
#define KILN_UNROLL _Pragma("unroll")
#define KILN_UNROLL_4 _Pragma("unroll 4") /* a loop of run-time length, four iterations per pass */
#else
#define KILN_UNROLL
#define KILN_UNROLL_4
#endif

#endif
