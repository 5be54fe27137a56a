// A fake CUDA runtime and cuBLAS on host memory, linked with the real native_ext/cuda/runtime.cu by
// tests/engine/test_cuda_runtime_host.py so that runtime.cu's own code runs without a GPU. It includes the real
// cuda_runtime.h and cublas_v2.h, so every signature it defines is the toolkit's (the headers' _v2 macros apply to
// both sides). "Device" memory is host memory the fake tracks; a device pointer outside a live allocation, or a
// host pointer inside one, is refused as cudaErrorInvalidValue. The GEMMs are a column-major reference that checks
// its arguments as cuBLAS documents (op N or T, m, n, k, batch >= 0, lda >= max(1, rows of the stored A),
// ldb likewise, ldc >= max(1, m), CUDA_R_32F operands: CUBLAS_STATUS_INVALID_VALUE otherwise), accumulates in
// double, and refuses an operand that reaches outside its allocation (CUBLAS_STATUS_EXECUTION_FAILED, where a GPU
// would fault). As cuBLAS documents, cublasSetStream resets the handle to the default workspace pool.
// The test reads what was called through kiln_fake_get(name) and injects one failure through kiln_fake_fail.
// Test use only.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <climits>
#include <map>
#include <set>
#include <string>

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace {

constexpr size_t kAlignment = 256;  // cudaMalloc's alignment; cublasSetWorkspace requires it
constexpr float kEventTick = 0.25f;  // milliseconds the fake clock advances per cudaEventRecord

struct Handle {
    cudaStream_t stream = nullptr;
    void *workspace = nullptr;  // nullptr with user_workspace 0: cuBLAS's default pool
    size_t workspace_bytes = 0;
    int user_workspace = 0;
    int math = -1;  // -1: never set by the caller
    int atomics = -1;
};

struct Event {
    int recorded = 0;
    float time_ms = 0.0f;
};

struct State {
    std::map<uintptr_t, size_t> allocations;  // start -> bytes
    std::set<cudaStream_t> streams;
    std::map<cudaEvent_t, Event> events;
    std::set<Handle *> handles;
    std::map<std::string, int> failures;  // function name -> status its next call returns
    std::map<std::string, long long> values = {  // what kiln_fake_get reports; the counters start at 0
        {"gemm.calls", 0}, {"stream_synchronize.calls", 0}, {"device_synchronize.calls", 0}};
    float clock_ms = 0.0f;
};

State &state() {
    static State instance;
    return instance;
}

void note(const char *name, long long value) { state().values[name] = value; }

long long pointer_value(const void *pointer) { return (long long)(uintptr_t)pointer; }

// the status injected for this call of FUNCTION, once; 0 when none
int injected(const char *function) {
    auto found = state().failures.find(function);
    if (found == state().failures.end()) return 0;
    int status = found->second;
    state().failures.erase(found);
    return status;
}

// [pointer, pointer + bytes) lies inside one live allocation
bool on_device(const void *pointer, size_t bytes) {
    auto &allocations = state().allocations;
    uintptr_t start = (uintptr_t)pointer;
    auto after = allocations.upper_bound(start);
    if (after == allocations.begin()) return false;
    auto holder = std::prev(after);
    return start >= holder->first && start + bytes <= holder->first + holder->second;
}

bool on_host(const void *pointer, size_t bytes) {
    if (!pointer) return false;
    uintptr_t start = (uintptr_t)pointer, end = start + (bytes ? bytes : 1);
    for (auto &allocation : state().allocations)
        if (start < allocation.first + allocation.second && allocation.first < end) return false;
    return true;
}

bool known_stream(cudaStream_t stream) { return stream == nullptr || state().streams.count(stream); }

Handle *live(cublasHandle_t handle) {
    Handle *fake = (Handle *)handle;
    return state().handles.count(fake) ? fake : nullptr;
}

// one column-major product C = alpha op(A) op(B) + beta C, in double; the operands were checked by the caller
void reference_gemm(cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k, double alpha,
                    const float *A, int lda, const float *B, int ldb, double beta, float *C, int ldc) {
    for (int j = 0; j < n; j++) {
        for (int i = 0; i < m; i++) {
            double sum = 0.0;
            for (int p = 0; p < k; p++) {
                double a = transa == CUBLAS_OP_N ? A[i + (size_t)p * lda] : A[p + (size_t)i * lda];
                double b = transb == CUBLAS_OP_N ? B[p + (size_t)j * ldb] : B[j + (size_t)p * ldb];
                sum += a * b;
            }
            float *c = &C[i + (size_t)j * ldc];
            *c = (float)(beta == 0.0 ? alpha * sum : alpha * sum + beta * (double)*c);  // beta 0: C is not read
        }
    }
}

// the bytes a column-major operand of `rows` x `columns` with leading dimension `ld` spans
size_t span_bytes(int rows, int columns, int ld) {
    if (rows == 0 || columns == 0) return 0;
    return ((size_t)(columns - 1) * ld + rows) * sizeof(float);
}

cublasStatus_t gemm(const char *name, cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                    int m, int n, int k, const void *alpha, const void *A, cudaDataType Atype, int lda,
                    long long stride_a, const void *B, cudaDataType Btype, int ldb, long long stride_b,
                    const void *beta, void *C, cudaDataType Ctype, int ldc, long long stride_c, int batch,
                    cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    note("gemm.calls", state().values["gemm.calls"] + 1);
    note("gemm.batched", strcmp(name, "cublasGemmStridedBatchedEx") == 0);
    Handle *fake = live(handle);
    if (!fake) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (int status = injected(name)) return (cublasStatus_t)status;
    note("gemm.transa", transa);
    note("gemm.transb", transb);
    note("gemm.m", m);
    note("gemm.n", n);
    note("gemm.k", k);
    note("gemm.lda", lda);
    note("gemm.ldb", ldb);
    note("gemm.ldc", ldc);
    note("gemm.batch", batch);
    note("gemm.compute", compute);
    note("gemm.algo", algo);
    note("gemm.math", fake->math);
    note("gemm.atomics", fake->atomics);
    note("gemm.stream", pointer_value(fake->stream));
    note("gemm.workspace", pointer_value(fake->workspace));
    note("gemm.workspace_bytes", (long long)fake->workspace_bytes);
    note("gemm.user_workspace", fake->user_workspace);
    bool ops = (transa == CUBLAS_OP_N || transa == CUBLAS_OP_T) && (transb == CUBLAS_OP_N || transb == CUBLAS_OP_T);
    int a_rows = transa == CUBLAS_OP_N ? m : k, a_columns = transa == CUBLAS_OP_N ? k : m;
    int b_rows = transb == CUBLAS_OP_N ? k : n, b_columns = transb == CUBLAS_OP_N ? n : k;
    if (!ops || m < 0 || n < 0 || k < 0 || batch < 0 || lda < (a_rows > 1 ? a_rows : 1) ||
        ldb < (b_rows > 1 ? b_rows : 1) || ldc < (m > 1 ? m : 1) || Atype != CUDA_R_32F || Btype != CUDA_R_32F ||
        Ctype != CUDA_R_32F || !alpha || !beta)
        return CUBLAS_STATUS_INVALID_VALUE;
    if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_PEDANTIC &&
        compute != CUBLAS_COMPUTE_32F_FAST_TF32 && compute != CUBLAS_COMPUTE_32F_FAST_16BF &&
        compute != CUBLAS_COMPUTE_32F_FAST_16F)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
    double alpha_value = *(const float *)alpha, beta_value = *(const float *)beta;
    for (int b = 0; b < batch; b++) {
        const float *a = (const float *)A + b * stride_a;
        const float *bb = (const float *)B + b * stride_b;
        float *c = (float *)C + b * stride_c;
        if (!on_device(c, span_bytes(m, n, ldc)) || (k > 0 && (!on_device(a, span_bytes(a_rows, a_columns, lda)) ||
                                                              !on_device(bb, span_bytes(b_rows, b_columns, ldb))))) {
            note("gemm.out_of_bounds", b);
            return CUBLAS_STATUS_EXECUTION_FAILED;
        }
    }
    for (int b = 0; b < batch; b++)
        reference_gemm(transa, transb, m, n, k, alpha_value, (const float *)A + b * stride_a, lda,
                       (const float *)B + b * stride_b, ldb, beta_value, (float *)C + b * stride_c, ldc);
    return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

// --- the test's side: inject a failure, read what was called ---

// the next call of FUNCTION (its name as runtime.cu spells it, e.g. "cudaMalloc", "cublasCreate") returns STATUS
void kiln_fake_fail(const char *function, int status) {
    state().failures[function] = status;
}

// a recorded value, a count (live_allocations, allocated_bytes, live_handles, live_streams, live_events), or
// LLONG_MIN for a name never recorded
long long kiln_fake_get(const char *name) {
    State &s = state();
    std::string key = name;
    if (key == "live_allocations") return (long long)s.allocations.size();
    if (key == "allocated_bytes") {
        long long total = 0;
        for (auto &allocation : s.allocations) total += (long long)allocation.second;
        return total;
    }
    if (key == "live_handles") return (long long)s.handles.size();
    if (key == "live_streams") return (long long)s.streams.size();
    if (key == "live_events") return (long long)s.events.size();
    if (key == "pending_failures") return (long long)s.failures.size();
    auto found = s.values.find(key);
    return found == s.values.end() ? LLONG_MIN : found->second;
}

// forget every failure injected and not yet returned
void kiln_fake_clear(void) { state().failures.clear(); }

// an enumerator of the headers runtime.cu compiles against, by name, or LLONG_MIN
long long kiln_fake_constant(const char *name) {
    static const std::map<std::string, long long> constants = {
        {"CUBLAS_DEFAULT_MATH", CUBLAS_DEFAULT_MATH},
        {"CUBLAS_PEDANTIC_MATH", CUBLAS_PEDANTIC_MATH},
        {"CUBLAS_TF32_TENSOR_OP_MATH", CUBLAS_TF32_TENSOR_OP_MATH},
        {"CUBLAS_COMPUTE_32F_PEDANTIC", CUBLAS_COMPUTE_32F_PEDANTIC},
        {"CUBLAS_COMPUTE_32F_FAST_TF32", CUBLAS_COMPUTE_32F_FAST_TF32},
        {"CUBLAS_COMPUTE_32F_FAST_16BF", CUBLAS_COMPUTE_32F_FAST_16BF},
        {"CUBLAS_ATOMICS_NOT_ALLOWED", CUBLAS_ATOMICS_NOT_ALLOWED},
        {"CUBLAS_OP_N", CUBLAS_OP_N},
        {"CUBLAS_OP_T", CUBLAS_OP_T},
        {"CUBLAS_GEMM_DEFAULT", CUBLAS_GEMM_DEFAULT},
        {"CUBLAS_STATUS_ALLOC_FAILED", CUBLAS_STATUS_ALLOC_FAILED},
        {"CUBLAS_STATUS_INVALID_VALUE", CUBLAS_STATUS_INVALID_VALUE},
        {"CUBLAS_STATUS_EXECUTION_FAILED", CUBLAS_STATUS_EXECUTION_FAILED},
        {"CUBLAS_STATUS_NOT_SUPPORTED", CUBLAS_STATUS_NOT_SUPPORTED},
        {"cudaErrorMemoryAllocation", cudaErrorMemoryAllocation},
        {"cudaErrorInvalidDevice", cudaErrorInvalidDevice},
        {"cudaStreamNonBlocking", cudaStreamNonBlocking},
        {"cudaDevAttrMaxSharedMemoryPerBlockOptin", cudaDevAttrMaxSharedMemoryPerBlockOptin},
        {"cudaMemcpyHostToDevice", cudaMemcpyHostToDevice},
        {"cudaMemcpyDeviceToHost", cudaMemcpyDeviceToHost},
        {"cudaMemcpyDeviceToDevice", cudaMemcpyDeviceToDevice},
    };
    auto found = constants.find(name);
    return found == constants.end() ? LLONG_MIN : found->second;
}

// the bytes of the live allocation that starts at POINTER, or -1
long long kiln_fake_allocation_bytes(const void *pointer) {
    auto found = state().allocations.find((uintptr_t)pointer);
    return found == state().allocations.end() ? -1 : (long long)found->second;
}

// the handle's state as the last call left it (for kiln_cuda_blas_create, which keeps it private)
long long kiln_fake_handle(const char *field) {
    Handle *fake = (Handle *)(uintptr_t)kiln_fake_get("handle");
    if (!live((cublasHandle_t)fake)) return LLONG_MIN;
    std::string key = field;
    if (key == "stream") return pointer_value(fake->stream);
    if (key == "workspace") return pointer_value(fake->workspace);
    if (key == "workspace_bytes") return (long long)fake->workspace_bytes;
    if (key == "user_workspace") return fake->user_workspace;
    if (key == "math") return fake->math;
    if (key == "atomics") return fake->atomics;
    return LLONG_MIN;
}

// --- the CUDA runtime ---

const char *cudaGetErrorName(cudaError_t error) {
    switch (error) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
        case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
        case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
        default: return "cudaErrorUnknown";
    }
}

