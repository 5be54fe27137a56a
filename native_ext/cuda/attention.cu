// Causal grouped-query attention, tiled with an online softmax (trainer/attention.py's tiled algorithm).
// Layout: q/out/dq [G,R,D] with R = T*g (row r is query position past + r / g), k/v/dk/dv [G,S,D],
// logsumexp/delta [G,R]. Forward: one CTA per (row tile, group) walks the key tiles it can see.
// Backward, without atomics: delta = rowsum(dout * out); then one CTA per (key tile, group) owns dK and
// dV of its keys and walks the row tiles that can see them; then one CTA per (row tile, group) owns dQ
// and walks the key tiles. Every sum runs in a fixed order, so the result is the same every run.
//
// Register tiling on the CUDA cores: a CTA is 16 x 16 threads, (ty, tx). A tile of scores [TILE rows, TILE
// keys], TILE = 64 (or 32: below), gives thread (ty, tx) rows ty + 16i and keys tx + 16j (i, j < TILE / 16 = P):
// per two steps of the head dimension it loads P + P pairs of floats from shared memory for 2 P^2 FMAs (the first
// kernels did one FMA's work, unfused, per two single loads). An accumulator [rows or keys, D] gives it rows
// ty + 16i (a dK/dV accumulator keys P ty + i) and the column pairs 2tx + 32m, kept in registers across the whole
// walk; it reads a pair of keys (or, for dK/dV, P keys) of probabilities and a pair of columns per load. The
// head size is rounded up to DMAX = 32, 64 or 128, whose columns from D on hold zeros. Tiles of q, k, v and
// dout live in dynamic shared memory [rows, DMAX + 2]: a pitch of 2 (mod 32) floats, so the 16 threads of a
// half-warp reading pairs from 16 different rows at one column hit 32 different banks, and pairs are
// 8-byte aligned. The products use explicit fmaf (one rounding, as cuBLAS's GEMMs; the rest of the
// library is built with --fmad=false), in a fixed order per output.
//
// Tiles of 64 rows and keys at head size 128 take 119 KiB (forward) and 163 KiB (backward) of shared memory per
// block: an A100 (163 KiB) or H100 (227 KiB) holds them, a device of compute 8.6, 8.9 or 12.0 (99 KiB: RTX 30-,
// 40- and 50-series, A10, L4, L40S) does not. There the kernels run with tiles of 32 (56 and 73 KiB), chosen per
// launch from the device's opt-in limit (choose_tile), so one device always takes the same tiles and gives the same
// bits; a different tile size sums the online softmax in other blocks, so its bits differ in the last places.
#include <cmath>
#include <cstdio>

#include "kiln_cuda_internal.h"

