// The row and elementwise kernels: embedding, RMSNorm, rotary, SwiGLU, cross-entropy rows, NF4, Adam,
// gradient norm. No atomics anywhere: every output element has one owner thread and every reduction
// runs in a fixed order (a fixed grid, a fixed tree), so one build on one device gives the same bits
// every run. Built with --fmad=false so a*b+c rounds twice, as the CPU kernels (-ffp-contract=off) do.
// Dimension letters as in kiln_cuda.h.
#include <cmath>

#include "kiln_cuda_internal.h"

namespace {

// bitsandbytes get_4bit_type("nf4"), the list in DESIGN.md
__constant__ float kNf4Code[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

// the fixed-shape tree sum of `shared` [KILN_THREADS] into shared[0]; every thread must call it
template <typename T>
__device__ void block_sum(T *shared) {
    for (int width = KILN_THREADS / 2; width > 0; width >>= 1) {
        __syncthreads();
        if ((int)threadIdx.x < width) shared[threadIdx.x] = shared[threadIdx.x] + shared[threadIdx.x + width];
    }
    __syncthreads();
}

__device__ void block_max(float *shared) {
    for (int width = KILN_THREADS / 2; width > 0; width >>= 1) {
        __syncthreads();
        if ((int)threadIdx.x < width) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + width]);
    }
    __syncthreads();
}

__global__ void embedding_forward_kernel(const int64_t *tokens, const float *table, float *out, int64_t N,
                                         int64_t C, int64_t V) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N * C; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t n = i / C, c = i % C, t = tokens[n];
        out[i] = (t >= 0 && t < V) ? table[t * C + c] : 0.0f;
    }
}

// Thread (column c, owner y) owns dtable[t, c] for every t with t % gridDim.y == y and adds the rows of
// dout in token order: one writer per element, the CPU kernel's order, so the bits match it.
__global__ void embedding_backward_kernel(const float *dout, const int64_t *tokens, float *dtable, int64_t N,
                                          int64_t C, int64_t V) {
    int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int64_t n = 0; n < N; n++) {
        int64_t t = tokens[n];
        if (t < 0 || t >= V || t % gridDim.y != blockIdx.y) continue;
        dtable[t * C + c] = dtable[t * C + c] + dout[n * C + c];
    }
}

__global__ void rmsnorm_forward_kernel(const float *x, const float *weight, double eps, float *out, float *rstd,
                                       int64_t C) {
    __shared__ double partial[KILN_THREADS];
    const float *row = x + blockIdx.x * C;
    double sum = 0.0;
    for (int64_t c = threadIdx.x; c < C; c += KILN_THREADS) sum += (double)row[c] * (double)row[c];
    partial[threadIdx.x] = sum;
    block_sum(partial);
    float r = (float)(1.0 / sqrt(partial[0] / (double)C + eps));
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
    for (int64_t c = threadIdx.x; c < C; c += KILN_THREADS) out[blockIdx.x * C + c] = (row[c] * r) * weight[c];
}

// dx += rstd * dnormed - x * (rstd^3 * mean(dnormed * x)), dnormed = dout * weight; one block per row
__global__ void rmsnorm_backward_dx_kernel(const float *dout, const float *x, const float *weight, const float *rstd,
                                           float *dx, int64_t C) {
    __shared__ double partial[KILN_THREADS];
    int64_t base = blockIdx.x * C;
    double sum = 0.0;
    for (int64_t c = threadIdx.x; c < C; c += KILN_THREADS)
        sum += (double)((dout[base + c] * weight[c]) * x[base + c]);
    partial[threadIdx.x] = sum;
    block_sum(partial);
    float dot = (float)(partial[0] / (double)C);
    float r = rstd[blockIdx.x];
    float coefficient = ((r * r) * r) * dot;
    for (int64_t c = threadIdx.x; c < C; c += KILN_THREADS) {
        float dnormed = dout[base + c] * weight[c];
        dx[base + c] = dx[base + c] + (r * dnormed - x[base + c] * coefficient);
    }
}