const char *cudaGetErrorString(cudaError_t error) {
    switch (error) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorMemoryAllocation: return "out of memory";
        case cudaErrorInvalidDevice: return "invalid device ordinal";
        case cudaErrorInvalidResourceHandle: return "invalid resource handle";
        default: return "unknown error";
    }
}

cudaError_t cudaGetDeviceCount(int *count) {
    if (int status = injected("cudaGetDeviceCount")) return (cudaError_t)status;
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *properties, int device) {
    if (int status = injected("cudaGetDeviceProperties")) return (cudaError_t)status;
    if (device != 0) return cudaErrorInvalidDevice;
    memset(properties, 0, sizeof *properties);
    snprintf(properties->name, sizeof properties->name, "Fake GPU 9.0");
    properties->major = 9;
    properties->minor = 0;
    properties->totalGlobalMem = (size_t)80 << 30;
    properties->multiProcessorCount = 132;
    return cudaSuccess;
}

// the one attribute runtime.cu asks for: the opt-in shared memory per block of a compute 9.0 device (227 KiB)
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attribute, int device) {
    if (int status = injected("cudaDeviceGetAttribute")) return (cudaError_t)status;
    note("device_attribute.attribute", attribute);
    note("device_attribute.device", device);
    if (device != 0) return cudaErrorInvalidDevice;
    if (attribute != cudaDevAttrMaxSharedMemoryPerBlockOptin) return cudaErrorInvalidValue;
    *value = 227 << 10;
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *version) {
    *version = 13010;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *version) {
    *version = 13000;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    note("set_device", device);
    return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    *total_bytes = (size_t)80 << 30;
    *free_bytes = *total_bytes - (size_t)kiln_fake_get("allocated_bytes");
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
    note("device_synchronize.calls", state().values["device_synchronize.calls"] + 1);
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **pointer, size_t bytes) {
    if (int status = injected("cudaMalloc")) {
        *pointer = nullptr;
        return (cudaError_t)status;
    }
    size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    void *memory = aligned_alloc(kAlignment, rounded ? rounded : kAlignment);
    if (!memory) return cudaErrorMemoryAllocation;
    memset(memory, 0xA5, rounded ? rounded : kAlignment);  // fresh device memory is not zero
    state().allocations[(uintptr_t)memory] = bytes;
    *pointer = memory;
    return cudaSuccess;
}