namespace {

constexpr int kSide = 16;      // threads per side of the CTA
constexpr int kThreads = kSide * kSide;
constexpr int kReducePitch = kSide + 1;    // [rows, 16] partial maxima and sums

// a tile of TILE query rows and TILE keys (64, or 32 for devices short of shared memory per block)
template <int TILE>
struct Tiles {
    static_assert(TILE == 32 || TILE == 64, "the kernels tile 32 or 64 rows and keys");
    static constexpr int per_thread = TILE / kSide;  // rows (or keys) per thread in a tile: 4 or 2
    static constexpr int row_score_pitch = TILE + 2;  // score tiles read along a row (forward P, dQ's dS), a pair a load
    static constexpr int column_score_pitch = TILE;   // score tiles read down a column (dK/dV's P and dS), P keys a load
};

// at most 128 registers a thread where two blocks fit an SM's shared memory (head sizes to 64, and 32-key tiles;
// on an H100 for the backward too): no spills there (ptxas -v); the 64-key 128 kernels keep the registers they take
#define KILN_ATTENTION_BOUNDS __launch_bounds__(kThreads, DMAX <= 64 || TILE == 32 ? 2 : 1)

__device__ int thread_y() { return (int)threadIdx.x / kSide; }
__device__ int thread_x() { return (int)threadIdx.x % kSide; }

// two and four floats in one shared-memory load, from an 8- and a 16-byte aligned address
__device__ __forceinline__ float2 load2(const float *p) {
#ifdef KILN_CUDA_EMULATE
    kiln_emu::check_aligned(p, 8);
    return float2{p[0], p[1]};
#else
    return *reinterpret_cast<const float2 *>(p);
#endif
}

__device__ __forceinline__ float4 load4(const float *p) {
#ifdef KILN_CUDA_EMULATE
    kiln_emu::check_aligned(p, 16);
    return float4{p[0], p[1], p[2], p[3]};
#else
    return *reinterpret_cast<const float4 *>(p);
#endif
}

// rows [first, first + count) of source [.., D] into tile [rows, DMAX + 2], zeros past count and from D to DMAX
template <int DMAX>
__device__ void load_tile(float *tile, const float *source, int64_t first, int count, int rows, int D) {
    for (int i = threadIdx.x; i < rows * DMAX; i += kThreads) {
        int row = i / DMAX, d = i % DMAX;
        tile[row * (DMAX + 2) + d] = row < count && d < D ? source[(first + row) * D + d] : 0.0f;
    }
}

template <int TILE>
__device__ void load_rows(float *values, const float *source, int64_t first, int count) {
    for (int i = threadIdx.x; i < TILE; i += kThreads) values[i] = i < count ? source[first + i] : 0.0f;
}

// scores[i][j] = a[rows ty + 16i] . b[rows tx + 16j] over the first D columns, d in order (an odd D's last
// pair reads the zero column D)
template <int DMAX, int TILE, int P = Tiles<TILE>::per_thread>
__device__ void micro_dots(const float *a, const float *b, int D, float (&scores)[P][P]) {
    constexpr int pitch = DMAX + 2;
    const int ty = thread_y(), tx = thread_x();
KILN_UNROLL
    for (int i = 0; i < P; i++)
KILN_UNROLL
        for (int j = 0; j < P; j++) scores[i][j] = 0.0f;
    KILN_UNROLL_4
    for (int d = 0; d < D; d += 2) {
        float2 x[P], y[P];
KILN_UNROLL
        for (int i = 0; i < P; i++) x[i] = load2(a + (ty + kSide * i) * pitch + d);
KILN_UNROLL
        for (int j = 0; j < P; j++) y[j] = load2(b + (tx + kSide * j) * pitch + d);
KILN_UNROLL
        for (int i = 0; i < P; i++)
KILN_UNROLL
            for (int j = 0; j < P; j++) {
                scores[i][j] = fmaf(x[i].x, y[j].x, scores[i][j]);
                scores[i][j] = fmaf(x[i].y, y[j].y, scores[i][j]);
            }
    }
}

// acc[i][2m + e] += w * values[n, 2tx + 32m + e] for the 2m + e columns of this thread
template <int DMAX>
__device__ __forceinline__ void add_row(float (&acc)[DMAX / kSide], float w, const float2 (&x)[DMAX / 32]) {
KILN_UNROLL
    for (int m = 0; m < DMAX / 32; m++) {
        acc[2 * m] = fmaf(w, x[m].x, acc[2 * m]);
        acc[2 * m + 1] = fmaf(w, x[m].y, acc[2 * m + 1]);
    }
}

template <int DMAX>
__device__ __forceinline__ void load_columns(float2 (&x)[DMAX / 32], const float *row) {
KILN_UNROLL
    for (int m = 0; m < DMAX / 32; m++) x[m] = load2(row + 2 * thread_x() + 32 * m);
}

// acc [rows ty + 16i] += weights [rows ty + 16i, n < count] @ values [n, this thread's columns], n in order;
// weights [TILE, TILE + 2] read a pair of n at a time: an odd count's last pair reads weight column count
// (zero: no key there is visible) against values row count (zeros)
template <int DMAX, int TILE, int P = Tiles<TILE>::per_thread>
__device__ void accumulate_rows(const float *weights, const float *values, int count, float (&acc)[P][DMAX / kSide]) {
    constexpr int pitch = DMAX + 2;
    const int ty = thread_y();
    KILN_UNROLL_4
    for (int n = 0; n < count; n += 2) {
        float2 w[P], x0[DMAX / 32], x1[DMAX / 32];
KILN_UNROLL
        for (int i = 0; i < P; i++) w[i] = load2(weights + (ty + kSide * i) * (TILE + 2) + n);
        load_columns<DMAX>(x0, values + n * pitch);
        load_columns<DMAX>(x1, values + (n + 1) * pitch);
KILN_UNROLL
        for (int i = 0; i < P; i++) {
            add_row<DMAX>(acc[i], w[i].x, x0);
            add_row<DMAX>(acc[i], w[i].y, x1);
        }
    }
}

// acc [keys P ty + i] += weights [n < count, keys P ty + i]^T @ values [n, this thread's columns], n in order;
// weights [TILE, TILE] read P keys (four, or two) at a time
template <int DMAX, int TILE, int P = Tiles<TILE>::per_thread>
__device__ void accumulate_columns(const float *weights, const float *values, int count, float (&acc)[P][DMAX / kSide]) {
    constexpr int pitch = DMAX + 2;
    const int ty = thread_y();
    KILN_UNROLL_4
    for (int n = 0; n < count; n++) {
        const float *row = weights + n * Tiles<TILE>::column_score_pitch + P * ty;
        float2 x[DMAX / 32];
        load_columns<DMAX>(x, values + n * pitch);
        if constexpr (P == 4) {
            const float4 w = load4(row);
            add_row<DMAX>(acc[0], w.x, x);
            add_row<DMAX>(acc[1], w.y, x);
            add_row<DMAX>(acc[2], w.z, x);
            add_row<DMAX>(acc[3], w.w, x);
        } else {
            const float2 w = load2(row);
            add_row<DMAX>(acc[0], w.x, x);
            add_row<DMAX>(acc[1], w.y, x);
        }
    }
}

// acc [.., D] to target rows [first, first + count), columns below D: this thread's rows ty + 16i, or P ty + i
// when contiguous (accumulate_columns), each divided by divisors[row] where given
template <int DMAX, int TILE, bool contiguous, int P = Tiles<TILE>::per_thread>
__device__ void store_rows(float *target, int64_t first, int count, int D, const float (&acc)[P][DMAX / kSide],
                           const float *divisors) {
    const int ty = thread_y(), tx = thread_x();
KILN_UNROLL
    for (int i = 0; i < P; i++) {
        int row = contiguous ? P * ty + i : ty + kSide * i;
        if (row >= count) continue;
KILN_UNROLL
        for (int j = 0; j < DMAX / kSide; j++) {
            int d = 2 * tx + 32 * (j / 2) + j % 2;
            if (d < D) target[(first + row) * D + d] = divisors ? acc[i][j] / divisors[row] : acc[i][j];
        }
    }
}

template <int DMAX, int TILE>
__global__ void KILN_ATTENTION_BOUNDS attention_forward_kernel(const float *q, const float *k, const float *v, float *out,
                                         float *logsumexp, int64_t T, int64_t g, int64_t S, int D, int64_t past,
                                         int64_t window, float scale) {
    constexpr int W = DMAX / kSide, pitch = DMAX + 2, P = Tiles<TILE>::per_thread;
    constexpr int score_pitch = Tiles<TILE>::row_score_pitch;
    KILN_DYNAMIC_SHARED(float, shared);
    float *sq = shared, *sk = sq + TILE * pitch, *sv = sk + TILE * pitch, *sp = sv + TILE * pitch;
    float *reduce = sp + TILE * score_pitch, *running_max = reduce + TILE * kReducePitch;
    float *safe_max = running_max + TILE, *running_sum = safe_max + TILE, *alpha = running_sum + TILE;
    const int ty = thread_y(), tx = thread_x();
    // the last row tiles, which see the most keys, run first
    const int64_t R = T * g, group = blockIdx.y, r0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * TILE;
    const int64_t r1 = kiln_tile_end(r0, TILE, R);
    const int rows = (int)(r1 - r0);
    q += group * R * D;
    k += group * S * D;
    v += group * S * D;
    load_tile<DMAX>(sq, q, r0, rows, TILE, D);
    for (int i = threadIdx.x; i < TILE; i += kThreads) {
        running_max[i] = -INFINITY;
        running_sum[i] = 0.0f;
    }
    int64_t query[P];
KILN_UNROLL
    for (int i = 0; i < P; i++) query[i] = kiln_query_position(r0 + ty + kSide * i, g, past);
    float acc[P][W];
KILN_UNROLL
    for (int i = 0; i < P; i++)
KILN_UNROLL
        for (int j = 0; j < W; j++) acc[i][j] = 0.0f;
    // the key tiles some row of this tile can see: from the window's start (0 without one) to the causal end,
    // the last tile cut there, so no key past every row's reach enters a sum (not even as 0 * value)
    const int64_t last_key = kiln_last_key(S, r1, g, past);
    for (int64_t ks = kiln_first_key(r0, g, past, window) / TILE * TILE; ks < last_key; ks += TILE) {
        const int keys = (int)(kiln_tile_end(ks, TILE, last_key) - ks);
        __syncthreads();  // the last tile's readers are done with sk, sv, sp and reduce
        load_tile<DMAX>(sk, k, ks, keys, TILE, D);
        load_tile<DMAX>(sv, v, ks, keys, TILE, D);
        __syncthreads();
        float z[P][P];
        micro_dots<DMAX, TILE>(sq, sk, D, z);
KILN_UNROLL
        for (int i = 0; i < P; i++) {
            float top = -INFINITY;
KILN_UNROLL
            for (int j = 0; j < P; j++) {
                int row = ty + kSide * i, key = tx + kSide * j;
                bool visible = row < rows && key < keys && kiln_attention_visible(ks + key, query[i], window);
                z[i][j] = visible ? z[i][j] * scale : -INFINITY;
                top = fmaxf(top, z[i][j]);
            }
            reduce[(ty + kSide * i) * kReducePitch + tx] = top;
        }
        __syncthreads();
        for (int row = threadIdx.x; row < TILE; row += kThreads) {  // the online softmax's new maximum
            float block_max = -INFINITY;
            for (int t = 0; t < kSide; t++) block_max = fmaxf(block_max, reduce[row * kReducePitch + t]);
            float old_max = running_max[row], new_max = fmaxf(old_max, block_max);
            float safe = new_max == -INFINITY ? 0.0f : new_max;
            float a = old_max == -INFINITY ? 0.0f : expf(old_max - safe);
            if (new_max == -INFINITY) a = 1.0f;
            running_max[row] = new_max;
            safe_max[row] = safe;
            alpha[row] = a;
        }
        __syncthreads();
KILN_UNROLL
        for (int i = 0; i < P; i++) {
            const int row = ty + kSide * i;
            float sum = 0.0f;
KILN_UNROLL
            for (int j = 0; j < P; j++) {
                float p = z[i][j] == -INFINITY ? 0.0f : expf(z[i][j] - safe_max[row]);
                sp[row * score_pitch + tx + kSide * j] = p;
                sum = sum + p;
            }
            reduce[row * kReducePitch + tx] = sum;
KILN_UNROLL
            for (int j = 0; j < W; j++) acc[i][j] = acc[i][j] * alpha[row];
        }
        __syncthreads();
        for (int row = threadIdx.x; row < TILE; row += kThreads) {
            float block_sum = 0.0f;
            for (int t = 0; t < kSide; t++) block_sum = block_sum + reduce[row * kReducePitch + t];
            running_sum[row] = running_sum[row] * alpha[row] + block_sum;
        }
        accumulate_rows<DMAX, TILE>(sp, sv, keys, acc);
    }
    __syncthreads();
    store_rows<DMAX, TILE, false>(out + group * R * D, r0, rows, D, acc, running_sum);
    for (int row = threadIdx.x; row < rows; row += kThreads)
        logsumexp[group * R + r0 + row] = running_max[row] + logf(running_sum[row]);
}

__global__ void attention_delta_kernel(const float *dout, const float *out, float *delta, int64_t rows, int D) {
    for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows; r += (int64_t)gridDim.x * blockDim.x) {
        float sum = 0.0f;
        for (int d = 0; d < D; d++) sum = fmaf(dout[r * D + d], out[r * D + d], sum);
        delta[r] = sum;
    }
}

