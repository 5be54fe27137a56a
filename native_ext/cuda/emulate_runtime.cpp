// The host side of the emulation (kiln_cuda_emulate.h): the fiber scheduler, and every export of
// runtime.cu on host memory (a plain GEMM, accumulating in double, in place of cuBLAS), so the emulated
// library has the whole ABI and native_ext.cuda can bind it. Test use only.
#include <ucontext.h>

// Fibers switch with a few instructions on x86-64 (callee-saved registers and the stack pointer: no signal-mask
// system calls, which swapcontext makes twice a switch); under AddressSanitizer, and elsewhere, through ucontext,
// which the sanitizer understands.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define KILN_FAST_FIBERS 1
extern "C" void kiln_emu_switch(void **save_sp, void *load_sp);
__asm__(R"(
    .text
    .globl kiln_emu_switch
    .hidden kiln_emu_switch
    .type kiln_emu_switch, @function
kiln_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kiln_emu_switch, .-kiln_emu_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <utility>
#include <memory>
#include <vector>

#include "kiln_cuda_internal.h"

namespace kiln_emu {
namespace {

constexpr size_t kStack = 256 * 1024;

// the launch limits of the device the emulation reports (compute capability 8.0, an A100): grid x below 2^31, grid
// y and z at most 65535, 1024 threads a block (z at most 64), 48 KiB of dynamic shared memory a block unless
// cudaFuncSetAttribute raised the kernel's limit, which it can up to the opt-in limit: 163 KiB, or what
// $KILN_EMU_SHARED_OPTIN (bytes, read when the library loads and at kiln_emu_reset) or kiln_emu_set_shared_optin
// says, to emulate a device with less (99 KiB: compute 8.6 and 8.9) or more (227 KiB: 9.0)
constexpr unsigned kMaxGridX = 0x7fffffffu, kMaxGridYZ = 65535, kMaxThreads = 1024, kMaxBlockZ = 64;
constexpr size_t kDefaultShared = 48 << 10, kOptInShared = 163 << 10;

size_t optin_from_environment() {
    const char *text = getenv("KILN_EMU_SHARED_OPTIN");
    if (!text || !*text) return kOptInShared;
    char *end = nullptr;
    unsigned long long bytes = strtoull(text, &end, 10);
    if (*end) {
        fprintf(stderr, "kiln_emu: KILN_EMU_SHARED_OPTIN=%s is not a number of bytes\n", text);
        abort();
    }
    return (size_t)bytes;
}

struct Device {
    size_t optin_shared = optin_from_environment();  // cudaDevAttrMaxSharedMemoryPerBlockOptin
    std::map<const void *, size_t> shared_limit;  // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel
    cudaError_t error = cudaSuccess;              // the first launch error not yet taken by cudaGetLastError
    cudaError_t fail_next = cudaSuccess;          // kiln_emu_fail_next_launch
    bool dry_run = false;                         // kiln_emu_set_dry_run
    int thread_order = 0;                         // kiln_emu_set_thread_order
    uint64_t shuffle_state = 0;
};

Device device;

// The order of a round's threads: by index (0), reversed (1), or shuffled afresh each round (2, a fixed xorshift
// sequence from kiln_emu_set_thread_order). On a device the threads run between two barriers in no fixed order, so a
// kernel whose result changes with the order reads what another thread writes in the same interval: a race.
void next_order(std::vector<size_t> &order, size_t n) {
    order.resize(n);
    for (size_t i = 0; i < n; i++) order[i] = device.thread_order == 1 ? n - 1 - i : i;
    if (device.thread_order != 2) return;
    for (size_t i = n - 1; i > 0; i--) {
        uint64_t &x = device.shuffle_state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::swap(order[i], order[x % (i + 1)]);
    }
}

cudaError_t check_launch(const void *kernel, dim3 grid, dim3 block, size_t shared_bytes) {
    const unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > kMaxGridX || grid.y > kMaxGridYZ ||
        grid.z > kMaxGridYZ || threads == 0 || threads > kMaxThreads || block.z > kMaxBlockZ)
        return cudaErrorInvalidConfiguration;
    auto limit = device.shared_limit.find(kernel);
    if (shared_bytes > (limit == device.shared_limit.end() ? kDefaultShared : limit->second))
        return cudaErrorInvalidValue;
    return cudaSuccess;
}

struct Scheduler {
    dim3 grid, block, block_index;
    std::vector<dim3> threads;
    std::vector<ucontext_t> contexts;
    std::vector<void *> stack_pointers;  // KILN_FAST_FIBERS: each suspended fiber's saved stack pointer
    void *main_stack_pointer = nullptr;
    std::vector<std::vector<char>> stacks;
    std::vector<char> done;
    std::vector<size_t> order;  // the order in which this round runs the block's threads
    std::unique_ptr<char[]> shared;  // a fresh allocation per block, exactly its size (a sanitizer sees overruns)
    ucontext_t main;
    const std::function<void()> *body = nullptr;
    int current = -1;
};

Scheduler scheduler;

#ifndef KILN_FAST_FIBERS
void fiber_entry() {
    (*scheduler.body)();
    scheduler.done[scheduler.current] = 1;
}  // returns to scheduler.main through uc_link
#endif

#ifdef KILN_FAST_FIBERS
[[noreturn]] void fast_fiber_entry() {
    (*scheduler.body)();
    scheduler.done[scheduler.current] = 1;
    void *finished;
    kiln_emu_switch(&finished, scheduler.main_stack_pointer);
    __builtin_unreachable();
}

// a fresh fiber's stack: six zeroed callee-saved registers, then fast_fiber_entry as kiln_emu_switch's return
// address and a null return address of its own, so it starts with the stack aligned as after a call
void *fresh_stack(std::vector<char> &stack) {
    auto top = reinterpret_cast<uintptr_t>(stack.data() + stack.size()) & ~(uintptr_t)15;
    void **sp = reinterpret_cast<void **>(top);
    *--sp = nullptr;
    *--sp = reinterpret_cast<void *>(&fast_fiber_entry);
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    return sp;
}
#endif

void enter(size_t t) {
#ifdef KILN_FAST_FIBERS
    kiln_emu_switch(&scheduler.main_stack_pointer, scheduler.stack_pointers[t]);
#else
    swapcontext(&scheduler.main, &scheduler.contexts[t]);
#endif
}

void prepare(size_t t) {
#ifdef KILN_FAST_FIBERS
    scheduler.stack_pointers[t] = fresh_stack(scheduler.stacks[t]);
#else
    getcontext(&scheduler.contexts[t]);
    scheduler.contexts[t].uc_stack.ss_sp = scheduler.stacks[t].data();
    scheduler.contexts[t].uc_stack.ss_size = kStack;
    scheduler.contexts[t].uc_link = &scheduler.main;
    makecontext(&scheduler.contexts[t], fiber_entry, 0);
#endif
}

}  // namespace

const dim3 &thread_index() { return scheduler.threads[scheduler.current]; }
const dim3 &block_index() { return scheduler.block_index; }
const dim3 &block_dim() { return scheduler.block; }
const dim3 &grid_dim() { return scheduler.grid; }
void *dynamic_shared() { return scheduler.shared.get(); }

void syncthreads() {
#ifdef KILN_FAST_FIBERS
    kiln_emu_switch(&scheduler.stack_pointers[scheduler.current], scheduler.main_stack_pointer);
#else
    swapcontext(&scheduler.contexts[scheduler.current], &scheduler.main);
#endif
}

cudaError_t take_error() {
    cudaError_t error = device.error;
    device.error = cudaSuccess;
    return error;
}

cudaError_t set_max_dynamic_shared(const void *kernel, int bytes) {
    if (bytes < 0 || (size_t)bytes > device.optin_shared) return cudaErrorInvalidValue;
    device.shared_limit[kernel] = (size_t)bytes;
    return cudaSuccess;
}

bool dry_run() { return device.dry_run; }

void run(const void *kernel, dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()> &body) {
    cudaError_t error = device.fail_next ? device.fail_next : check_launch(kernel, grid, block, shared_bytes);
    device.fail_next = cudaSuccess;
    if (error != cudaSuccess) {
        if (device.error == cudaSuccess) device.error = error;
        return;
    }
    if (device.dry_run) return;
    const size_t n = (size_t)block.x * block.y * block.z;
    scheduler.grid = grid;
    scheduler.block = block;
    scheduler.body = &body;
    scheduler.threads.resize(n);
    scheduler.contexts.resize(n);
    scheduler.stack_pointers.resize(n);
    scheduler.done.assign(n, 0);
    if (scheduler.stacks.size() < n) scheduler.stacks.resize(n, std::vector<char>(kStack));
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                scheduler.block_index = dim3(bx, by, bz);
                scheduler.shared.reset(new char[shared_bytes ? shared_bytes : 1]);
                memset(scheduler.shared.get(), 0xff, shared_bytes);  // NaN floats until written
                for (size_t t = 0; t < n; t++) {
                    scheduler.threads[t] = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
                    scheduler.done[t] = 0;
                    prepare(t);
                }
                for (;;) {  // one round: every live thread runs to its next barrier or its end
                    size_t finished = 0, waiting = 0;
                    next_order(scheduler.order, n);
                    for (size_t t : scheduler.order) {
                        if (scheduler.done[t]) continue;
                        scheduler.current = (int)t;
                        enter(t);
                        (scheduler.done[t] ? finished : waiting)++;
                    }
                    if (waiting == 0) break;
                    if (finished) {
                        fprintf(stderr, "kiln_cuda emulation: barrier divergence in block (%u,%u,%u): %zu threads "
                                "ended while %zu wait at __syncthreads\n", bx, by, bz, finished, waiting);
                        abort();
                    }
                }
            }
    scheduler.current = -1;
}

}  // namespace kiln_emu

