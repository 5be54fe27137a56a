/* The C ABI of libkiln_cuda.so: every exported function, as native_ext/cuda.py's SYMBOLS declares it.
 *
 * Pointers named like arrays are device memory; `stream` is a cudaStream_t (NULL: the legacy default
 * stream); `blas` is a handle from kiln_cuda_blas_create, whose stream every cuBLAS call and every
 * kernel of a composite function (fused cross-entropy, NF4 linear, LoRA) runs on.
 * Every function returns 0, a cudaError_t (1..999), 1000 + a cublasStatus_t, or KILN_CUDA_BAD_ARGUMENT;
 * kiln_cuda_last_error() names the call that failed on this thread. FP32 is the reference precision:
 * `precision` 0 is IEEE FP32 (pedantic cuBLAS compute, no TF32); 1 computes on TF32 tensor cores
 * (CUBLAS_COMPUTE_32F_FAST_TF32); 2 on BF16 tensor cores from the FP32 operands rounded to bfloat16, with FP32
 * accumulation (CUBLAS_COMPUTE_32F_FAST_16BF). Each is a precision of its own, never chosen silently.
 * Dimension letters as in native_ext/reference.py: N rows, C width, F feed-forward width, V vocabulary,
 * B batch, T time, KV key/value heads, g query heads per KV head, D head size, G = B*KV groups, S keys.
 */
#ifndef KILN_CUDA_H
#define KILN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#define KILN_CUDA_ABI_VERSION 2
#define KILN_CUDA_BLAS_STATUS_BASE 1000
#define KILN_CUDA_BAD_ARGUMENT 2001
#define KILN_CUDA_NORM_BLOCKS 256        /* doubles of kiln_cuda_sum_squares' workspace */
#define KILN_CUDA_ATTENTION_MAX_HEAD 128 /* largest head size D the attention kernels take */
#define KILN_CUDA_PRECISION_FP32 0
#define KILN_CUDA_PRECISION_TF32 1
#define KILN_CUDA_PRECISION_BF16 2