// for a tile pair, each thread's rows ty + 16i and keys tx + 16j: p = exp(scale * q.k - lse) where visible,
// ds = p * (dout.v - delta) * scale (flash_block_backward), written to p (unless null) and ds [rows, keys]
template <int DMAX, int TILE, int score_pitch>
__device__ void probabilities(const float *sq, const float *sdo, const float *sk, const float *sv,
                              const float *lse, const float *delta, float *p, float *ds, int rows, int keys,
                              int64_t r0, int64_t ks, int64_t g, int64_t past, int64_t window, int D, float scale) {
    constexpr int P = Tiles<TILE>::per_thread;
    const int ty = thread_y(), tx = thread_x();
    float z[P][P], dz[P][P];
    micro_dots<DMAX, TILE>(sq, sk, D, z);
    micro_dots<DMAX, TILE>(sdo, sv, D, dz);
KILN_UNROLL
    for (int i = 0; i < P; i++) {
        const int row = ty + kSide * i;
        const int64_t query = kiln_query_position(r0 + row, g, past);
KILN_UNROLL
        for (int j = 0; j < P; j++) {
            const int key = tx + kSide * j;
            bool visible = row < rows && key < keys && kiln_attention_visible(ks + key, query, window);
            float prob = visible ? expf(z[i][j] * scale - lse[row]) : 0.0f;
            if (p) p[row * score_pitch + key] = prob;
            ds[row * score_pitch + key] = visible ? prob * (dz[i][j] - delta[row]) * scale : 0.0f;
        }
    }
}

