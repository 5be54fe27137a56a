// Errors, versions, devices, memory, streams and events, and cuBLAS GEMM (row-major, FP32 pedantic
// unless TF32 is asked for, one fixed workspace per handle so the algorithm choice cannot vary).
#include <cstdio>
#include <climits>

#include "kiln_cuda_internal.h"

static thread_local char kiln_last_error[512] = "";

int kiln_record_cuda(cudaError_t error, const char *where) {
    snprintf(kiln_last_error, sizeof kiln_last_error, "%s: %s (cudaError %d: %s)", where, cudaGetErrorName(error),
             (int)error, cudaGetErrorString(error));
    return (int)error;
}

int kiln_record_cublas(cublasStatus_t status, const char *where) {
    snprintf(kiln_last_error, sizeof kiln_last_error, "%s: %s (cublasStatus %d)", where,
             cublasGetStatusName(status), (int)status);
    return KILN_CUDA_BLAS_STATUS_BASE + (int)status;
}

int kiln_record_argument(const char *where, const char *message) {
    snprintf(kiln_last_error, sizeof kiln_last_error, "%s: %s", where, message);
    return KILN_CUDA_BAD_ARGUMENT;
}

extern "C" {

const char *kiln_cuda_last_error(void) { return kiln_last_error; }

int kiln_cuda_abi_version(int *version) {
    *version = KILN_CUDA_ABI_VERSION;
    return 0;
}

int kiln_cuda_device_count(int *count) {
    *count = 0;
    KILN_CUDA(cudaGetDeviceCount(count));
    return 0;
}

int kiln_cuda_device_properties(int device, char *name, int name_bytes, int *major, int *minor,
                                size_t *total_memory, int *multiprocessors) {
    cudaDeviceProp properties;
    KILN_CUDA(cudaGetDeviceProperties(&properties, device));
    if (name && name_bytes > 0) snprintf(name, (size_t)name_bytes, "%s", properties.name);
    *major = properties.major;
    *minor = properties.minor;
    *total_memory = properties.totalGlobalMem;
    *multiprocessors = properties.multiProcessorCount;
    return 0;
}

int kiln_cuda_driver_version(int *version) {
    *version = 0;
    KILN_CUDA(cudaDriverGetVersion(version));
    return 0;
}

int kiln_cuda_runtime_version(int *version) {
    *version = 0;
    KILN_CUDA(cudaRuntimeGetVersion(version));
    return 0;
}

int kiln_cuda_cublas_version(int *version) {
    *version = 0;
    int major = 0, minor = 0, patch = 0;
    KILN_BLAS(cublasGetProperty(MAJOR_VERSION, &major));
    KILN_BLAS(cublasGetProperty(MINOR_VERSION, &minor));
    KILN_BLAS(cublasGetProperty(PATCH_LEVEL, &patch));
    *version = major * 10000 + minor * 100 + patch;
    return 0;
}

int kiln_cuda_device_shared_memory(int device, size_t *per_block_optin) {
    *per_block_optin = 0;
    int bytes = 0;
    KILN_CUDA(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    *per_block_optin = (size_t)bytes;
    return 0;
}

int kiln_cuda_set_device(int device) {
    KILN_CUDA(cudaSetDevice(device));
    return 0;
}

int kiln_cuda_mem_info(size_t *free_bytes, size_t *total_bytes) {
    KILN_CUDA(cudaMemGetInfo(free_bytes, total_bytes));
    return 0;
}

int kiln_cuda_device_synchronize(void) {
    KILN_CUDA(cudaDeviceSynchronize());
    return 0;
}

int kiln_cuda_malloc(void **pointer, size_t bytes) {
    *pointer = nullptr;
    KILN_CUDA(cudaMalloc(pointer, bytes));
    return 0;
}

int kiln_cuda_free(void *pointer) {
    KILN_CUDA(cudaFree(pointer));
    return 0;
}

static int kiln_copy(void *dst, const void *src, size_t bytes, void *stream, cudaMemcpyKind kind) {
    KILN_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, kiln_stream(stream)));
    KILN_CUDA(cudaStreamSynchronize(kiln_stream(stream)));  // host buffers may be pageable and reused at once
    return 0;
}

int kiln_cuda_memcpy_h2d(void *dst, const void *src, size_t bytes, void *stream) {
    return kiln_copy(dst, src, bytes, stream, cudaMemcpyHostToDevice);
}