#ifdef __cplusplus
extern "C" {
#endif

/* errors, versions, devices */
const char *kiln_cuda_last_error(void);
int kiln_cuda_abi_version(int *version);
int kiln_cuda_device_count(int *count);
int kiln_cuda_device_properties(int device, char *name, int name_bytes, int *major, int *minor,
                                size_t *total_memory, int *multiprocessors);
int kiln_cuda_driver_version(int *version); /* 0 when no driver is installed */
int kiln_cuda_runtime_version(int *version);
int kiln_cuda_cublas_version(int *version);
int kiln_cuda_set_device(int device);
int kiln_cuda_mem_info(size_t *free_bytes, size_t *total_bytes);
int kiln_cuda_device_synchronize(void);
/* the most dynamic shared memory one block of DEVICE may use once a kernel opts in
 * (cudaDevAttrMaxSharedMemoryPerBlockOptin) */
int kiln_cuda_device_shared_memory(int device, size_t *per_block_optin);

/* memory */
int kiln_cuda_malloc(void **pointer, size_t bytes);
int kiln_cuda_free(void *pointer);
int kiln_cuda_memcpy_h2d(void *dst, const void *src, size_t bytes, void *stream);
int kiln_cuda_memcpy_d2h(void *dst, const void *src, size_t bytes, void *stream);
int kiln_cuda_memcpy_d2d(void *dst, const void *src, size_t bytes, void *stream);
int kiln_cuda_memset(void *pointer, int value, size_t bytes, void *stream);

/* streams and events */
int kiln_cuda_stream_create(void **stream);
int kiln_cuda_stream_destroy(void *stream);
int kiln_cuda_stream_synchronize(void *stream);
int kiln_cuda_event_create(void **event);
int kiln_cuda_event_destroy(void *event);
int kiln_cuda_event_record(void *event, void *stream);
int kiln_cuda_event_synchronize(void *event);
int kiln_cuda_event_elapsed_ms(float *milliseconds, void *start, void *end);

/* cuBLAS: one handle with a fixed workspace (allocated here, freed by destroy) */
int kiln_cuda_blas_create(void **blas, void *stream, size_t workspace_bytes);
int kiln_cuda_blas_destroy(void *blas);
int kiln_cuda_blas_set_stream(void *blas, void *stream);
/* row-major C[M,N] = alpha * op(A) @ op(B) + beta * C, op(A) [M,K], op(B) [K,N] */
int kiln_cuda_gemm(void *blas, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                   const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc,
                   int precision);
int kiln_cuda_gemm_strided_batched(void *blas, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K,
                                   float alpha, const float *A, int64_t lda, int64_t stride_a, const float *B,
                                   int64_t ldb, int64_t stride_b, float beta, float *C, int64_t ldc,
                                   int64_t stride_c, int64_t batch, int precision);

/* embedding: out [N,C] = table[tokens]; backward accumulates dtable [V,C] in token order, no atomics */
int kiln_cuda_embedding_forward(const int64_t *tokens, const float *table, float *out, int64_t N, int64_t C,
                                int64_t V, void *stream);
int kiln_cuda_embedding_backward(const float *dout, const int64_t *tokens, float *dtable, int64_t N, int64_t C,
                                 int64_t V, void *stream);

/* RMSNorm: backward accumulates into dx and dweight; dweight through per-chunk partials (workspace) */
int kiln_cuda_rmsnorm_forward(const float *x, const float *weight, float eps, float *out, float *rstd, int64_t N,
                              int64_t C, void *stream);
int kiln_cuda_rmsnorm_backward_workspace(int64_t N, int64_t C, size_t *bytes);
int kiln_cuda_rmsnorm_backward(const float *dout, const float *x, const float *weight, const float *rstd,
                               float *dx, float *dweight, void *workspace, int64_t N, int64_t C, void *stream);

/* rotary, rotate-half: x [B,T,KV*g,D] (strides in elements, last axis contiguous) -> out [B,KV,T,g,D] */
int kiln_cuda_rope_forward(const float *x, int64_t stride_b, int64_t stride_t, int64_t stride_h, const float *cos,
                           const float *sin, int64_t positions, int64_t position_offset, float *out, int64_t B,
                           int64_t T, int64_t KV, int64_t g, int64_t D, void *stream);
int kiln_cuda_rope_backward(const float *dout, const float *cos, const float *sin, int64_t positions,
                            int64_t position_offset, float *dx, int64_t stride_b, int64_t stride_t,
                            int64_t stride_h, int64_t B, int64_t T, int64_t KV, int64_t g, int64_t D, void *stream);

/* SwiGLU: gate_up [N,2F] (gate then up) -> out [N,F]; backward writes dgate_up */
int kiln_cuda_swiglu_forward(const float *gate_up, float *out, int64_t N, int64_t F, void *stream);
int kiln_cuda_swiglu_backward(const float *dout, const float *gate_up, float *dgate_up, int64_t N, int64_t F,
                              void *stream);

/* causal GQA attention, tiled with an online softmax: q/out [G,T*g,D] (row r is query position
 * past + r / g), k/v [G,S,D], logsumexp [G,T*g]. window > 0: query p sees keys p-window+1..p only
 * (Mistral's and Phi-3's sliding window); 0: every earlier key. Backward writes dq, dk, dv without atomics.
 * tile: 0 for the device's choice (64 rows and keys where its shared memory per block holds them, else 32; one
 * device always takes the same), or 32 or 64 to ask for those tiles (a device short of the memory refuses). */
int kiln_cuda_attention_forward(const float *q, const float *k, const float *v, float *out, float *logsumexp,
                                int64_t G, int64_t T, int64_t g, int64_t S, int64_t D, int64_t past, int64_t window,
                                float scale, int64_t tile, void *stream);
int kiln_cuda_attention_backward(const float *dout, const float *q, const float *k, const float *v,
                                 const float *out, const float *logsumexp, float *dq, float *dk, float *dv,
                                 float *delta, int64_t G, int64_t T, int64_t g, int64_t S, int64_t D, int64_t past,
                                 int64_t window, float scale, int64_t tile, void *stream);
/* the least dynamic shared memory per block those kernels run with at head size D (1..128), with their 32-row
 * tiles: forward (cached decoding too), and backward (the larger of its two kernels); a device whose opt-in limit
 * is below one cannot run it */
int kiln_cuda_attention_shared_bytes(int64_t D, size_t *forward, size_t *backward);
/* the dense algorithm's row work, the products on cuBLAS (kiln_cuda_gemm_strided_batched): scores [G,T*g,S] hold
 * scale * q.k; they become the probabilities in place, 0 where masked, from the row's own logsumexp (written to
 * logsumexp [G,T*g]) or, with from_logsumexp, the saved one. dscores turns dP = dout v^T [G,T*g,S] into
 * dS = p * (dP - delta) * scale in place, delta [G,T*g] = rowsum(dout * out) its workspace. */
int kiln_cuda_attention_probabilities(float *scores, float *logsumexp, int from_logsumexp, int64_t G, int64_t T,
                                      int64_t g, int64_t S, int64_t past, int64_t window, void *stream);
int kiln_cuda_attention_dscores(float *dscores, const float *probabilities, const float *dout, const float *out,
                                float *delta, int64_t G, int64_t T, int64_t g, int64_t S, int64_t D, float scale,
                                void *stream);

/* cross-entropy rows: mode 0 per_row = log p(target) (0 at ignore_index, logits untouched);
 * mode 1 logits -> (softmax - onehot) * grad_scale, per_row = loss (0 and a zero row at ignore_index);
 * mode 2 logits -> (softmax - onehot) * row_scales[n], per_row = loss (ignore_index reads id 0) */
int kiln_cuda_cross_entropy_rows(float *logits, const int64_t *targets, float *per_row, int mode, float grad_scale,
                                 const float *row_scales, int64_t ignore_index, int64_t N, int64_t V, void *stream);
/* the fused linear cross-entropy over hidden [N,C] @ weight [V,C]^T in chunks of `chunk` rows */
int kiln_cuda_fused_linear_cross_entropy(void *blas, const float *hidden, const float *weight,
                                         const int64_t *targets, int64_t N, int64_t C, int64_t V, int64_t chunk,
                                         int mode, float grad_scale, const float *row_scales, int64_t ignore_index,
                                         float *per_row, float *dhidden, float *dhead, float *logits, int precision);

/* NF4 (bitsandbytes layout): element i is in byte i/2, high nibble when i is even; absmax per block */
int kiln_cuda_nf4_dequantize(const uint8_t *packed, const float *absmax, float *out, int64_t start, int64_t count,
                             int64_t block_size, void *stream);
int kiln_cuda_nf4_decode_absmax(const uint8_t *codes, const float *scales, const float *dynamic_map, float offset,
                                float *absmax, int64_t blocks, void *stream);
/* out [N,M] = x [N,K] @ W^T + beta * out, W [M,K] dequantized tile_rows rows at a time into tile */
int kiln_cuda_nf4_linear(void *blas, const float *x, const uint8_t *packed, const float *absmax,
                         int64_t block_size, float *out, float beta, float *tile, int64_t tile_rows, int64_t N,
                         int64_t K, int64_t M, int precision);

/* LoRA: xa = x @ A^T; out += scaling * xa @ B^T. Backward: dB += scaling dout^T xa,
 * dxa = scaling dout B, dA += dxa^T x, dx += dxa A (dx may be NULL) */
int kiln_cuda_lora_forward(void *blas, const float *x, const float *A, const float *B, float scaling, float *xa,
                           float *out, int64_t N, int64_t K, int64_t M, int64_t r, int precision);
int kiln_cuda_lora_backward(void *blas, const float *x, const float *A, const float *B, const float *xa,
                            const float *dout, float scaling, float *dA, float *dB, float *dx, float *dxa, int64_t N,
                            int64_t K, int64_t M, int64_t r, int precision);

/* Adam with the CPU kernel's float32 formula order; gradient norm in a fixed-order two-pass reduction */
int kiln_cuda_adam_update(float *param, const float *grad, float *m, float *v, int64_t n, double learning_rate,
                          double beta1, double beta2, double epsilon, double weight_decay, double bias_correction1,
                          double bias_correction2, void *stream);
int kiln_cuda_sum_squares(const float *x, int64_t n, double *workspace, double *out, void *stream);
int kiln_cuda_global_norm(const double *sums, int64_t count, double *norm, void *stream);
int kiln_cuda_scale(float *x, int64_t n, float factor, void *stream);

#ifdef __cplusplus
}
#endif

#endif