template <int DMAX, int TILE>
__global__ void KILN_ATTENTION_BOUNDS attention_dkdv_kernel(const float *dout, const float *q, const float *k, const float *v,
                                      const float *logsumexp, const float *delta, float *dk, float *dv, int64_t T,
                                      int64_t g, int64_t S, int D, int64_t past, int64_t window, float scale) {
    constexpr int W = DMAX / kSide, pitch = DMAX + 2, P = Tiles<TILE>::per_thread;
    KILN_DYNAMIC_SHARED(float, shared);
    float *sk = shared, *sv = sk + TILE * pitch, *sq = sv + TILE * pitch, *sdo = sq + TILE * pitch;
    constexpr int score_pitch = Tiles<TILE>::column_score_pitch;
    float *p = sdo + TILE * pitch, *ds = p + TILE * score_pitch, *lse = ds + TILE * score_pitch, *sdelta = lse + TILE;
    const int64_t R = T * g, group = blockIdx.y, ks = (int64_t)blockIdx.x * TILE;
    const int keys = (int)(kiln_tile_end(ks, TILE, S) - ks);
    q += group * R * D;
    dout += group * R * D;
    logsumexp += group * R;
    delta += group * R;
    load_tile<DMAX>(sk, k + group * S * D, ks, keys, TILE, D);
    load_tile<DMAX>(sv, v + group * S * D, ks, keys, TILE, D);
    float dk_acc[P][W], dv_acc[P][W];
KILN_UNROLL
    for (int i = 0; i < P; i++)
KILN_UNROLL
        for (int j = 0; j < W; j++) dk_acc[i][j] = dv_acc[i][j] = 0.0f;
    // the row tiles that can see some key of this tile: from the causal start to the window's end (R without one)
    const int64_t first = (kiln_first_row(ks, g, past) / TILE) * TILE;
    const int64_t row_end = kiln_row_end(ks + keys, R, g, past, window);
    for (int64_t r0 = first; r0 < row_end; r0 += TILE) {
        const int rows = (int)(kiln_tile_end(r0, TILE, R) - r0);
        __syncthreads();  // the last row tile's readers are done
        load_tile<DMAX>(sq, q, r0, rows, TILE, D);
        load_tile<DMAX>(sdo, dout, r0, rows, TILE, D);
        load_rows<TILE>(lse, logsumexp, r0, rows);
        load_rows<TILE>(sdelta, delta, r0, rows);
        __syncthreads();
        probabilities<DMAX, TILE, score_pitch>(sq, sdo, sk, sv, lse, sdelta, p, ds, rows, keys, r0, ks, g, past,
                                               window, D, scale);
        __syncthreads();
        // this thread's keys P ty + i: dV += P^T dout, dK += dS^T q, over the tile's rows in order
        accumulate_columns<DMAX, TILE>(p, sdo, rows, dv_acc);
        accumulate_columns<DMAX, TILE>(ds, sq, rows, dk_acc);
    }
    store_rows<DMAX, TILE, true>(dk + group * S * D, ks, keys, D, dk_acc, nullptr);
    store_rows<DMAX, TILE, true>(dv + group * S * D, ks, keys, D, dv_acc, nullptr);
}