cudaError_t cudaFree(void *pointer) {
    if (!pointer) return cudaSuccess;
    auto found = state().allocations.find((uintptr_t)pointer);
    if (found == state().allocations.end()) return cudaErrorInvalidValue;
    state().allocations.erase(found);
    free(pointer);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
    note("memcpy.kind", kind);
    note("memcpy.stream", pointer_value(stream));
    if (!known_stream(stream)) return cudaErrorInvalidResourceHandle;
    bool valid = (kind == cudaMemcpyHostToDevice && on_device(dst, bytes) && on_host(src, bytes)) ||
                 (kind == cudaMemcpyDeviceToHost && on_host(dst, bytes) && on_device(src, bytes)) ||
                 (kind == cudaMemcpyDeviceToDevice && on_device(dst, bytes) && on_device(src, bytes));
    if (!valid) return cudaErrorInvalidValue;
    memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *pointer, int value, size_t bytes, cudaStream_t stream) {
    note("memset.stream", pointer_value(stream));
    if (!known_stream(stream)) return cudaErrorInvalidResourceHandle;
    if (!on_device(pointer, bytes)) return cudaErrorInvalidValue;
    memset(pointer, value, bytes);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
    if (int status = injected("cudaStreamCreateWithFlags")) return (cudaError_t)status;
    cudaStream_t created = (cudaStream_t)malloc(1);
    state().streams.insert(created);
    note("stream.flags", flags);
    *stream = created;
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    if (!stream || !state().streams.erase(stream)) return cudaErrorInvalidResourceHandle;
    free((void *)stream);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    note("stream_synchronize.calls", state().values["stream_synchronize.calls"] + 1);
    note("stream_synchronize.stream", pointer_value(stream));
    return known_stream(stream) ? cudaSuccess : cudaErrorInvalidResourceHandle;
}

