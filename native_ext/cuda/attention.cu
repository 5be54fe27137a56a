// Causal grouped-query attention, tiled with an online softmax (trainer/attention.py's tiled algorithm).
// Layout: q/out/dq [G,R,D] with R = T*g (row r is query position past + r / g), k/v/dk/dv [G,S,D],
// logsumexp/delta [G,R]. Forward: one CTA per (row tile, group) walks the key tiles it can see.
// Backward, without atomics: delta = rowsum(dout * out); then one CTA per (key tile, group) owns dK and
// dV of its keys and walks the row tiles that can see them; then one CTA per (row tile, group) owns dQ
// and walks the key tiles. Every sum runs in a fixed order, so the result is the same every run.
// Tiles live in dynamic shared memory with a row pitch of D + 1 floats (no bank conflicts on dots).
#include <cmath>

#include "kiln_cuda_internal.h"

namespace {

constexpr int kRows = 32;      // query rows per tile
constexpr int kKeys = 32;      // keys per tile
constexpr int kThreads = 128;

__device__ void load_tile(float *tile, const float *source, int64_t first, int64_t count, int rows, int D,
                          int pitch) {
    for (int i = threadIdx.x; i < rows * D; i += kThreads) {
        int row = i / D, d = i % D;
        tile[row * pitch + d] = row < count ? source[(first + row) * D + d] : 0.0f;
    }
}

__device__ float dot(const float *a, const float *b, int D) {
    float sum = 0.0f;
    for (int d = 0; d < D; d++) sum = sum + a[d] * b[d];
    return sum;
}

__global__ void attention_forward_kernel(const float *q, const float *k, const float *v, float *out,
                                         float *logsumexp, int64_t T, int64_t g, int64_t S, int D, int64_t past,
                                         int64_t window, float scale) {
    KILN_DYNAMIC_SHARED(float, shared);
    const int pitch = D + 1;
    float *sq = shared, *sk = sq + kRows * pitch, *sv = sk + kKeys * pitch, *acc = sv + kKeys * pitch;
    float *scores = acc + kRows * pitch, *running_max = scores + kRows * kKeys;
    float *running_sum = running_max + kRows, *alpha = running_sum + kRows;
    const int64_t R = T * g, group = blockIdx.y, r0 = (int64_t)blockIdx.x * kRows;
    const int64_t r1 = kiln_tile_end(r0, kRows, R);
    const int rows = (int)(r1 - r0);
    q += group * R * D;
    k += group * S * D;
    v += group * S * D;
    load_tile(sq, q, r0, rows, kRows, D, pitch);
    for (int i = threadIdx.x; i < kRows * D; i += kThreads) acc[(i / D) * pitch + i % D] = 0.0f;
    if (threadIdx.x < kRows) {
        running_max[threadIdx.x] = -INFINITY;
        running_sum[threadIdx.x] = 0.0f;
    }
    const int64_t last_key = kiln_last_key(S, r1, g, past);
    for (int64_t ks = 0; ks < last_key; ks += kKeys) {
        const int keys = (int)(kiln_tile_end(ks, kKeys, S) - ks);
        __syncthreads();
        load_tile(sk, k, ks, keys, kKeys, D, pitch);
        load_tile(sv, v, ks, keys, kKeys, D, pitch);
        __syncthreads();
        for (int i = threadIdx.x; i < kRows * kKeys; i += kThreads) {
            int row = i / kKeys, key = i % kKeys;
            bool visible = row < rows && key < keys &&
                           kiln_attention_visible(ks + key, kiln_query_position(r0 + row, g, past), window);
            scores[i] = visible ? dot(sq + row * pitch, sk + key * pitch, D) * scale : -INFINITY;
        }
        __syncthreads();
        if (threadIdx.x < kRows) {  // the online softmax of one row (flash_block_forward's arithmetic)
            const int row = threadIdx.x;
            float *z = scores + row * kKeys;
            float block_max = -INFINITY;
            for (int key = 0; key < kKeys; key++) block_max = fmaxf(block_max, z[key]);
            float old_max = running_max[row], new_max = fmaxf(old_max, block_max);
            float safe_max = new_max == -INFINITY ? 0.0f : new_max;
            float a = old_max == -INFINITY ? 0.0f : expf(old_max - safe_max);
            if (new_max == -INFINITY) a = 1.0f;
            float block_sum = 0.0f;
            for (int key = 0; key < kKeys; key++) {
                float p = z[key] == -INFINITY ? 0.0f : expf(z[key] - safe_max);
                z[key] = p;
                block_sum = block_sum + p;
            }
            running_sum[row] = running_sum[row] * a + block_sum;
            running_max[row] = new_max;
            alpha[row] = a;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < kRows * D; i += kThreads) {
            int row = i / D, d = i % D;
            float pv = 0.0f;
            for (int key = 0; key < keys; key++) pv = pv + scores[row * kKeys + key] * sv[key * pitch + d];
            acc[row * pitch + d] = acc[row * pitch + d] * alpha[row] + pv;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * D; i += kThreads) {
        int row = i / D, d = i % D;
        out[group * R * D + (r0 + row) * D + d] = acc[row * pitch + d] / running_sum[row];
    }
    if ((int)threadIdx.x < rows)
        logsumexp[group * R + r0 + threadIdx.x] = running_max[threadIdx.x] + logf(running_sum[threadIdx.x]);
}

__global__ void attention_delta_kernel(const float *dout, const float *out, float *delta, int64_t rows, int D) {
    for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows; r += (int64_t)gridDim.x * blockDim.x)
        delta[r] = dot(dout + r * D, out + r * D, D);
}

// p = exp(scale * q.k - lse) where visible; ds = p * (dout.v - delta) * scale (flash_block_backward)
__device__ void probabilities(const float *sq, const float *sdo, const float *sk, const float *sv,
                              const float *lse, const float *delta, float *p, float *ds, int rows, int keys,
                              int64_t r0, int64_t ks, int64_t g, int64_t past, int64_t window, int D, int pitch,
                              float scale) {
    for (int i = threadIdx.x; i < kRows * kKeys; i += kThreads) {
        int row = i / kKeys, key = i % kKeys;
        bool visible = row < rows && key < keys &&
                       kiln_attention_visible(ks + key, kiln_query_position(r0 + row, g, past), window);
        float prob = visible ? expf(dot(sq + row * pitch, sk + key * pitch, D) * scale - lse[row]) : 0.0f;
        float dprob = visible ? dot(sdo + row * pitch, sv + key * pitch, D) : 0.0f;
        p[i] = prob;
        ds[i] = prob * (dprob - delta[row]) * scale;
    }
}

__device__ void load_rows(float *values, const float *source, int64_t first, int count) {
    if (threadIdx.x < kRows) values[threadIdx.x] = (int)threadIdx.x < count ? source[first + threadIdx.x] : 0.0f;
}

__global__ void attention_dkdv_kernel(const float *dout, const float *q, const float *k, const float *v,
                                      const float *logsumexp, const float *delta, float *dk, float *dv, int64_t T,
                                      int64_t g, int64_t S, int D, int64_t past, int64_t window, float scale) {
    KILN_DYNAMIC_SHARED(float, shared);
    const int pitch = D + 1;
    float *sk = shared, *sv = sk + kKeys * pitch, *sdk = sv + kKeys * pitch, *sdv = sdk + kKeys * pitch;
    float *sq = sdv + kKeys * pitch, *sdo = sq + kRows * pitch, *p = sdo + kRows * pitch, *ds = p + kRows * kKeys;
    float *lse = ds + kRows * kKeys, *sdelta = lse + kRows;
    const int64_t R = T * g, group = blockIdx.y, ks = (int64_t)blockIdx.x * kKeys;
    const int keys = (int)(kiln_tile_end(ks, kKeys, S) - ks);
    q += group * R * D;
    dout += group * R * D;
    logsumexp += group * R;
    delta += group * R;
    load_tile(sk, k + group * S * D, ks, keys, kKeys, D, pitch);
    load_tile(sv, v + group * S * D, ks, keys, kKeys, D, pitch);
    for (int i = threadIdx.x; i < kKeys * D; i += kThreads) {
        sdk[(i / D) * pitch + i % D] = 0.0f;
        sdv[(i / D) * pitch + i % D] = 0.0f;
    }
    const int64_t first = (kiln_first_row(ks, g, past) / kRows) * kRows;
    for (int64_t r0 = first; r0 < R; r0 += kRows) {
        const int rows = (int)(kiln_tile_end(r0, kRows, R) - r0);
        __syncthreads();
        load_tile(sq, q, r0, rows, kRows, D, pitch);
        load_tile(sdo, dout, r0, rows, kRows, D, pitch);
        load_rows(lse, logsumexp, r0, rows);
        load_rows(sdelta, delta, r0, rows);
        __syncthreads();
        probabilities(sq, sdo, sk, sv, lse, sdelta, p, ds, rows, keys, r0, ks, g, past, window, D, pitch, scale);
        __syncthreads();
        for (int i = threadIdx.x; i < kKeys * D; i += kThreads) {
            int key = i / D, d = i % D;
            float pv = 0.0f, sk_sum = 0.0f;
            for (int row = 0; row < rows; row++) {
                pv = pv + p[row * kKeys + key] * sdo[row * pitch + d];
                sk_sum = sk_sum + ds[row * kKeys + key] * sq[row * pitch + d];
            }
            sdv[key * pitch + d] = sdv[key * pitch + d] + pv;
            sdk[key * pitch + d] = sdk[key * pitch + d] + sk_sum;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < keys * D; i += kThreads) {
        int key = i / D, d = i % D;
        dk[group * S * D + (ks + key) * D + d] = sdk[key * pitch + d];
        dv[group * S * D + (ks + key) * D + d] = sdv[key * pitch + d];
    }
}

__global__ void attention_dq_kernel(const float *dout, const float *q, const float *k, const float *v,
                                    const float *logsumexp, const float *delta, float *dq, int64_t T, int64_t g,
                                    int64_t S, int D, int64_t past, int64_t window, float scale) {
    KILN_DYNAMIC_SHARED(float, shared);
    const int pitch = D + 1;
    float *sq = shared, *sdo = sq + kRows * pitch, *sdq = sdo + kRows * pitch, *sk = sdq + kRows * pitch;
    float *sv = sk + kKeys * pitch, *p = sv + kKeys * pitch, *ds = p + kRows * kKeys;
    float *lse = ds + kRows * kKeys, *sdelta = lse + kRows;
    const int64_t R = T * g, group = blockIdx.y, r0 = (int64_t)blockIdx.x * kRows;
    const int64_t r1 = kiln_tile_end(r0, kRows, R);
    const int rows = (int)(r1 - r0);
    k += group * S * D;
    v += group * S * D;
    load_tile(sq, q + group * R * D, r0, rows, kRows, D, pitch);
    load_tile(sdo, dout + group * R * D, r0, rows, kRows, D, pitch);
    load_rows(lse, logsumexp + group * R, r0, rows);
    load_rows(sdelta, delta + group * R, r0, rows);
    for (int i = threadIdx.x; i < kRows * D; i += kThreads) sdq[(i / D) * pitch + i % D] = 0.0f;
    const int64_t last_key = kiln_last_key(S, r1, g, past);
    for (int64_t ks = 0; ks < last_key; ks += kKeys) {
        const int keys = (int)(kiln_tile_end(ks, kKeys, S) - ks);
        __syncthreads();
        load_tile(sk, k, ks, keys, kKeys, D, pitch);
        load_tile(sv, v, ks, keys, kKeys, D, pitch);
        __syncthreads();
        probabilities(sq, sdo, sk, sv, lse, sdelta, p, ds, rows, keys, r0, ks, g, past, window, D, pitch, scale);
        __syncthreads();
        for (int i = threadIdx.x; i < kRows * D; i += kThreads) {
            int row = i / D, d = i % D;
            float sum = 0.0f;
            for (int key = 0; key < keys; key++) sum = sum + ds[row * kKeys + key] * sk[key * pitch + d];
            sdq[row * pitch + d] = sdq[row * pitch + d] + sum;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * D; i += kThreads)
        dq[group * R * D + (r0 + i / D) * D + i % D] = sdq[(i / D) * pitch + i % D];
}

size_t forward_shared(int D) { return sizeof(float) * ((2 * kRows + 2 * kKeys) * (D + 1) + kRows * kKeys + 3 * kRows); }
size_t dkdv_shared(int D) { return sizeof(float) * ((2 * kRows + 4 * kKeys) * (D + 1) + 2 * kRows * kKeys + 2 * kRows); }
size_t dq_shared(int D) { return sizeof(float) * ((3 * kRows + 2 * kKeys) * (D + 1) + 2 * kRows * kKeys + 2 * kRows); }

int check_shape(int64_t G, int64_t T, int64_t g, int64_t S, int64_t D, int64_t past) {
    KILN_REQUIRE(G >= 0 && T >= 0 && g > 0 && S >= 0 && past >= 0, "G, T, S, past must be >= 0 and g positive");
    KILN_REQUIRE(D > 0 && D <= KILN_CUDA_ATTENTION_MAX_HEAD, "the head size must be in 1..128");
    KILN_REQUIRE(past + T <= S, "every query position needs its key: past + T must be <= S");
    KILN_REQUIRE(G <= 65535 && kiln_ceil_div(T * g, kRows) <= 0x7fffffff && kiln_ceil_div(S, kKeys) <= 0x7fffffff,
                 "too many head groups (G <= 65535)");
    return 0;
}

template <typename Kernel>
int allow_shared(Kernel kernel, size_t bytes) {
    KILN_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    return 0;
}

}  // namespace

extern "C" {

int kiln_cuda_attention_forward(const float *q, const float *k, const float *v, float *out, float *logsumexp,
                                int64_t G, int64_t T, int64_t g, int64_t S, int64_t D, int64_t past,
                                int64_t window, float scale, void *stream) {
    KILN_TRY(check_shape(G, T, g, S, D, past));
    KILN_REQUIRE(window >= 0, "window must be >= 0 (0: no sliding window)");
    if (G == 0 || T == 0) return 0;
    size_t bytes = forward_shared((int)D);
    KILN_TRY(allow_shared(attention_forward_kernel, bytes));
    dim3 grid((unsigned)kiln_ceil_div(T * g, kRows), (unsigned)G);
    KILN_LAUNCH(attention_forward_kernel, grid, kThreads, bytes, kiln_stream(stream))(q, k, v, out, logsumexp, T, g, S, (int)D,
                                                                            past, window, scale);
    KILN_LAUNCHED("attention_forward_kernel");
    return 0;
}

int kiln_cuda_attention_backward(const float *dout, const float *q, const float *k, const float *v,
                                 const float *out, const float *logsumexp, float *dq, float *dk, float *dv,
                                 float *delta, int64_t G, int64_t T, int64_t g, int64_t S, int64_t D, int64_t past,
                                 int64_t window, float scale, void *stream) {
    KILN_TRY(check_shape(G, T, g, S, D, past));
    KILN_REQUIRE(window >= 0, "window must be >= 0 (0: no sliding window)");
    KILN_REQUIRE(delta, "attention_backward needs a delta workspace of G*T*g floats");
    if (G == 0 || S == 0) return 0;
    cudaStream_t s = kiln_stream(stream);
    if (T == 0) {  // no query sees any key
        KILN_CUDA(cudaMemsetAsync(dk, 0, sizeof(float) * G * S * D, s));
        KILN_CUDA(cudaMemsetAsync(dv, 0, sizeof(float) * G * S * D, s));
        return 0;
    }
    KILN_LAUNCH(attention_delta_kernel, kiln_grid(G * T * g, KILN_THREADS), KILN_THREADS, 0, s)(dout, out, delta, G * T * g,
                                                                                     (int)D);
    KILN_LAUNCHED("attention_delta_kernel");
    size_t bytes = dkdv_shared((int)D);
    KILN_TRY(allow_shared(attention_dkdv_kernel, bytes));
    KILN_LAUNCH(attention_dkdv_kernel, dim3((unsigned)kiln_ceil_div(S, kKeys), (unsigned)G), kThreads, bytes, s)(
        dout, q, k, v, logsumexp, delta, dk, dv, T, g, S, (int)D, past, window, scale);
    KILN_LAUNCHED("attention_dkdv_kernel");
    bytes = dq_shared((int)D);
    KILN_TRY(allow_shared(attention_dq_kernel, bytes));
    KILN_LAUNCH(attention_dq_kernel, dim3((unsigned)kiln_ceil_div(T * g, kRows), (unsigned)G), kThreads, bytes, s)(
        dout, q, k, v, logsumexp, delta, dq, T, g, S, (int)D, past, window, scale);
    KILN_LAUNCHED("attention_dq_kernel");
    return 0;
}

}  // extern "C"