template <int DMAX, int TILE>
__global__ void KILN_ATTENTION_BOUNDS attention_dq_kernel(const float *dout, const float *q, const float *k, const float *v,
                                    const float *logsumexp, const float *delta, float *dq, int64_t T, int64_t g,
                                    int64_t S, int D, int64_t past, int64_t window, float scale) {
    constexpr int W = DMAX / kSide, pitch = DMAX + 2, P = Tiles<TILE>::per_thread;
    constexpr int score_pitch = Tiles<TILE>::row_score_pitch;
    KILN_DYNAMIC_SHARED(float, shared);
    float *sq = shared, *sdo = sq + TILE * pitch, *sk = sdo + TILE * pitch, *sv = sk + TILE * pitch;
    float *ds = sv + TILE * pitch, *lse = ds + TILE * score_pitch, *sdelta = lse + TILE;
    const int64_t R = T * g, group = blockIdx.y, r0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * TILE;
    const int64_t r1 = kiln_tile_end(r0, TILE, R);
    const int rows = (int)(r1 - r0);
    k += group * S * D;
    v += group * S * D;
    load_tile<DMAX>(sq, q + group * R * D, r0, rows, TILE, D);
    load_tile<DMAX>(sdo, dout + group * R * D, r0, rows, TILE, D);
    load_rows<TILE>(lse, logsumexp + group * R, r0, rows);
    load_rows<TILE>(sdelta, delta + group * R, r0, rows);
    float dq_acc[P][W];
KILN_UNROLL
    for (int i = 0; i < P; i++)
KILN_UNROLL
        for (int j = 0; j < W; j++) dq_acc[i][j] = 0.0f;
    const int64_t last_key = kiln_last_key(S, r1, g, past);
    for (int64_t ks = kiln_first_key(r0, g, past, window) / TILE * TILE; ks < last_key; ks += TILE) {
        const int keys = (int)(kiln_tile_end(ks, TILE, last_key) - ks);
        __syncthreads();
        load_tile<DMAX>(sk, k, ks, keys, TILE, D);
        load_tile<DMAX>(sv, v, ks, keys, TILE, D);
        __syncthreads();
        probabilities<DMAX, TILE, score_pitch>(sq, sdo, sk, sv, lse, sdelta, nullptr, ds, rows, keys, r0, ks, g, past,
                                               window, D, scale);
        __syncthreads();
        accumulate_rows<DMAX, TILE>(ds, sk, keys, dq_acc);  // this thread's rows: dQ += dS k, over the keys in order
    }
    store_rows<DMAX, TILE, false>(dq + group * R * D, r0, rows, D, dq_acc, nullptr);
}

