/* A host emulation of the little of CUDA the kernels use, for tests on machines without a GPU: the same
 * kernel source compiled by g++ with -DKILN_CUDA_EMULATE. A launch runs the blocks one after another; the
 * threads of a block are fibers (ucontext) on one OS thread that switch at __syncthreads, so __shared__
 * (a static local) and dynamic shared memory behave as on the device; the threads run to their next barrier by
 * index, or reversed or shuffled (kiln_emu_set_thread_order, for races). A barrier that some threads of a
 * block skip aborts with a message. Dynamic shared memory starts as NaN bytes, so a read before a write
 * shows. Built into a test library with emulate_runtime.cpp (host memory, a plain GEMM); never shipped
 * in libkiln_cuda.so. */
#ifndef KILN_CUDA_EMULATE_H
#define KILN_CUDA_EMULATE_H

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __constant__
#define __shared__ static

typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
typedef int cublasStatus_t;
typedef void *cublasHandle_t;
enum { CUBLAS_STATUS_SUCCESS = 0 };

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct float2 {
    float x, y;
};
struct float4 {
    float x, y, z, w;
};

namespace kiln_emu {
/* a vector load from an address the device would fault on aborts here with a message */
inline void check_aligned(const void *pointer, size_t bytes) {
    if ((uintptr_t)pointer % bytes) {
        fprintf(stderr, "kiln_emu: a %zu-byte load from %p, which is not %zu-byte aligned\n", bytes, pointer, bytes);
        abort();
    }
}
const dim3 &thread_index();
const dim3 &block_index();
const dim3 &block_dim();
const dim3 &grid_dim();
void syncthreads();
void *dynamic_shared();
/* a launch: its configuration checked against the device's limits (a failure is kept for cudaGetLastError and
 * nothing runs), then every block in turn; KERNEL identifies the kernel for its shared-memory attribute */
void run(const void *kernel, dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()> &body);
cudaError_t take_error(); /* the first launch error since the last call, then cleared (cudaGetLastError) */
cudaError_t set_max_dynamic_shared(const void *kernel, int bytes);
bool dry_run(); /* kiln_emu_set_dry_run: launches and copies are checked, not run */

template <typename Kernel>
struct Launcher {
    Kernel *kernel;
    dim3 grid, block;
    size_t shared_bytes;
    template <typename... Args>
    void operator()(Args... args) const {
        Kernel *k = kernel;
        run(reinterpret_cast<const void *>(k), grid, block, shared_bytes, [=]() { k(args...); });
    }
};

template <typename Kernel>
Launcher<Kernel> launcher(Kernel *kernel, dim3 grid, dim3 block, size_t shared_bytes) {
    return Launcher<Kernel>{kernel, grid, block, shared_bytes};
}
}  // namespace kiln_emu

#define threadIdx (kiln_emu::thread_index())
#define blockIdx (kiln_emu::block_index())
#define blockDim (kiln_emu::block_dim())
#define gridDim (kiln_emu::grid_dim())
#define __syncthreads() kiln_emu::syncthreads()
#define KILN_LAUNCH(kernel, grid, block, shared, stream) ((void)(stream), kiln_emu::launcher(kernel, (grid), (block), (shared)))
#define KILN_DYNAMIC_SHARED(type, name) type *name = (type *)kiln_emu::dynamic_shared()

static inline cudaError_t cudaGetLastError() { return kiln_emu::take_error(); }
static inline cudaError_t cudaGetDevice(int *device) {
    *device = 0;  // the emulation's one device
    return cudaSuccess;
}
template <typename T>
cudaError_t cudaFuncSetAttribute(T kernel, cudaFuncAttribute, int bytes) {
    return kiln_emu::set_max_dynamic_shared(reinterpret_cast<const void *>(kernel), bytes);
}
static inline cudaError_t cudaMemsetAsync(void *pointer, int value, size_t bytes, cudaStream_t) {
    if (!kiln_emu::dry_run()) memset(pointer, value, bytes);
    return cudaSuccess;
}

#endif