static thread_local char kiln_last_error[512] = "";

int kiln_record_cuda(cudaError_t error, const char *where) {
    snprintf(kiln_last_error, sizeof kiln_last_error, "%s: emulated error %d", where, (int)error);
    return (int)error;
}

int kiln_record_cublas(cublasStatus_t status, const char *where) {
    snprintf(kiln_last_error, sizeof kiln_last_error, "%s: emulated cuBLAS status %d", where, (int)status);
    return KILN_CUDA_BLAS_STATUS_BASE + (int)status;
}

int kiln_record_argument(const char *where, const char *message) {
    snprintf(kiln_last_error, sizeof kiln_last_error, "%s: %s", where, message);
    return KILN_CUDA_BAD_ARGUMENT;
}

extern "C" {

// Test hooks of the emulation (not kiln_cuda_* symbols, not in libkiln_cuda.so): with dry_run set, a launch, a
// memset and a GEMM check their arguments and configuration but touch no memory, so the tests can give every entry
// point a real model's shapes; fail_next_launch makes the next launch fail with ERROR, as a device's would;
// set_thread_order runs each round of a block's threads by index (0), reversed (1) or shuffled (2: next_order);
// set_shared_optin sets the device's opt-in shared memory per block (what cudaFuncSetAttribute may raise a kernel's
// limit to, and what kiln_cuda_device_shared_memory reports); reset puts the emulated device back as it was loaded
// (index order, no launch error pending, no kernel attribute set, the opt-in limit from the environment).
void kiln_emu_set_dry_run(int on) { kiln_emu::device.dry_run = on != 0; }
void kiln_emu_fail_next_launch(int error) { kiln_emu::device.fail_next = error; }
void kiln_emu_reset(void) { kiln_emu::device = kiln_emu::Device(); }
void kiln_emu_set_shared_optin(size_t bytes) { kiln_emu::device.optin_shared = bytes; }
void kiln_emu_set_thread_order(int order) {
    kiln_emu::device.thread_order = order;
    kiln_emu::device.shuffle_state = 0x9E3779B97F4A7C15ull;
}

const char *kiln_cuda_last_error(void) { return kiln_last_error; }
int kiln_cuda_abi_version(int *version) { *version = KILN_CUDA_ABI_VERSION; return 0; }
int kiln_cuda_device_count(int *count) { *count = 1; return 0; }
int kiln_cuda_device_properties(int, char *name, int name_bytes, int *major, int *minor, size_t *total_memory,
                                int *multiprocessors) {
    snprintf(name, (size_t)name_bytes, "kiln host emulation");
    *major = 8;
    *minor = 0;
    *total_memory = (size_t)1 << 30;
    *multiprocessors = 1;
    return 0;
}
int kiln_cuda_driver_version(int *version) { *version = 0; return 0; }
int kiln_cuda_runtime_version(int *version) { *version = 0; return 0; }
int kiln_cuda_cublas_version(int *version) { *version = 0; return 0; }
int kiln_cuda_device_shared_memory(int, size_t *per_block_optin) {
    *per_block_optin = kiln_emu::device.optin_shared;
    return 0;
}
int kiln_cuda_set_device(int) { return 0; }
int kiln_cuda_mem_info(size_t *free_bytes, size_t *total_bytes) { *free_bytes = *total_bytes = (size_t)1 << 30; return 0; }
int kiln_cuda_device_synchronize(void) { return 0; }
int kiln_cuda_malloc(void **pointer, size_t bytes) { *pointer = malloc(bytes ? bytes : 1); return *pointer ? 0 : 2; }
int kiln_cuda_free(void *pointer) { free(pointer); return 0; }
int kiln_cuda_memcpy_h2d(void *dst, const void *src, size_t bytes, void *) { memcpy(dst, src, bytes); return 0; }
int kiln_cuda_memcpy_d2h(void *dst, const void *src, size_t bytes, void *) { memcpy(dst, src, bytes); return 0; }
int kiln_cuda_memcpy_d2d(void *dst, const void *src, size_t bytes, void *) { memmove(dst, src, bytes); return 0; }
int kiln_cuda_memset(void *pointer, int value, size_t bytes, void *) {
    if (!kiln_emu::dry_run()) memset(pointer, value, bytes);
    return 0;
}
int kiln_cuda_stream_create(void **stream) { *stream = nullptr; return 0; }
int kiln_cuda_stream_destroy(void *) { return 0; }
int kiln_cuda_stream_synchronize(void *) { return 0; }
int kiln_cuda_event_create(void **event) { *event = nullptr; return 0; }
int kiln_cuda_event_destroy(void *) { return 0; }
int kiln_cuda_event_record(void *, void *) { return 0; }
int kiln_cuda_event_synchronize(void *) { return 0; }
int kiln_cuda_event_elapsed_ms(float *milliseconds, void *, void *) { *milliseconds = 0.0f; return 0; }

int kiln_cuda_blas_create(void **blas, void *stream, size_t) {
    KilnBlas *created = new KilnBlas();
    created->stream = (cudaStream_t)stream;
    *blas = created;
    return 0;
}
int kiln_cuda_blas_destroy(void *blas) { delete (KilnBlas *)blas; return 0; }
int kiln_cuda_blas_set_stream(void *blas, void *stream) { ((KilnBlas *)blas)->stream = (cudaStream_t)stream; return 0; }

// The tensor cores' operand rounding, emulated: TF32 keeps 10 mantissa bits, bfloat16 7, rounded to nearest with
// ties to even (a NaN or an infinity passes unchanged); FP32 operands stay as they are.
static double kiln_emulate_operand(float value, int precision) {
    if (precision == 0) return value;
    const int drop = precision == 1 ? 13 : 16;
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7F800000u) != 0x7F800000u) {
        const uint32_t half = (1u << (drop - 1)) - 1u + ((bits >> drop) & 1u);
        bits = (bits + half) & ~((1u << drop) - 1u);
    }
    float rounded;
    memcpy(&rounded, &bits, sizeof rounded);
    return rounded;
}