// partial[chunk, c] = sum over the chunk's rows, in order, of dout * (x * rstd); the chunk is blockIdx.x (up to
// 2^31 - 1 of them: Qwen3's per-head norms pass the 65535 of grid.y), the columns' block blockIdx.y
__global__ void rmsnorm_backward_partial_kernel(const float *dout, const float *x, const float *rstd,
                                                double *partial, int64_t N, int64_t C) {
    int64_t c = blockIdx.y * (int64_t)blockDim.x + threadIdx.x;
    if (c >= C) return;
    int64_t start = blockIdx.x * (int64_t)KILN_RMSNORM_CHUNK_ROWS;
    int64_t end = kiln_tile_end(start, KILN_RMSNORM_CHUNK_ROWS, N);
    double sum = 0.0;
    for (int64_t n = start; n < end; n++) sum += (double)(dout[n * C + c] * (x[n * C + c] * rstd[n]));
    partial[blockIdx.x * C + c] = sum;
}

__global__ void rmsnorm_backward_weight_kernel(const double *partial, float *dweight, int64_t chunks, int64_t C) {
    int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (c >= C) return;
    double sum = 0.0;
    for (int64_t k = 0; k < chunks; k++) sum += partial[k * C + c];
    dweight[c] = dweight[c] + (float)sum;
}

// one thread per (b, t, head, i < D/2): the pair (i, i + D/2) rotated by position offset + t
__global__ void rope_forward_kernel(const float *x, int64_t sb, int64_t st, int64_t sh, const float *cos,
                                    const float *sin, int64_t offset, float *out, int64_t B, int64_t T, int64_t KV,
                                    int64_t g, int64_t D) {
    int64_t half = D / 2, H = KV * g, total = B * T * H * half;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t d = i % half, h = (i / half) % H, t = (i / (half * H)) % T, b = i / (half * H * T);
        const float *src = x + kiln_strided_index(b, t, h, 0, sb, st, sh);
        float x1 = src[d], x2 = src[d + half];
        float c = cos[(offset + t) * half + d], s = sin[(offset + t) * half + d];
        out[kiln_rope_out_index(b, t, h, d, T, KV, g, D)] = x1 * c - x2 * s;
        out[kiln_rope_out_index(b, t, h, d + half, T, KV, g, D)] = x2 * c + x1 * s;
    }
}

__global__ void rope_backward_kernel(const float *dout, const float *cos, const float *sin, int64_t offset, float *dx,
                                     int64_t sb, int64_t st, int64_t sh, int64_t B, int64_t T, int64_t KV, int64_t g,
                                     int64_t D) {
    int64_t half = D / 2, H = KV * g, total = B * T * H * half;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t d = i % half, h = (i / half) % H, t = (i / (half * H)) % T, b = i / (half * H * T);
        float g1 = dout[kiln_rope_out_index(b, t, h, d, T, KV, g, D)];
        float g2 = dout[kiln_rope_out_index(b, t, h, d + half, T, KV, g, D)];
        float c = cos[(offset + t) * half + d], s = sin[(offset + t) * half + d];
        float *dst = dx + kiln_strided_index(b, t, h, 0, sb, st, sh);
        dst[d] = g1 * c + g2 * s;
        dst[d + half] = g2 * c - g1 * s;
    }
}

__global__ void swiglu_forward_kernel(const float *gate_up, float *out, int64_t N, int64_t F) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N * F; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t n = i / F, f = i % F;
        float gate = gate_up[n * 2 * F + f], up = gate_up[n * 2 * F + F + f];
        out[i] = gate / (1.0f + expf(-gate)) * up;
    }
}

__global__ void swiglu_backward_kernel(const float *dout, const float *gate_up, float *dgate_up, int64_t N,
                                       int64_t F) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N * F; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t n = i / F, f = i % F;
        float gate = gate_up[n * 2 * F + f], up = gate_up[n * 2 * F + F + f];
        float sig = 1.0f / (1.0f + expf(-gate));
        dgate_up[n * 2 * F + f] = dout[i] * up * sig * (1.0f + gate * (1.0f - sig));
        dgate_up[n * 2 * F + F + f] = dout[i] * gate * sig;
    }
}