cudaError_t cudaEventCreate(cudaEvent_t *event) {
    cudaEvent_t created = (cudaEvent_t)malloc(1);
    state().events[created] = Event();
    *event = created;
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    if (!state().events.erase(event)) return cudaErrorInvalidResourceHandle;
    free((void *)event);
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    auto found = state().events.find(event);
    if (found == state().events.end() || !known_stream(stream)) return cudaErrorInvalidResourceHandle;
    state().clock_ms += kEventTick;
    found->second.recorded = 1;
    found->second.time_ms = state().clock_ms;
    note("event_record.stream", pointer_value(stream));
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    return state().events.count(event) ? cudaSuccess : cudaErrorInvalidResourceHandle;
}

cudaError_t cudaEventElapsedTime(float *milliseconds, cudaEvent_t start, cudaEvent_t end) {
    auto first = state().events.find(start), last = state().events.find(end);
    if (first == state().events.end() || last == state().events.end()) return cudaErrorInvalidResourceHandle;
    if (!first->second.recorded || !last->second.recorded) return cudaErrorInvalidResourceHandle;
    *milliseconds = last->second.time_ms - first->second.time_ms;
    return cudaSuccess;
}

// --- cuBLAS ---

const char *cublasGetStatusName(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
        case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
        default: return "CUBLAS_STATUS_UNKNOWN";
    }
}