// dynamic shared memory, in floats: [TILE, DMAX + 2] tiles, [TILE, TILE + 2] or [TILE, TILE] score tiles,
// [TILE, 17] and [TILE] rows; every array starts 16-byte aligned (the tiles' sizes are multiples of four floats)
constexpr size_t tile_floats(int tile, int dmax) { return (size_t)tile * (dmax + 2); }
constexpr size_t forward_shared(int tile, int dmax) {
    return sizeof(float) * (3 * tile_floats(tile, dmax) + tile * (tile + 2) + tile * kReducePitch + 4 * tile);
}
constexpr size_t dkdv_shared(int tile, int dmax) {
    return sizeof(float) * (4 * tile_floats(tile, dmax) + 2 * tile * tile + 2 * tile);
}
constexpr size_t dq_shared(int tile, int dmax) {
    return sizeof(float) * (4 * tile_floats(tile, dmax) + tile * (tile + 2) + 2 * tile);
}
constexpr size_t backward_shared(int tile, int dmax) {  // the larger of the backward's two kernels
    return dkdv_shared(tile, dmax) > dq_shared(tile, dmax) ? dkdv_shared(tile, dmax) : dq_shared(tile, dmax);
}
static_assert(forward_shared(64, 128) == 122112 && backward_shared(64, 128) == 166400, "64-row tiles at head size 128");
static_assert(forward_shared(32, 128) <= (99 << 10) && backward_shared(32, 128) <= (99 << 10),
              "32-row tiles fit every device of compute capability 8.0 and later (99 KiB per block at least)");

// the head size D's columns rounded up to the kernels' DMAX: the one place the launches and
// kiln_cuda_attention_shared_bytes take it from
constexpr int head_columns(int64_t D) { return D <= 32 ? 32 : D <= 64 ? 64 : 128; }

int check_shape(int64_t G, int64_t T, int64_t g, int64_t S, int64_t D, int64_t past) {
    KILN_REQUIRE(G >= 0 && T >= 0 && g > 0 && S >= 0 && past >= 0, "G, T, S, past must be >= 0 and g positive");
    KILN_REQUIRE(D > 0 && D <= KILN_CUDA_ATTENTION_MAX_HEAD, "the head size must be in 1..128");
    KILN_REQUIRE(past + T <= S, "every query position needs its key: past + T must be <= S");
    KILN_REQUIRE(G <= 65535 && kiln_ceil_div(T * g, 32) <= 0x7fffffff && kiln_ceil_div(S, 32) <= 0x7fffffff,
                 "too many head groups (G <= 65535) or rows");
    return 0;
}

// The dense algorithm's row work (trainer/cuda_model.py's attention="dense", the products on cuBLAS). scores
// [G, R, S] hold scale * q.k from a GEMM; one CTA per row (the rows of a grid-stride): with FROM_LSE false it
// finds the row's maximum and sum of exponentials over the visible keys (each thread its keys in order, then a
// tree over the CTA in a fixed order) and writes logsumexp; then p = exp(s - logsumexp) where visible, 0 elsewhere,
// in place. With FROM_LSE it takes the saved logsumexp (the backward's recomputed probabilities).
template <bool FROM_LSE>
__global__ void attention_probabilities_kernel(float *scores, float *logsumexp, int64_t rows, int64_t R, int64_t g,
                                               int64_t S, int64_t past, int64_t window) {
    __shared__ float partial[KILN_THREADS];
    const int t = (int)threadIdx.x;
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const int64_t r = row % R;
        const int64_t query = kiln_query_position(r, g, past);
        const int64_t first = kiln_first_key(r, g, past, window);
        const int64_t end = query + 1 < S ? query + 1 : S;
        float *s = scores + row * S;
        float lse;
        if (FROM_LSE) {
            lse = logsumexp[row];
        } else {
            float m = -INFINITY;
            for (int64_t j = first + t; j < end; j += KILN_THREADS) m = fmaxf(m, s[j]);
            partial[t] = m;
            __syncthreads();
            for (int half = KILN_THREADS / 2; half > 0; half /= 2) {
                if (t < half) partial[t] = fmaxf(partial[t], partial[t + half]);
                __syncthreads();
            }
            m = partial[0];
            __syncthreads();
            float sum = 0.0f;
            for (int64_t j = first + t; j < end; j += KILN_THREADS) sum += expf(s[j] - m);
            partial[t] = sum;
            __syncthreads();
            for (int half = KILN_THREADS / 2; half > 0; half /= 2) {
                if (t < half) partial[t] = partial[t] + partial[t + half];
                __syncthreads();
            }
            lse = m + logf(partial[0]);
            if (t == 0) logsumexp[row] = lse;
            __syncthreads();  // partial is reused by the next row
        }
        for (int64_t j = t; j < S; j += KILN_THREADS) s[j] = j >= first && j < end ? expf(s[j] - lse) : 0.0f;
    }
}

// ds = p * (dp - delta[row]) * scale, in place over dp [rows, S] (flash_block_backward's dS; 0 where p is)
__global__ void attention_dscores_kernel(float *dp, const float *p, const float *delta, int64_t n, int64_t S,
                                         float scale) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dp[i] = p[i] * (dp[i] - delta[i / S]) * scale;
}

// a kernel's dynamic shared memory raised to BYTES (past the default 48 KiB); a device whose opt-in limit is below
// that refuses, and is told what the kernel needs (choose_tile keeps the automatic choice within the limit)
template <typename Kernel>
int allow_shared(Kernel kernel, size_t bytes, const char *name) {
    cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (error == cudaSuccess) return 0;
    char where[160];
    snprintf(where, sizeof where, "cudaFuncSetAttribute(%s needs %zu bytes of shared memory per block)", name, bytes);
    return kiln_record_cuda(error, where);
}