int kiln_cuda_memcpy_d2h(void *dst, const void *src, size_t bytes, void *stream) {
    return kiln_copy(dst, src, bytes, stream, cudaMemcpyDeviceToHost);
}

int kiln_cuda_memcpy_d2d(void *dst, const void *src, size_t bytes, void *stream) {
    KILN_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, kiln_stream(stream)));
    return 0;
}

int kiln_cuda_memset(void *pointer, int value, size_t bytes, void *stream) {
    KILN_CUDA(cudaMemsetAsync(pointer, value, bytes, kiln_stream(stream)));
    return 0;
}

int kiln_cuda_stream_create(void **stream) {
    cudaStream_t created = nullptr;
    KILN_CUDA(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    *stream = (void *)created;
    return 0;
}

int kiln_cuda_stream_destroy(void *stream) {
    KILN_CUDA(cudaStreamDestroy(kiln_stream(stream)));
    return 0;
}

int kiln_cuda_stream_synchronize(void *stream) {
    KILN_CUDA(cudaStreamSynchronize(kiln_stream(stream)));
    return 0;
}

int kiln_cuda_event_create(void **event) {
    cudaEvent_t created = nullptr;
    KILN_CUDA(cudaEventCreate(&created));
    *event = (void *)created;
    return 0;
}

int kiln_cuda_event_destroy(void *event) {
    KILN_CUDA(cudaEventDestroy((cudaEvent_t)event));
    return 0;
}

int kiln_cuda_event_record(void *event, void *stream) {
    KILN_CUDA(cudaEventRecord((cudaEvent_t)event, kiln_stream(stream)));
    return 0;
}

int kiln_cuda_event_synchronize(void *event) {
    KILN_CUDA(cudaEventSynchronize((cudaEvent_t)event));
    return 0;
}

int kiln_cuda_event_elapsed_ms(float *milliseconds, void *start, void *end) {
    KILN_CUDA(cudaEventElapsedTime(milliseconds, (cudaEvent_t)start, (cudaEvent_t)end));
    return 0;
}

int kiln_cuda_blas_create(void **blas, void *stream, size_t workspace_bytes) {
    *blas = nullptr;
    KilnBlas *created = new KilnBlas();
    cublasStatus_t status = cublasCreate(&created->handle);
    if (status != CUBLAS_STATUS_SUCCESS) {
        delete created;
        return kiln_record_cublas(status, "cublasCreate");
    }
    created->stream = kiln_stream(stream);
    created->workspace_bytes = workspace_bytes;
    int result = 0;
    cudaError_t error = workspace_bytes ? cudaMalloc(&created->workspace, workspace_bytes) : cudaSuccess;
    if (error != cudaSuccess) {
        result = kiln_record_cuda(error, "cudaMalloc(cuBLAS workspace)");
    } else if ((status = cublasSetStream(created->handle, created->stream)) != CUBLAS_STATUS_SUCCESS) {
        result = kiln_record_cublas(status, "cublasSetStream");
    } else if ((status = cublasSetWorkspace(created->handle, created->workspace, workspace_bytes)) !=
               CUBLAS_STATUS_SUCCESS) {
        result = kiln_record_cublas(status, "cublasSetWorkspace");
    } else if ((status = cublasSetMathMode(created->handle, CUBLAS_PEDANTIC_MATH)) != CUBLAS_STATUS_SUCCESS) {
        result = kiln_record_cublas(status, "cublasSetMathMode(CUBLAS_PEDANTIC_MATH)");
    } else if ((status = cublasSetAtomicsMode(created->handle, CUBLAS_ATOMICS_NOT_ALLOWED)) !=
               CUBLAS_STATUS_SUCCESS) {
        result = kiln_record_cublas(status, "cublasSetAtomicsMode");
    }
    if (result != 0) {
        cublasDestroy(created->handle);
        if (created->workspace) cudaFree(created->workspace);
        delete created;
        return result;
    }
    *blas = created;
    return 0;
}

int kiln_cuda_blas_destroy(void *blas) {
    KilnBlas *handle = (KilnBlas *)blas;
    if (!handle) return 0;
    cublasStatus_t status = cublasDestroy(handle->handle);
    cudaError_t error = handle->workspace ? cudaFree(handle->workspace) : cudaSuccess;
    delete handle;
    if (status != CUBLAS_STATUS_SUCCESS) return kiln_record_cublas(status, "cublasDestroy");
    KILN_CUDA(error);
    return 0;
}

int kiln_cuda_blas_set_stream(void *blas, void *stream) {
    KilnBlas *handle = (KilnBlas *)blas;
    KILN_REQUIRE(handle, "no cuBLAS handle");
    KILN_BLAS(cublasSetStream(handle->handle, kiln_stream(stream)));
    handle->stream = kiln_stream(stream);
    // cublasSetStream puts the handle back on cuBLAS's default workspace pool: set the fixed one again
    KILN_BLAS(cublasSetWorkspace(handle->handle, handle->workspace, handle->workspace_bytes));
    return 0;
}

static int kiln_fits_int(int64_t value) { return value >= 0 && value <= INT_MAX; }

// Row-major C = A B is column-major C^T = B^T A^T: cuBLAS gets (B, A) swapped and (N, M) swapped.
static int kiln_gemm_setup(KilnBlas *handle, int precision, cublasComputeType_t *compute) {
    KILN_REQUIRE(handle, "no cuBLAS handle");
    KILN_REQUIRE(precision == KILN_CUDA_PRECISION_FP32 || precision == KILN_CUDA_PRECISION_TF32 ||
                     precision == KILN_CUDA_PRECISION_BF16,
                 "precision must be 0 (FP32), 1 (TF32) or 2 (BF16)");
    cublasMath_t mode = CUBLAS_PEDANTIC_MATH;
    *compute = CUBLAS_COMPUTE_32F_PEDANTIC;
    if (precision == KILN_CUDA_PRECISION_TF32) {
        mode = CUBLAS_TF32_TENSOR_OP_MATH;
        *compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    } else if (precision == KILN_CUDA_PRECISION_BF16) {
        mode = CUBLAS_DEFAULT_MATH;
        *compute = CUBLAS_COMPUTE_32F_FAST_16BF;
    }
    KILN_BLAS(cublasSetMathMode(handle->handle, mode));
    return 0;
}

int kiln_cuda_gemm(void *blas, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                   const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc,
                   int precision) {
    KilnBlas *handle = (KilnBlas *)blas;
    cublasComputeType_t compute;
    KILN_TRY(kiln_gemm_setup(handle, precision, &compute));
    KILN_REQUIRE(kiln_fits_int(M) && kiln_fits_int(N) && kiln_fits_int(K) && kiln_fits_int(lda) &&
                 kiln_fits_int(ldb) && kiln_fits_int(ldc), "a GEMM dimension is negative or above 2^31-1");
    if (M == 0 || N == 0) return 0;
    KILN_BLAS(cublasGemmEx(handle->handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                           (int)N, (int)M, (int)K, &alpha, B, CUDA_R_32F, (int)ldb, A, CUDA_R_32F, (int)lda, &beta, C,
                           CUDA_R_32F, (int)ldc, compute, CUBLAS_GEMM_DEFAULT));
    return 0;
}

int kiln_cuda_gemm_strided_batched(void *blas, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                                   float alpha, const float *A, int64_t lda, int64_t stride_a, const float *B,
                                   int64_t ldb, int64_t stride_b, float beta, float *C, int64_t ldc,
                                   int64_t stride_c, int64_t batch, int precision) {
    KilnBlas *handle = (KilnBlas *)blas;
    cublasComputeType_t compute;
    KILN_TRY(kiln_gemm_setup(handle, precision, &compute));
    KILN_REQUIRE(kiln_fits_int(M) && kiln_fits_int(N) && kiln_fits_int(K) && kiln_fits_int(lda) &&
                 kiln_fits_int(ldb) && kiln_fits_int(ldc) && kiln_fits_int(batch),
                 "a GEMM dimension is negative or above 2^31-1");
    if (M == 0 || N == 0 || batch == 0) return 0;
    KILN_BLAS(cublasGemmStridedBatchedEx(handle->handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)N, (int)M, (int)K, &alpha, B,
                                         CUDA_R_32F, (int)ldb, stride_b, A, CUDA_R_32F, (int)lda, stride_a, &beta, C,
                                         CUDA_R_32F, (int)ldc, stride_c, (int)batch, compute, CUBLAS_GEMM_DEFAULT));
    return 0;
}

}  // extern "C"