cublasStatus_t cublasGetProperty(libraryPropertyType type, int *value) {
    if (!value) return CUBLAS_STATUS_INVALID_VALUE;
    switch (type) {
        case MAJOR_VERSION: *value = 13; return CUBLAS_STATUS_SUCCESS;
        case MINOR_VERSION: *value = 1; return CUBLAS_STATUS_SUCCESS;
        case PATCH_LEVEL: *value = 2; return CUBLAS_STATUS_SUCCESS;
        default: return CUBLAS_STATUS_INVALID_VALUE;
    }
}

cublasStatus_t cublasCreate(cublasHandle_t *handle) {
    if (int status = injected("cublasCreate")) return (cublasStatus_t)status;
    Handle *created = new Handle();
    state().handles.insert(created);
    note("handle", pointer_value(created));
    *handle = (cublasHandle_t)created;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
    Handle *fake = live(handle);
    if (!fake) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (int status = injected("cublasDestroy")) return (cublasStatus_t)status;
    state().handles.erase(fake);
    delete fake;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
    Handle *fake = live(handle);
    if (!fake) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (int status = injected("cublasSetStream")) return (cublasStatus_t)status;
    fake->stream = stream;
    fake->workspace = nullptr;  // "unconditionally resets the cuBLAS library workspace back to the default pool"
    fake->workspace_bytes = 0;
    fake->user_workspace = 0;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void *workspace, size_t bytes) {
    Handle *fake = live(handle);
    if (!fake) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (int status = injected("cublasSetWorkspace")) return (cublasStatus_t)status;
    if ((uintptr_t)workspace % kAlignment != 0 || (bytes && !on_device(workspace, bytes)))
        return CUBLAS_STATUS_INVALID_VALUE;
    fake->workspace = workspace;
    fake->workspace_bytes = bytes;
    fake->user_workspace = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
    Handle *fake = live(handle);
    if (!fake) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (int status = injected("cublasSetMathMode")) return (cublasStatus_t)status;
    fake->math = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t mode) {
    Handle *fake = live(handle);
    if (!fake) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (int status = injected("cublasSetAtomicsMode")) return (cublasStatus_t)status;
    fake->atomics = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void *alpha, const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo) {
    return gemm("cublasGemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta, C,
                Ctype, ldc, 0, 1, compute, algo);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                          int m, int n, int k, const void *alpha, const void *A, cudaDataType Atype,
                                          int lda, long long int stride_a, const void *B, cudaDataType Btype, int ldb,
                                          long long int stride_b, const void *beta, void *C, cudaDataType Ctype,
                                          int ldc, long long int stride_c, int batch, cublasComputeType_t compute,
                                          cublasGemmAlgo_t algo) {
    return gemm("cublasGemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, stride_a, B,
                Btype, ldb, stride_b, beta, C, Ctype, ldc, stride_c, batch, compute, algo);
}

}  // extern "C"