// the tile a launch takes: TILE where the caller gives one (32 or 64), else 64 where the current device's opt-in
// shared memory per block holds the 64-row kernels' BYTES64, 32 otherwise: a property of the device, so one device
// always takes the same tiles
int choose_tile(int64_t tile, size_t bytes64, int *chosen) {
    KILN_REQUIRE(tile == 0 || tile == 32 || tile == 64, "tile must be 0 (the device's choice), 32 or 64");
    if (tile) {
        *chosen = (int)tile;
        return 0;
    }
    int device = 0;
    KILN_CUDA(cudaGetDevice(&device));
    size_t optin = 0;
    KILN_TRY(kiln_cuda_device_shared_memory(device, &optin));
    *chosen = bytes64 <= optin ? 64 : 32;
    return 0;
}

template <int DMAX, int TILE>
int forward(const float *q, const float *k, const float *v, float *out, float *logsumexp, int64_t G, int64_t T,
            int64_t g, int64_t S, int64_t D, int64_t past, int64_t window, float scale, cudaStream_t stream) {
    constexpr size_t bytes = forward_shared(TILE, DMAX);
    const auto kernel = attention_forward_kernel<DMAX, TILE>;
    KILN_TRY(allow_shared(kernel, bytes, "attention_forward_kernel"));
    dim3 grid((unsigned)kiln_ceil_div(T * g, TILE), (unsigned)G);
    KILN_LAUNCH(kernel, grid, kThreads, bytes, stream)(q, k, v, out, logsumexp, T, g, S, (int)D, past, window, scale);
    KILN_LAUNCHED("attention_forward_kernel");
    return 0;
}

template <int DMAX, int TILE>
int backward(const float *dout, const float *q, const float *k, const float *v, const float *logsumexp,
             const float *delta, float *dq, float *dk, float *dv, int64_t G, int64_t T, int64_t g, int64_t S,
             int64_t D, int64_t past, int64_t window, float scale, cudaStream_t stream) {
    constexpr size_t dkdv_bytes = dkdv_shared(TILE, DMAX), dq_bytes = dq_shared(TILE, DMAX);
    const auto dkdv = attention_dkdv_kernel<DMAX, TILE>;
    const auto dq_kernel = attention_dq_kernel<DMAX, TILE>;
    KILN_TRY(allow_shared(dkdv, dkdv_bytes, "attention_dkdv_kernel"));
    KILN_LAUNCH(dkdv, dim3((unsigned)kiln_ceil_div(S, TILE), (unsigned)G), kThreads, dkdv_bytes, stream)(
        dout, q, k, v, logsumexp, delta, dk, dv, T, g, S, (int)D, past, window, scale);
    KILN_LAUNCHED("attention_dkdv_kernel");
    KILN_TRY(allow_shared(dq_kernel, dq_bytes, "attention_dq_kernel"));
    KILN_LAUNCH(dq_kernel, dim3((unsigned)kiln_ceil_div(T * g, TILE), (unsigned)G), kThreads, dq_bytes, stream)(
        dout, q, k, v, logsumexp, delta, dq, T, g, S, (int)D, past, window, scale);
    KILN_LAUNCHED("attention_dq_kernel");
    return 0;
}

template <int DMAX>
int forward_tiles(int tile, const float *q, const float *k, const float *v, float *out, float *logsumexp, int64_t G,
                  int64_t T, int64_t g, int64_t S, int64_t D, int64_t past, int64_t window, float scale,
                  cudaStream_t s) {
    if (tile == 64) return forward<DMAX, 64>(q, k, v, out, logsumexp, G, T, g, S, D, past, window, scale, s);
    return forward<DMAX, 32>(q, k, v, out, logsumexp, G, T, g, S, D, past, window, scale, s);
}

template <int DMAX>
int backward_tiles(int tile, const float *dout, const float *q, const float *k, const float *v,
                   const float *logsumexp, const float *delta, float *dq, float *dk, float *dv, int64_t G, int64_t T,
                   int64_t g, int64_t S, int64_t D, int64_t past, int64_t window, float scale, cudaStream_t s) {
    if (tile == 64)
        return backward<DMAX, 64>(dout, q, k, v, logsumexp, delta, dq, dk, dv, G, T, g, S, D, past, window, scale, s);
    return backward<DMAX, 32>(dout, q, k, v, logsumexp, delta, dq, dk, dv, G, T, g, S, D, past, window, scale, s);
}

}  // namespace