int kiln_cuda_gemm_strided_batched(void *blas, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                                   float alpha, const float *A, int64_t lda, int64_t stride_a, const float *B,
                                   int64_t ldb, int64_t stride_b, float beta, float *C, int64_t ldc,
                                   int64_t stride_c, int64_t batch, int precision) {
    KILN_REQUIRE(blas, "no cuBLAS handle");
    KILN_REQUIRE(precision == 0 || precision == 1 || precision == 2,
                 "precision must be 0 (FP32), 1 (TF32) or 2 (BF16)");
    for (int64_t value : {M, N, K, lda, ldb, ldc, batch})  // runtime.cu's guard: cuBLAS takes int dimensions
        KILN_REQUIRE(value >= 0 && value <= 0x7fffffff, "a GEMM dimension is negative or above 2^31-1");
    if (kiln_emu::dry_run()) return 0;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) {
                double sum = 0.0;
                for (int64_t k = 0; k < K; k++) {
                    const float a = trans_a ? A[b * stride_a + k * lda + m] : A[b * stride_a + m * lda + k];
                    const float bv = trans_b ? B[b * stride_b + n * ldb + k] : B[b * stride_b + k * ldb + n];
                    sum += kiln_emulate_operand(a, precision) * kiln_emulate_operand(bv, precision);
                }
                float *c = C + b * stride_c + m * ldc + n;
                *c = (float)((double)alpha * sum + (beta == 0.0f ? 0.0 : (double)beta * *c));
            }
    return 0;
}

int kiln_cuda_gemm(void *blas, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                   const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc,
                   int precision) {
    return kiln_cuda_gemm_strided_batched(blas, trans_a, trans_b, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc,
                                          0, 1, precision);
}

}  // extern "C"