// one block per row: max, then sum of exp in double, then (mode > 0) the gradient in place
__global__ void cross_entropy_rows_kernel(float *logits, const int64_t *targets, float *per_row, int mode,
                                          float grad_scale, const float *row_scales, int64_t ignore_index,
                                          int64_t V) {
    __shared__ float maxima[KILN_THREADS];
    __shared__ double sums[KILN_THREADS];
    float *row = logits + blockIdx.x * V;
    int64_t target = targets[blockIdx.x];
    bool ignored = target == ignore_index;
    if (ignored && mode == 1) {  // no loss and a zero gradient row
        for (int64_t j = threadIdx.x; j < V; j += KILN_THREADS) row[j] = 0.0f;
        if (threadIdx.x == 0) per_row[blockIdx.x] = 0.0f;
        return;
    }
    int64_t safe = (ignored || target < 0 || target >= V) ? 0 : target;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += KILN_THREADS) m = fmaxf(m, row[j]);
    maxima[threadIdx.x] = m;
    block_max(maxima);
    m = maxima[0];
    double sum = 0.0;
    for (int64_t j = threadIdx.x; j < V; j += KILN_THREADS) sum += (double)expf(row[j] - m);
    sums[threadIdx.x] = sum;
    block_sum(sums);
    double lse = log(sums[0]) + (double)m;
    float target_logit = row[safe];
    __syncthreads();  // every thread has read row[safe] before any overwrites it
    if (mode == 0) {
        if (threadIdx.x == 0) per_row[blockIdx.x] = ignored ? 0.0f : (float)((double)target_logit - lse);
        return;
    }
    if (threadIdx.x == 0) per_row[blockIdx.x] = (float)(lse - (double)target_logit);
    float scale = mode == 1 ? grad_scale : row_scales[blockIdx.x];
    for (int64_t j = threadIdx.x; j < V; j += KILN_THREADS) {
        double p = exp((double)row[j] - lse) - (j == safe ? 1.0 : 0.0);
        row[j] = (float)(p * (double)scale);
    }
}

__global__ void nf4_dequantize_kernel(const uint8_t *packed, const float *absmax, float *out, int64_t start,
                                      int64_t count, int64_t block_size) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t index = start + i;
        int nibble = kiln_nf4_nibble(packed[kiln_nf4_byte(index)], index);
        out[i] = kNf4Code[nibble] * absmax[kiln_nf4_block(index, block_size)];
    }
}

// absmax[b] = dynamic_map[codes[b]] * scales[b / 256] + offset (native_ext.nf4.reference_dequantize_double)
__global__ void nf4_decode_absmax_kernel(const uint8_t *codes, const float *scales, const float *dynamic_map,
                                         float offset, float *absmax, int64_t blocks) {
    for (int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; b < blocks; b += (int64_t)gridDim.x * blockDim.x)
        absmax[b] = dynamic_map[codes[b]] * scales[kiln_absmax_scale_index(b)] + offset;
}

// kiln_adam_update of native_ext/kiln_kernels.h, operation for operation
__global__ void adam_kernel(float *param, const float *grad, float *m, float *v, int64_t n, float b1, float b2,
                            float omb1, float omb2, float wd, int decay, float step_size, float bc2_sqrt, float eps) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float g = grad[i];
        if (decay) g = g + wd * param[i];
        float mi = m[i] * b1;
        mi = mi + omb1 * g;
        float vi = v[i] * b2;
        vi = vi + omb2 * (g * g);
        m[i] = mi;
        v[i] = vi;
        param[i] = param[i] - step_size * (mi / (sqrtf(vi) / bc2_sqrt + eps));
    }
}

// pass one: KILN_CUDA_NORM_BLOCKS blocks (a fixed grid, whatever the device) of strided double sums
__global__ void sum_squares_partial_kernel(const float *x, int64_t n, double *workspace) {
    __shared__ double partial[KILN_THREADS];
    double sum = 0.0;
    for (int64_t i = blockIdx.x * (int64_t)KILN_THREADS + threadIdx.x; i < n;
         i += (int64_t)KILN_CUDA_NORM_BLOCKS * KILN_THREADS)
        sum += (double)x[i] * (double)x[i];
    partial[threadIdx.x] = sum;
    block_sum(partial);
    if (threadIdx.x == 0) workspace[blockIdx.x] = partial[0];
}

// pass two: one block folds the partials in a fixed tree
__global__ void sum_squares_final_kernel(const double *workspace, double *out) {
    __shared__ double partial[KILN_THREADS];
    double sum = 0.0;
    for (int i = threadIdx.x; i < KILN_CUDA_NORM_BLOCKS; i += KILN_THREADS) sum += workspace[i];
    partial[threadIdx.x] = sum;
    block_sum(partial);
    if (threadIdx.x == 0) *out = partial[0];
}