extern "C" {

int kiln_cuda_attention_forward(const float *q, const float *k, const float *v, float *out, float *logsumexp,
                                int64_t G, int64_t T, int64_t g, int64_t S, int64_t D, int64_t past,
                                int64_t window, float scale, int64_t tile, void *stream) {
    KILN_TRY(check_shape(G, T, g, S, D, past));
    KILN_REQUIRE(window >= 0, "window must be >= 0 (0: no sliding window)");
    const int dmax = head_columns(D);
    int chosen = 0;
    KILN_TRY(choose_tile(tile, forward_shared(64, dmax), &chosen));
    if (G == 0 || T == 0) return 0;
    cudaStream_t s = kiln_stream(stream);
    switch (dmax) {
        case 32: return forward_tiles<32>(chosen, q, k, v, out, logsumexp, G, T, g, S, D, past, window, scale, s);
        case 64: return forward_tiles<64>(chosen, q, k, v, out, logsumexp, G, T, g, S, D, past, window, scale, s);
        default: return forward_tiles<128>(chosen, q, k, v, out, logsumexp, G, T, g, S, D, past, window, scale, s);
    }
}

int kiln_cuda_attention_backward(const float *dout, const float *q, const float *k, const float *v,
                                 const float *out, const float *logsumexp, float *dq, float *dk, float *dv,
                                 float *delta, int64_t G, int64_t T, int64_t g, int64_t S, int64_t D, int64_t past,
                                 int64_t window, float scale, int64_t tile, void *stream) {
    KILN_TRY(check_shape(G, T, g, S, D, past));
    KILN_REQUIRE(window >= 0, "window must be >= 0 (0: no sliding window)");
    KILN_REQUIRE(delta, "attention_backward needs a delta workspace of G*T*g floats");
    const int dmax = head_columns(D);
    int chosen = 0;
    KILN_TRY(choose_tile(tile, backward_shared(64, dmax), &chosen));
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
    switch (dmax) {
        case 32:
            return backward_tiles<32>(chosen, dout, q, k, v, logsumexp, delta, dq, dk, dv, G, T, g, S, D, past, window,
                                      scale, s);
        case 64:
            return backward_tiles<64>(chosen, dout, q, k, v, logsumexp, delta, dq, dk, dv, G, T, g, S, D, past, window,
                                      scale, s);
        default:
            return backward_tiles<128>(chosen, dout, q, k, v, logsumexp, delta, dq, dk, dv, G, T, g, S, D, past,
                                       window, scale, s);
    }
}

int kiln_cuda_attention_shared_bytes(int64_t D, size_t *forward, size_t *backward) {
    KILN_REQUIRE(D > 0 && D <= KILN_CUDA_ATTENTION_MAX_HEAD, "the head size must be in 1..128");
    KILN_REQUIRE(forward && backward, "forward and backward must point to a size_t each");
    *forward = forward_shared(32, head_columns(D));  // the least the kernels run with: their 32-row tiles
    *backward = backward_shared(32, head_columns(D));
    return 0;
}

int kiln_cuda_attention_probabilities(float *scores, float *logsumexp, int from_logsumexp, int64_t G, int64_t T,
                                      int64_t g, int64_t S, int64_t past, int64_t window, void *stream) {
    KILN_TRY(check_shape(G, T, g, S, 1, past));
    KILN_REQUIRE(window >= 0, "window must be >= 0 (0: no sliding window)");
    if (G == 0 || T == 0 || S == 0) return 0;
    const int64_t rows = G * T * g;
    const unsigned grid = (unsigned)(rows < 65535 * 16 ? rows : 65535 * 16);
    if (from_logsumexp) {
        KILN_LAUNCH(attention_probabilities_kernel<true>, grid, KILN_THREADS, 0, kiln_stream(stream))(
            scores, logsumexp, rows, T * g, g, S, past, window);
    } else {
        KILN_LAUNCH(attention_probabilities_kernel<false>, grid, KILN_THREADS, 0, kiln_stream(stream))(
            scores, logsumexp, rows, T * g, g, S, past, window);
    }
    KILN_LAUNCHED("attention_probabilities_kernel");
    return 0;
}

int kiln_cuda_attention_dscores(float *dscores, const float *probabilities, const float *dout, const float *out,
                                float *delta, int64_t G, int64_t T, int64_t g, int64_t S, int64_t D, float scale,
                                void *stream) {
    KILN_TRY(check_shape(G, T, g, S, D, 0));
    KILN_REQUIRE(delta, "attention_dscores needs a delta workspace of G*T*g floats");
    if (G == 0 || T == 0 || S == 0) return 0;
    cudaStream_t s = kiln_stream(stream);
    const int64_t rows = G * T * g;
    KILN_LAUNCH(attention_delta_kernel, kiln_grid(rows, KILN_THREADS), KILN_THREADS, 0, s)(dout, out, delta, rows,
                                                                                         (int)D);
    KILN_LAUNCHED("attention_delta_kernel");
    KILN_LAUNCH(attention_dscores_kernel, kiln_grid(rows * S, KILN_THREADS), KILN_THREADS, 0, s)(
        dscores, probabilities, delta, rows * S, S, scale);
    KILN_LAUNCHED("attention_dscores_kernel");
    return 0;
}

}  // extern "C"