__global__ void global_norm_kernel(const double *sums, int64_t count, double *norm) {
    double total = 0.0;
    for (int64_t i = 0; i < count; i++) total += sums[i];
    *norm = sqrt(total);
}

__global__ void scale_kernel(float *x, int64_t n, float factor) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = x[i] * factor;
}

}  // namespace

extern "C" {

int kiln_cuda_embedding_forward(const int64_t *tokens, const float *table, float *out, int64_t N, int64_t C,
                                int64_t V, void *stream) {
    KILN_REQUIRE(N >= 0 && C > 0 && V > 0, "N must be >= 0, C and V positive");
    if (N == 0) return 0;
    KILN_LAUNCH(embedding_forward_kernel, kiln_grid(N * C, KILN_THREADS), KILN_THREADS, 0, kiln_stream(stream))(
        tokens, table, out, N, C, V);
    KILN_LAUNCHED("embedding_forward_kernel");
    return 0;
}

int kiln_cuda_embedding_backward(const float *dout, const int64_t *tokens, float *dtable, int64_t N, int64_t C,
                                 int64_t V, void *stream) {
    KILN_REQUIRE(N >= 0 && C > 0 && V > 0, "N must be >= 0, C and V positive");
    if (N == 0) return 0;
    dim3 grid((unsigned)kiln_ceil_div(C, KILN_THREADS), (unsigned)(V < 64 ? V : 64));
    KILN_LAUNCH(embedding_backward_kernel, grid, KILN_THREADS, 0, kiln_stream(stream))(dout, tokens, dtable, N, C, V);
    KILN_LAUNCHED("embedding_backward_kernel");
    return 0;
}

int kiln_cuda_rmsnorm_forward(const float *x, const float *weight, float eps, float *out, float *rstd, int64_t N,
                              int64_t C, void *stream) {
    KILN_REQUIRE(N >= 0 && C > 0 && N <= 0x7fffffff, "N must be in [0, 2^31), C positive");
    if (N == 0) return 0;
    KILN_LAUNCH(rmsnorm_forward_kernel, (unsigned)N, KILN_THREADS, 0, kiln_stream(stream))(x, weight, (double)eps, out, rstd, C);
    KILN_LAUNCHED("rmsnorm_forward_kernel");
    return 0;
}

int kiln_cuda_rmsnorm_backward_workspace(int64_t N, int64_t C, size_t *bytes) {
    KILN_REQUIRE(N >= 0 && C > 0, "N must be >= 0, C positive");
    *bytes = (size_t)(kiln_ceil_div(N, KILN_RMSNORM_CHUNK_ROWS) * C) * sizeof(double);
    return 0;
}

int kiln_cuda_rmsnorm_backward(const float *dout, const float *x, const float *weight, const float *rstd, float *dx,
                               float *dweight, void *workspace, int64_t N, int64_t C, void *stream) {
    KILN_REQUIRE(N >= 0 && C > 0 && N <= 0x7fffffff, "N must be in [0, 2^31), C positive");
    KILN_REQUIRE(kiln_ceil_div(C, KILN_THREADS) <= 65535, "C must be at most 65535 * 256 (a grid's y dimension)");
    KILN_REQUIRE(workspace || N == 0, "rmsnorm_backward needs its workspace (kiln_cuda_rmsnorm_backward_workspace)");
    if (N == 0) return 0;
    cudaStream_t s = kiln_stream(stream);
    KILN_LAUNCH(rmsnorm_backward_dx_kernel, (unsigned)N, KILN_THREADS, 0, s)(dout, x, weight, rstd, dx, C);
    KILN_LAUNCHED("rmsnorm_backward_dx_kernel");
    int64_t chunks = kiln_ceil_div(N, KILN_RMSNORM_CHUNK_ROWS);
    dim3 grid((unsigned)chunks, (unsigned)kiln_ceil_div(C, KILN_THREADS));
    KILN_LAUNCH(rmsnorm_backward_partial_kernel, grid, KILN_THREADS, 0, s)(dout, x, rstd, (double *)workspace, N, C);
    KILN_LAUNCHED("rmsnorm_backward_partial_kernel");
    KILN_LAUNCH(rmsnorm_backward_weight_kernel, (unsigned)kiln_ceil_div(C, KILN_THREADS), KILN_THREADS, 0, s)(
        (const double *)workspace, dweight, chunks, C);
    KILN_LAUNCHED("rmsnorm_backward_weight_kernel");
    return 0;
}

static int kiln_rope_check(int64_t positions, int64_t offset, int64_t B, int64_t T, int64_t KV, int64_t g,
                           int64_t D) {
    KILN_REQUIRE(B >= 0 && T >= 0 && KV > 0 && g > 0, "B, T must be >= 0, KV and g positive");
    KILN_REQUIRE(D > 0 && D % 2 == 0, "the head size must be even for rotary positions");
    KILN_REQUIRE(offset >= 0 && offset + T <= positions, "positions exceed the rotary table (maximum_context)");
    return 0;
}

int kiln_cuda_rope_forward(const float *x, int64_t stride_b, int64_t stride_t, int64_t stride_h, const float *cos,
                           const float *sin, int64_t positions, int64_t position_offset, float *out, int64_t B,
                           int64_t T, int64_t KV, int64_t g, int64_t D, void *stream) {
    KILN_TRY(kiln_rope_check(positions, position_offset, B, T, KV, g, D));
    if (B * T == 0) return 0;
    KILN_LAUNCH(rope_forward_kernel, kiln_grid(B * T * KV * g * D / 2, KILN_THREADS), KILN_THREADS, 0, kiln_stream(stream))(
        x, stride_b, stride_t, stride_h, cos, sin, position_offset, out, B, T, KV, g, D);
    KILN_LAUNCHED("rope_forward_kernel");
    return 0;
}

int kiln_cuda_rope_backward(const float *dout, const float *cos, const float *sin, int64_t positions,
                            int64_t position_offset, float *dx, int64_t stride_b, int64_t stride_t, int64_t stride_h,
                            int64_t B, int64_t T, int64_t KV, int64_t g, int64_t D, void *stream) {
    KILN_TRY(kiln_rope_check(positions, position_offset, B, T, KV, g, D));
    if (B * T == 0) return 0;
    KILN_LAUNCH(rope_backward_kernel, kiln_grid(B * T * KV * g * D / 2, KILN_THREADS), KILN_THREADS, 0, kiln_stream(stream))(
        dout, cos, sin, position_offset, dx, stride_b, stride_t, stride_h, B, T, KV, g, D);
    KILN_LAUNCHED("rope_backward_kernel");
    return 0;
}

int kiln_cuda_swiglu_forward(const float *gate_up, float *out, int64_t N, int64_t F, void *stream) {
    KILN_REQUIRE(N >= 0 && F > 0, "N must be >= 0, F positive");
    if (N == 0) return 0;
    KILN_LAUNCH(swiglu_forward_kernel, kiln_grid(N * F, KILN_THREADS), KILN_THREADS, 0, kiln_stream(stream))(gate_up, out, N, F);
    KILN_LAUNCHED("swiglu_forward_kernel");
    return 0;
}

int kiln_cuda_swiglu_backward(const float *dout, const float *gate_up, float *dgate_up, int64_t N, int64_t F,
                              void *stream) {
    KILN_REQUIRE(N >= 0 && F > 0, "N must be >= 0, F positive");
    if (N == 0) return 0;
    KILN_LAUNCH(swiglu_backward_kernel, kiln_grid(N * F, KILN_THREADS), KILN_THREADS, 0, kiln_stream(stream))(
        dout, gate_up, dgate_up, N, F);
    KILN_LAUNCHED("swiglu_backward_kernel");
    return 0;
}

int kiln_cuda_cross_entropy_rows(float *logits, const int64_t *targets, float *per_row, int mode, float grad_scale,
                                 const float *row_scales, int64_t ignore_index, int64_t N, int64_t V, void *stream) {
    KILN_REQUIRE(mode >= 0 && mode <= 2, "mode must be 0 (log p), 1 (grad_scale) or 2 (row_scales)");
    KILN_REQUIRE(mode != 2 || row_scales, "mode 2 needs row_scales");
    KILN_REQUIRE(N >= 0 && N <= 0x7fffffff && V > 0, "N must be in [0, 2^31), V positive");
    if (N == 0) return 0;
    KILN_LAUNCH(cross_entropy_rows_kernel, (unsigned)N, KILN_THREADS, 0, kiln_stream(stream))(
        logits, targets, per_row, mode, grad_scale, row_scales, ignore_index, V);
    KILN_LAUNCHED("cross_entropy_rows_kernel");
    return 0;
}

int kiln_cuda_nf4_dequantize(const uint8_t *packed, const float *absmax, float *out, int64_t start, int64_t count,
                             int64_t block_size, void *stream) {
    KILN_REQUIRE(start >= 0 && count >= 0, "start and count must be >= 0");
    KILN_REQUIRE(block_size > 0 && block_size % 2 == 0, "block_size must be a positive even number");
    if (count == 0) return 0;
    KILN_LAUNCH(nf4_dequantize_kernel, kiln_grid(count, KILN_THREADS), KILN_THREADS, 0, kiln_stream(stream))(
        packed, absmax, out, start, count, block_size);
    KILN_LAUNCHED("nf4_dequantize_kernel");
    return 0;
}

int kiln_cuda_nf4_decode_absmax(const uint8_t *codes, const float *scales, const float *dynamic_map, float offset,
                                float *absmax, int64_t blocks, void *stream) {
    KILN_REQUIRE(blocks >= 0, "blocks must be >= 0");
    if (blocks == 0) return 0;
    KILN_LAUNCH(nf4_decode_absmax_kernel, kiln_grid(blocks, KILN_THREADS), KILN_THREADS, 0, kiln_stream(stream))(
        codes, scales, dynamic_map, offset, absmax, blocks);
    KILN_LAUNCHED("nf4_decode_absmax_kernel");
    return 0;
}

int kiln_cuda_adam_update(float *param, const float *grad, float *m, float *v, int64_t n, double learning_rate,
                          double beta1, double beta2, double epsilon, double weight_decay, double bias_correction1,
                          double bias_correction2, void *stream) {
    KILN_REQUIRE(n >= 0, "n must be >= 0");
    KILN_REQUIRE(bias_correction1 > 0.0 && bias_correction2 > 0.0, "bias corrections must be positive");
    if (n == 0) return 0;
    // the scalars exactly as native_ext/_kernels.pyx rounds them
    KILN_LAUNCH(adam_kernel, kiln_grid(n, KILN_THREADS), KILN_THREADS, 0, kiln_stream(stream))(
        param, grad, m, v, n, (float)beta1, (float)beta2, (float)(1.0 - beta1), (float)(1.0 - beta2),
        (float)weight_decay, weight_decay != 0.0, (float)(learning_rate / bias_correction1),
        (float)sqrt(bias_correction2), (float)epsilon);
    KILN_LAUNCHED("adam_kernel");
    return 0;
}

int kiln_cuda_sum_squares(const float *x, int64_t n, double *workspace, double *out, void *stream) {
    KILN_REQUIRE(n >= 0 && workspace && out, "n must be >= 0, with a workspace and an output");
    cudaStream_t s = kiln_stream(stream);
    KILN_LAUNCH(sum_squares_partial_kernel, KILN_CUDA_NORM_BLOCKS, KILN_THREADS, 0, s)(x, n, workspace);
    KILN_LAUNCHED("sum_squares_partial_kernel");
    KILN_LAUNCH(sum_squares_final_kernel, 1, KILN_THREADS, 0, s)(workspace, out);
    KILN_LAUNCHED("sum_squares_final_kernel");
    return 0;
}

int kiln_cuda_global_norm(const double *sums, int64_t count, double *norm, void *stream) {
    KILN_REQUIRE(count >= 0 && norm, "count must be >= 0, with an output");
    KILN_LAUNCH(global_norm_kernel, 1, 1, 0, kiln_stream(stream))(sums, count, norm);
    KILN_LAUNCHED("global_norm_kernel");
    return 0;
}

int kiln_cuda_scale(float *x, int64_t n, float factor, void *stream) {
    KILN_REQUIRE(n >= 0, "n must be >= 0");
    if (n == 0) return 0;
    KILN_LAUNCH(scale_kernel, kiln_grid(n, KILN_THREADS), KILN_THREADS, 0, kiln_stream(stream))(x, n, factor);
    KILN_LAUNCHED("scale_kernel");
    return 0;
}

}  // extern "C"
