/* The tiled (flash-style) causal grouped-query attention in one C kernel per direction, called from
 * native_ext/_attention.pyx; its numpy twin is native_ext.reference.attention_forward/backward.
 *
 * Layout as in trainer/attention.py: queries q [G,R,D] with R = T*g rows per head group (row r is the
 * query at position past + r/g), keys and values k, v [G,S,D]. The forward walks key blocks of
 * `block` keys (multiples of block from the first one a query can see) with the online softmax of
 * attention_rows.h; the backward recomputes each tile's probabilities from the forward's logsumexp. Both run
 * on `threads` threads over independent work items (a head group and a run of query rows, or a head group and
 * a key block): each item writes only its own rows, and every output element is one fixed sequence of
 * operations, so the bytes are the same for every thread count and item order.
 *
 * The products are tile GEMMs (kiln_tile_gemm): every element of C is advanced as
 * c = fma(A(i,0), B(0,j), c), c = fma(A(i,1), B(1,j), c), ... in k order, one rounding per step. That
 * sequence does not depend on how the tile is cut into registers, so the AVX-512, AVX2 and portable
 * versions give the same bytes, as do attention_rows.h's versions of the row work
 * (KILN_ATTENTION_ISA=portable|avx2|avx512 asks for one version of both: tests).
 * The threads are native_ext/pool.h's, which OpenBLAS computes on too: the pool's threads spin briefly
 * between tasks, then sleep, and nothing else spins beside them.
 */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function" /* the row kernels this unit does not call */
#include "kiln_kernels.h"
#pragma GCC diagnostic pop
#include "pool.h"
#include "isa.h"

#include <stdlib.h>
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
#define KILN_ATTENTION_X86 1
#endif

/* C[M,N] = (zero ? 0 : C) + A @ B: A(i,k) = A[i*a_row + k*a_col], B row-major (ldb), C row-major (ldc). */
typedef void (*kiln_tile_gemm_fn)(int64_t M, int64_t N, int64_t K, const float *A, int64_t a_row,
                                  int64_t a_col, const float *B, int64_t ldb, float *C, int64_t ldc, int zero);

static void kiln_tile_gemm_portable(int64_t M, int64_t N, int64_t K, const float *A, int64_t a_row,
                                    int64_t a_col, const float *B, int64_t ldb, float *C, int64_t ldc, int zero) {
    for (int64_t i = 0; i < M; i++) {
        float *c = C + i * ldc;
        if (zero) memset(c, 0, sizeof(float) * N);
        for (int64_t k = 0; k < K; k++) {
            const float a = A[i * a_row + k * a_col];
            const float *b = B + k * ldb;
            for (int64_t j = 0; j < N; j++) c[j] = fmaf(a, b[j], c[j]);
        }
    }
}

#ifdef KILN_ATTENTION_X86
/* C rows of the tile += A's column k times B's row k, for every k in order (LOAD reads 16 of B's columns). */
#define KILN_TILE_512_LOOP(MR, LOAD)                                                                   \
    for (int64_t k = 0; k < K; k++) {                                                                  \
        const float *b = B + k * ldb + j0;                                                             \
        __m512 b0 = LOAD(0, b), b1 = LOAD(1, b + 16), b2 = LOAD(2, b + 32), b3 = LOAD(3, b + 48);      \
        const float *a = A + k * a_col;                                                                \
        for (int r = 0; r < MR; r++) {                                                                 \
            __m512 x = _mm512_set1_ps(a[r * a_row]);                                                   \
            c[r][0] = _mm512_fmadd_ps(x, b0, c[r][0]);                                                 \
            c[r][1] = _mm512_fmadd_ps(x, b1, c[r][1]);                                                 \
            c[r][2] = _mm512_fmadd_ps(x, b2, c[r][2]);                                                 \
            c[r][3] = _mm512_fmadd_ps(x, b3, c[r][3]);                                                 \
        }                                                                                              \
    }
#define KILN_LOAD_ALL(v, p) _mm512_loadu_ps(p)
#define KILN_LOAD_MASKED(v, p) _mm512_maskz_loadu_ps(m[v], p)

/* MR rows x 64 columns in 4 zmm registers per row: plain loads and stores where all 64 columns lie inside C
 * (146-170 against 120 GFLOP/s on the attention shapes, one core of an AVX-512 Xeon), masked ones at the right edge.
 * The FMA sequence is the same either way. */
#define KILN_TILE_512(MR)                                                                              \
    __attribute__((target("avx512f"))) static void kiln_tile_512_##MR(                                 \
        int64_t N, int64_t K, const float *A, int64_t a_row, int64_t a_col, const float *B,            \
        int64_t ldb, float *C, int64_t ldc, int zero) {                                                \
        for (int64_t j0 = 0; j0 < N; j0 += 64) {                                                       \
            __mmask16 m[4];                                                                            \
            for (int v = 0; v < 4; v++) {                                                              \
                int64_t left = N - j0 - 16 * v;                                                        \
                m[v] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0                       \
                                                                  : (__mmask16)((1u << left) - 1u);    \
            }                                                                                          \
            __m512 c[MR][4];                                                                           \
            for (int r = 0; r < MR; r++)                                                               \
                for (int v = 0; v < 4; v++)                                                            \
                    c[r][v] = zero ? _mm512_setzero_ps()                                               \
                                   : _mm512_maskz_loadu_ps(m[v], C + r * ldc + j0 + 16 * v);           \
            if (N - j0 >= 64) {                                                                        \
                KILN_TILE_512_LOOP(MR, KILN_LOAD_ALL)                                                  \
                for (int r = 0; r < MR; r++)                                                           \
                    for (int v = 0; v < 4; v++) _mm512_storeu_ps(C + r * ldc + j0 + 16 * v, c[r][v]);  \
            } else {                                                                                   \
                KILN_TILE_512_LOOP(MR, KILN_LOAD_MASKED)                                               \
                for (int r = 0; r < MR; r++)                                                           \
                    for (int v = 0; v < 4; v++)                                                        \
                        _mm512_mask_storeu_ps(C + r * ldc + j0 + 16 * v, m[v], c[r][v]);               \
            }                                                                                          \
        }                                                                                              \
    }
KILN_TILE_512(6)
KILN_TILE_512(5)
KILN_TILE_512(4)
KILN_TILE_512(3)
KILN_TILE_512(2)
KILN_TILE_512(1)

/* C += A @ B over all M rows: 6-row register tiles, then one tile of the 1..5 rows left. */
#define KILN_TILE_GEMM(NAME, TARGET, TILE)                                                             \
    __attribute__((target(TARGET))) static void NAME(int64_t M, int64_t N, int64_t K, const float *A,    \
                                                     int64_t a_row, int64_t a_col, const float *B,     \
                                                     int64_t ldb, float *C, int64_t ldc, int zero) {   \
        int64_t i = 0;                                                                                 \
        for (; i + 6 <= M; i += 6) TILE##_6(N, K, A + i * a_row, a_row, a_col, B, ldb, C + i * ldc, ldc, zero); \
        const float *a = A + i * a_row;                                                                \
        float *c = C + i * ldc;                                                                        \
        switch (M - i) {                                                                               \
        case 5: TILE##_5(N, K, a, a_row, a_col, B, ldb, c, ldc, zero); break;                          \
        case 4: TILE##_4(N, K, a, a_row, a_col, B, ldb, c, ldc, zero); break;                          \
        case 3: TILE##_3(N, K, a, a_row, a_col, B, ldb, c, ldc, zero); break;                          \
        case 2: TILE##_2(N, K, a, a_row, a_col, B, ldb, c, ldc, zero); break;                          \
        case 1: TILE##_1(N, K, a, a_row, a_col, B, ldb, c, ldc, zero); break;                          \
        default: break;                                                                                \
        }                                                                                              \
    }
KILN_TILE_GEMM(kiln_tile_gemm_avx512, "avx512f", kiln_tile_512)

/* C rows of the tile += A's column k times B's row k, for every k in order (LOAD reads 8 of B's columns). */
#define KILN_TILE_256_LOOP(MR, LOAD)                                                                   \
    for (int64_t k = 0; k < K; k++) {                                                                  \
        const float *b = B + k * ldb + j0;                                                             \
        __m256 b0 = LOAD(0, b), b1 = LOAD(1, b + 8);                                                   \
        const float *a = A + k * a_col;                                                                \
        for (int r = 0; r < MR; r++) {                                                                 \
            __m256 x = _mm256_broadcast_ss(a + r * a_row);                                             \
            c[r][0] = _mm256_fmadd_ps(x, b0, c[r][0]);                                                 \
            c[r][1] = _mm256_fmadd_ps(x, b1, c[r][1]);                                                 \
        }                                                                                              \
    }
#define KILN_LOAD8_ALL(v, p) _mm256_loadu_ps(p)
#define KILN_LOAD8_MASKED(v, p) _mm256_maskload_ps(p, m[v])

/* MR rows x 16 columns in 2 ymm registers per row: plain loads and stores where all 16 columns lie inside C,
 * masked ones at the right edge only. On an AVX2 AMD EPYC (Zen 3) a masked 256-bit store took 4.3 ns against 0.3
 * for a plain one, and a tile's 12 of them a third as long as its 64 k steps of products: the tile GEMM went from 68
 * to 91 GFLOP/s on the attention shapes, one core of 94. The FMA sequence is the same either way. */
#define KILN_TILE_256(MR)                                                                              \
    __attribute__((target("avx2,fma"))) static void kiln_tile_256_##MR(                                \
        int64_t N, int64_t K, const float *A, int64_t a_row, int64_t a_col, const float *B,            \
        int64_t ldb, float *C, int64_t ldc, int zero) {                                                \
        for (int64_t j0 = 0; j0 < N; j0 += 16) {                                                       \
            __m256 c[MR][2];                                                                           \
            if (N - j0 >= 16) {                                                                        \
                for (int r = 0; r < MR; r++)                                                           \
                    for (int v = 0; v < 2; v++)                                                        \
                        c[r][v] = zero ? _mm256_setzero_ps()                                           \
                                       : _mm256_loadu_ps(C + r * ldc + j0 + 8 * v);                    \
                KILN_TILE_256_LOOP(MR, KILN_LOAD8_ALL)                                                 \
                for (int r = 0; r < MR; r++)                                                           \
                    for (int v = 0; v < 2; v++) _mm256_storeu_ps(C + r * ldc + j0 + 8 * v, c[r][v]);   \
                continue;                                                                              \
            }                                                                                          \
            __m256i m[2];                                                                              \
            for (int v = 0; v < 2; v++) {                                                              \
                int64_t left = N - j0 - 8 * v;                                                         \
                int32_t lanes[8];                                                                      \
                for (int l = 0; l < 8; l++) lanes[l] = l < left ? -1 : 0;                              \
                m[v] = _mm256_loadu_si256((const __m256i *)lanes);                                     \
            }                                                                                          \
            for (int r = 0; r < MR; r++)                                                               \
                for (int v = 0; v < 2; v++)                                                            \
                    c[r][v] = zero ? _mm256_setzero_ps()                                               \
                                   : _mm256_maskload_ps(C + r * ldc + j0 + 8 * v, m[v]);               \
            KILN_TILE_256_LOOP(MR, KILN_LOAD8_MASKED)                                                  \
            for (int r = 0; r < MR; r++)                                                               \
                for (int v = 0; v < 2; v++)                                                            \
                    _mm256_maskstore_ps(C + r * ldc + j0 + 8 * v, m[v], c[r][v]);                      \
        }                                                                                              \
    }
KILN_TILE_256(6)
KILN_TILE_256(5)
KILN_TILE_256(4)
KILN_TILE_256(3)
KILN_TILE_256(2)
KILN_TILE_256(1)

KILN_TILE_GEMM(kiln_tile_gemm_avx2, "avx2,fma", kiln_tile_256)
#endif

#include "attention_rows.h"

/* One instruction-set version of the kernel's pieces: the tile GEMM and the rows' softmax work. */
typedef struct {
    kiln_tile_gemm_fn gemm;
    kiln_flash_forward_fn flash_forward;
    kiln_flash_backward_fn flash_backward;
} kiln_attention_version;

/* The version this CPU runs, chosen once: KILN_ATTENTION_ISA=portable|avx2|avx512 asks for one. */
static const kiln_attention_version *kiln_attention_version_chosen(void) {
    static const kiln_attention_version versions[] = {
        {kiln_tile_gemm_portable, kiln_rows_flash_forward_portable, kiln_rows_flash_backward_portable},
#ifdef KILN_ATTENTION_X86
        {kiln_tile_gemm_avx2, kiln_rows_flash_forward_avx2, kiln_rows_flash_backward_avx2},
        {kiln_tile_gemm_avx512, kiln_rows_flash_forward_avx512, kiln_rows_flash_backward_avx512},
#endif
    };
    static const kiln_attention_version *chosen = NULL;
    if (chosen) return chosen;
#ifdef KILN_ATTENTION_X86
    chosen = &versions[kiln_isa_pick("KILN_ATTENTION_ISA", 1)];
#else
    chosen = &versions[0];
#endif
    return chosen;
}

/* Query rows per work item: a few positions' rows of one head group, so an item's score tile
 * [rows, block] and accumulator [rows, D] stay in the core's L2 and two threads always find work. */
#define KILN_ATTENTION_POSITIONS 32
/* The backward cuts each head group's keys into at most this many ranges of whole key blocks: an item
 * is a group and a key range; it owns the range's dK and dV and writes the rows' dQ over the range to
 * its own partial, and the partials are added in range order at the end (a function of S and block
 * only, never of the thread count). */
#define KILN_ATTENTION_KEY_RANGES 8

enum { KILN_ATTENTION_PREPARE, KILN_ATTENTION_FORWARD, KILN_ATTENTION_BACKWARD, KILN_ATTENTION_SUM };

typedef struct {
    const float *q, *k, *v, *dout, *out, *lse;
    float *delta, *result, *result_lse, *dq, *dk, *dv;
    float *kt, *vt;   /* keys and values transposed per key block: [G][blocks][D][block] */
    float *partials;  /* backward: dQ over key range j >= 1 of group gi, rows from first_row(j) on */
    float scale;
    int64_t G, R, S, D, g, past, window, block, key_blocks, step, query_items;
    int64_t ld; /* floats between two rows of a score tile: block rounded up to whole vectors (attention_rows.h) */
    int64_t kv_stride; /* elements between two head groups' keys (values): S * D, or more for a cache's view */
    int64_t range_blocks, ranges, partial_rows; /* partial_rows: rows of one group's partials */
    int64_t items, next;
    int backward, phase, failed;
} kiln_attention_job;

static int64_t kiln_attention_first_key(int64_t first_query, int64_t window, int64_t block) {
    if (window <= 0) return 0;
    int64_t first = first_query - window + 1;
    return (first > 0 ? first : 0) / block * block;
}

/* -inf where key key_start + j lies W or more before row r's position (trainer.attention.hide_outside_window). */
static void kiln_attention_hide(float *tile, int64_t ld, int64_t rows, int64_t width, int64_t g,
                                int64_t first_query, int64_t key_start, int64_t window) {
    if (window <= 0) return;
    for (int64_t r = 0; r < rows; r++) {
        int64_t last_hidden = first_query + r / g - window - key_start; /* keys j <= this are hidden */
        for (int64_t j = 0; j <= last_hidden && j < width; j++) tile[r * ld + j] = -INFINITY;
    }
}

/* Transpose [width, D] rows into [D, block] (columns beyond width stay unwritten: never read). */
static void kiln_attention_pack(const float *rows, int64_t width, int64_t D, int64_t block, float *out) {
    for (int64_t j = 0; j < width; j++)
        for (int64_t d = 0; d < D; d++) out[d * block + j] = rows[j * D + d];
}

/* The first row (a multiple of the item step) whose query can see key `key`. */
static int64_t kiln_attention_first_row(const kiln_attention_job *job, int64_t key) {
    int64_t row = (key - job->past) * job->g;
    return row > 0 ? row / job->step * job->step : 0;
}

/* Where group gi's partial for key range j (>= 1) starts: ranges follow each other, each from its first row. */
static float *kiln_attention_partial(const kiln_attention_job *job, int64_t gi, int64_t j) {
    int64_t offset = gi * job->partial_rows;
    for (int64_t i = 1; i < j; i++)
        offset += job->R - kiln_attention_first_row(job, i * job->range_blocks * job->block);
    return job->partials + offset * job->D;
}

typedef struct {
    float *tile, *dtile, *acc, *running_max, *running_sum, *alpha;
} kiln_attention_scratch;

/* Rows [r0, r1) of head group gi: the rows' queries attend key blocks up to their last position. */
static void kiln_attention_forward_item(const kiln_attention_job *job, kiln_attention_scratch *s,
                                        int64_t gi, int64_t r0, int64_t r1) {
    const kiln_attention_version *version = kiln_attention_version_chosen();
    const kiln_tile_gemm_fn gemm = version->gemm;
    const int64_t D = job->D, S = job->S, g = job->g, block = job->block, ld = job->ld, rows = r1 - r0;
    const int64_t first_query = job->past + r0 / g, last_query = job->past + (r1 - 1) / g;
    const float *q = job->q + (gi * job->R + r0) * D;
    const int64_t last_key = last_query + 1 < S ? last_query + 1 : S;
    for (int64_t r = 0; r < rows; r++) {
        s->running_max[r] = -INFINITY;
        s->running_sum[r] = 0.0f;
    }
    memset(s->acc, 0, sizeof(float) * rows * D);
    for (int64_t ks = kiln_attention_first_key(first_query, job->window, block); ks < last_key; ks += block) {
        const int64_t width = (ks + block < last_key ? ks + block : last_key) - ks;
        const float *kt = job->kt + (gi * job->key_blocks + ks / block) * D * block;
        gemm(rows, width, D, q, D, 1, kt, block, s->tile, ld, 1); /* scores [rows, width] */
        kiln_attention_hide(s->tile, ld, rows, width, g, first_query, ks, job->window);
        version->flash_forward(s->tile, ld, s->running_max, s->running_sum, s->alpha, job->scale, rows, width, g,
                               first_query, ks);
        for (int64_t r = 0; r < rows; r++) {
            const float a = s->alpha[r];
            if (a == 1.0f) continue; /* the row's maximum held: acc * 1 is acc, bit for bit */
            float *acc = s->acc + r * D;
            for (int64_t d = 0; d < D; d++) acc[d] = acc[d] * a;
        }
        gemm(rows, D, width, s->tile, ld, 1, job->v + gi * job->kv_stride + ks * D, D, s->acc, D, 0);
    }
    float *out = job->result + (gi * job->R + r0) * D;
    float *lse = job->result_lse + gi * job->R + r0;
    for (int64_t r = 0; r < rows; r++) {
        const float total = s->running_sum[r];
        for (int64_t d = 0; d < D; d++) out[r * D + d] = s->acc[r * D + d] / total;
        lse[r] = s->running_max[r] + logf(total);
    }
}

/* Key range j of head group gi: for every run of query rows that sees it, and each of its key blocks in
 * order, the tile's probabilities P and softmax gradient dS (attention_rows.h), then
 * dV += P.T @ dO and dK += dS.T @ Q for the block, and the rows' dQ over the range += dS @ K. */
static void kiln_attention_backward_item(const kiln_attention_job *job, kiln_attention_scratch *s, int64_t gi,
                                         int64_t j) {
    const kiln_attention_version *version = kiln_attention_version_chosen();
    const kiln_tile_gemm_fn gemm = version->gemm;
    const int64_t D = job->D, S = job->S, g = job->g, block = job->block, ld = job->ld, R = job->R;
    const int64_t first_block = j * job->range_blocks;
    const int64_t end_block = first_block + job->range_blocks < job->key_blocks ? first_block + job->range_blocks
                                                                                 : job->key_blocks;
    const int64_t first_row = kiln_attention_first_row(job, first_block * block);
    float *dq_rows = j == 0 ? job->dq + gi * R * D : kiln_attention_partial(job, gi, j) - first_row * D;
    for (int64_t r0 = first_row; r0 < R; r0 += job->step) {
        const int64_t r1 = r0 + job->step < R ? r0 + job->step : R, rows = r1 - r0;
        const int64_t first_query = job->past + r0 / g, last_query = job->past + (r1 - 1) / g;
        const int64_t first_key = kiln_attention_first_key(first_query, job->window, block);
        const int64_t last_key = last_query + 1 < S ? last_query + 1 : S;
        if (first_key >= end_block * block) break; /* a window has moved past this range */
        const float *q = job->q + (gi * R + r0) * D, *dout = job->dout + (gi * R + r0) * D;
        /* the rows' dQ over the range gathers in the item's cache-resident accumulator, then lands in dq_rows
         * (zeroed by the prepare phase, so the same sums from the same +0) */
        memset(s->acc, 0, sizeof(float) * rows * D);
        for (int64_t kb = first_block; kb < end_block; kb++) {
            const int64_t ks = kb * block;
            if (ks >= last_key) break;
            if (ks < first_key) continue;
            const int64_t width = (ks + block < last_key ? ks + block : last_key) - ks;
            const int64_t packed = (gi * job->key_blocks + kb) * D * block;
            gemm(rows, width, D, q, D, 1, job->kt + packed, block, s->tile, ld, 1);
            kiln_attention_hide(s->tile, ld, rows, width, g, first_query, ks, job->window);
            gemm(rows, width, D, dout, D, 1, job->vt + packed, block, s->dtile, ld, 1);
            version->flash_backward(s->tile, s->dtile, ld, job->lse + gi * R + r0, job->delta + gi * R + r0,
                                    job->scale, rows, width, g, first_query, ks);
            gemm(width, D, rows, s->tile, 1, ld, dout, D, job->dv + (gi * S + ks) * D, D, 0);  /* P.T @ dO */
            gemm(width, D, rows, s->dtile, 1, ld, q, D, job->dk + (gi * S + ks) * D, D, 0);    /* dS.T @ Q */
            gemm(rows, D, width, s->dtile, ld, 1, job->k + gi * job->kv_stride + ks * D, D, s->acc, D, 0);
        }
        memcpy(dq_rows + r0 * D, s->acc, sizeof(float) * rows * D);
    }
}

/* dQ rows [r0, r1) of head group gi += the partials of key ranges 1.. in order. */
static void kiln_attention_sum_item(const kiln_attention_job *job, int64_t gi, int64_t r0, int64_t r1) {
    const int64_t D = job->D;
    float *dq = job->dq + (gi * job->R) * D;
    for (int64_t j = 1; j < job->ranges; j++) {
        const int64_t first_row = kiln_attention_first_row(job, j * job->range_blocks * job->block);
        const float *partial = kiln_attention_partial(job, gi, j) - first_row * D;
        for (int64_t r = r0 > first_row ? r0 : first_row; r < r1; r++)
            for (int64_t d = 0; d < D; d++) dq[r * D + d] += partial[r * D + d];
    }
}

/* The work before the products, in items of their own so that every thread takes part: item < G * key_blocks
 * packs a head group's key block (and for the backward its values, and zeroes its dK and dV rows); then, for
 * the backward, a run of query rows' delta (dO . O) and zeroed dQ, and a head group's partial of key range
 * j >= 1, zeroed. */
static void kiln_attention_prepare_item(const kiln_attention_job *job, int64_t item) {
    const int64_t G = job->G, D = job->D, block = job->block;
    if (item < G * job->key_blocks) {
        const int64_t gi = item % G, kb = item / G, ks = kb * block;
        const int64_t width = (ks + block < job->S ? ks + block : job->S) - ks;
        const int64_t at = (gi * job->key_blocks + kb) * D * block;
        kiln_attention_pack(job->k + gi * job->kv_stride + ks * D, width, D, block, job->kt + at);
        if (!job->backward) return;
        kiln_attention_pack(job->v + gi * job->kv_stride + ks * D, width, D, block, job->vt + at);
        memset(job->dk + (gi * job->S + ks) * D, 0, sizeof(float) * width * D);
        memset(job->dv + (gi * job->S + ks) * D, 0, sizeof(float) * width * D);
        return;
    }
    item -= G * job->key_blocks;
    if (item < G * job->query_items) {
        const int64_t gi = item % G, r0 = item / G * job->step;
        const int64_t r1 = r0 + job->step < job->R ? r0 + job->step : job->R;
        for (int64_t row = gi * job->R + r0; row < gi * job->R + r1; row++)
            job->delta[row] = (float)kiln_row_dot(job->dout + row * D, job->out + row * D, D);
        memset(job->dq + (gi * job->R + r0) * D, 0, sizeof(float) * (r1 - r0) * D);
        return;
    }
    item -= G * job->query_items;
    const int64_t gi = item % G, j = item / G + 1;
    const int64_t rows = job->R - kiln_attention_first_row(job, j * job->range_blocks * block);
    memset(kiln_attention_partial(job, gi, j), 0, sizeof(float) * rows * D);
}

static void kiln_attention_run_item(const kiln_attention_job *job, kiln_attention_scratch *s, int64_t item) {
    if (job->phase == KILN_ATTENTION_PREPARE) {
        kiln_attention_prepare_item(job, item);
        return;
    }
    if (job->phase == KILN_ATTENTION_BACKWARD) {
        /* items from the first key range (the most query rows) to the last */
        kiln_attention_backward_item(job, s, item % job->G, item / job->G);
        return;
    }
    /* query items from the last rows (the most keys) to the first */
    const int64_t gi = item % job->G, index = job->query_items - 1 - item / job->G;
    const int64_t r0 = index * job->step, r1 = r0 + job->step < job->R ? r0 + job->step : job->R;
    if (job->phase == KILN_ATTENTION_FORWARD)
        kiln_attention_forward_item(job, s, gi, r0, r1);
    else
        kiln_attention_sum_item(job, gi, r0, r1);
}

static void kiln_attention_worker(void *arg, int thread) {
    kiln_attention_job *job = (kiln_attention_job *)arg;
    const int64_t rows = job->step, D = job->D, ld = job->ld;
    kiln_attention_scratch s = {0};
    (void)thread;
    /* tiles and accumulators for the phases with products only; zeroed: a tile's scratch columns are read as
     * whole vectors before anything is written there */
    float *memory = NULL;
    if (job->phase == KILN_ATTENTION_FORWARD || job->phase == KILN_ATTENTION_BACKWARD) {
        memory = (float *)calloc((size_t)(2 * rows * ld + rows * D + 3 * rows), sizeof(float));
        if (memory == NULL) {
            __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
            return;
        }
        s.tile = memory;
        s.dtile = s.tile + rows * ld;
        s.acc = s.dtile + rows * ld;
        s.running_max = s.acc + rows * D;
        s.running_sum = s.running_max + rows;
        s.alpha = s.running_sum + rows;
    }
    for (;;) {
        const int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (item >= job->items) break;
        kiln_attention_run_item(job, &s, item);
    }
    free(memory);
}

/* Run the job's items of its phase on `threads` pool threads (this one included); 0, or -1 when out of memory
 * (an item no thread could take is then left undone: the caller raises). */
static int kiln_attention_phase(kiln_attention_job *job, int phase, int threads) {
    job->phase = phase;
    if (phase == KILN_ATTENTION_PREPARE)
        job->items = job->G * (job->key_blocks + (job->backward ? job->query_items + job->ranges - 1 : 0));
    else
        job->items = job->G * (phase == KILN_ATTENTION_BACKWARD ? job->ranges : job->query_items);
    job->next = 0;
    job->failed = 0;
    if (threads > job->items) threads = (int)job->items;
    if (threads < 1) threads = 1;
    if (kiln_pool_run(threads, kiln_attention_worker, job) != 0) kiln_attention_worker(job, 0);
    return job->failed && job->next < job->items ? -1 : 0;
}

/* The job's derived sizes and the memory for its packed keys (and for the backward its values and dQ partials);
 * then the prepare phase fills them. 0, or -1 when out of memory. */
static int kiln_attention_prepare(kiln_attention_job *job, int backward, int threads) {
    job->backward = backward;
    job->key_blocks = (job->S + job->block - 1) / job->block;
    job->ld = (job->block + KILN_LANES - 1) / KILN_LANES * KILN_LANES;
    job->step = KILN_ATTENTION_POSITIONS * job->g;
    job->query_items = (job->R + job->step - 1) / job->step;
    job->range_blocks = (job->key_blocks + KILN_ATTENTION_KEY_RANGES - 1) / KILN_ATTENTION_KEY_RANGES;
    job->ranges = (job->key_blocks + job->range_blocks - 1) / job->range_blocks;
    job->partial_rows = 0;
    for (int64_t j = 1; backward && j < job->ranges; j++)
        job->partial_rows += job->R - kiln_attention_first_row(job, j * job->range_blocks * job->block);
    const int64_t packed = job->G * job->key_blocks * job->D * job->block;
    const int64_t partials = backward ? job->G * job->partial_rows * job->D : 0;
    job->kt = (float *)malloc(sizeof(float) * (packed * (backward ? 2 : 1) + partials));
    if (job->kt == NULL) return -1;
    job->vt = backward ? job->kt + packed : NULL;
    job->partials = backward ? job->kt + 2 * packed : NULL;
    if (kiln_attention_phase(job, KILN_ATTENTION_PREPARE, threads) != 0) {
        free(job->kt);
        return -1;
    }
    return 0;
}

/* The row work of one key block on scores [G,R,S] (rows S floats apart) as the kernel does it on its tiles:
 * each head group's rows copied into a tile of rows KILN_LANES-aligned and back (native_ext.kernels'
 * flash_block_forward and flash_block_backward, which tests compare with their numpy twins). Row r of a
 * group is the query at position past + r / g, key j at key_start + j. 0, or -1 when out of memory. */
static float *kiln_attention_block_tile(int64_t R, int64_t S, int64_t *ld) {
    *ld = (S + KILN_LANES - 1) / KILN_LANES * KILN_LANES;
    return (float *)calloc((size_t)(2 * R * *ld), sizeof(float));
}

static void kiln_attention_block_copy(float *to, int64_t to_ld, const float *from, int64_t from_ld, int64_t R,
                                      int64_t S) {
    for (int64_t r = 0; r < R; r++) memcpy(to + r * to_ld, from + r * from_ld, sizeof(float) * S);
}

static int kiln_attention_flash_block_forward(float *scores, float *running_max, float *running_sum, float *alpha,
                                              float scale, int64_t G, int64_t R, int64_t S, int64_t g, int64_t past,
                                              int64_t key_start) {
    int64_t ld;
    float *tile = kiln_attention_block_tile(R, S, &ld);
    if (tile == NULL) return -1;
    for (int64_t gi = 0; gi < G; gi++) {
        kiln_attention_block_copy(tile, ld, scores + gi * R * S, S, R, S);
        kiln_attention_version_chosen()->flash_forward(tile, ld, running_max + gi * R, running_sum + gi * R,
                                                       alpha + gi * R, scale, R, S, g, past, key_start);
        kiln_attention_block_copy(scores + gi * R * S, S, tile, ld, R, S);
    }
    free(tile);
    return 0;
}

static int kiln_attention_flash_block_backward(float *scores, const float *logsumexp, float *dprobs,
                                               const float *delta, float scale, int64_t G, int64_t R, int64_t S,
                                               int64_t g, int64_t past, int64_t key_start) {
    int64_t ld;
    float *tile = kiln_attention_block_tile(R, S, &ld);
    if (tile == NULL) return -1;
    float *dtile = tile + R * ld;
    for (int64_t gi = 0; gi < G; gi++) {
        kiln_attention_block_copy(tile, ld, scores + gi * R * S, S, R, S);
        kiln_attention_block_copy(dtile, ld, dprobs + gi * R * S, S, R, S);
        kiln_attention_version_chosen()->flash_backward(tile, dtile, ld, logsumexp + gi * R, delta + gi * R, scale,
                                                        R, S, g, past, key_start);
        kiln_attention_block_copy(scores + gi * R * S, S, tile, ld, R, S);
        kiln_attention_block_copy(dprobs + gi * R * S, S, dtile, ld, R, S);
    }
    free(tile);
    return 0;
}

/* out [G,R,D] and logsumexp [G,R] of causal attention over k, v [G,S,D] (group g's rows at g * kv_stride:
 * a view of a longer cache); 0, or -1 when out of memory. */
static int kiln_attention_forward(const float *q, const float *k, const float *v, int64_t kv_stride, float *out,
                                  float *lse, float scale, int64_t G, int64_t R, int64_t S, int64_t D, int64_t g,
                                  int64_t past, int64_t window, int64_t block, int threads) {
    kiln_attention_job job;
    memset(&job, 0, sizeof(job));
    job.q = q; job.k = k; job.v = v; job.kv_stride = kv_stride; job.result = out; job.result_lse = lse;
    job.scale = scale; job.G = G; job.R = R; job.S = S; job.D = D; job.g = g; job.past = past;
    job.window = window; job.block = block;
    if (kiln_attention_prepare(&job, 0, threads) != 0) return -1;
    int status = kiln_attention_phase(&job, KILN_ATTENTION_FORWARD, threads);
    free(job.kt);
    return status;
}

/* dq [G,R,D], dk, dv [G,S,D] (written) from dout and the forward's out and logsumexp; delta [G,R] is
 * scratch (the rows' dout . out). 0, or -1 when out of memory. */
static int kiln_attention_backward(const float *dout, const float *q, const float *k, const float *v,
                                   int64_t kv_stride, const float *out, const float *lse, float *delta, float *dq, float *dk,
                                   float *dv, float scale, int64_t G, int64_t R, int64_t S, int64_t D,
                                   int64_t g, int64_t past, int64_t window, int64_t block, int threads) {
    kiln_attention_job job;
    memset(&job, 0, sizeof(job));
    job.q = q; job.k = k; job.v = v; job.kv_stride = kv_stride; job.dout = dout; job.out = out; job.lse = lse;
    job.delta = delta;
    job.dq = dq; job.dk = dk; job.dv = dv;
    job.scale = scale; job.G = G; job.R = R; job.S = S; job.D = D; job.g = g; job.past = past;
    job.window = window; job.block = block;
    if (kiln_attention_prepare(&job, 1, threads) != 0) return -1;
    int status = kiln_attention_phase(&job, KILN_ATTENTION_BACKWARD, threads);
    if (status == 0 && job.ranges > 1) status = kiln_attention_phase(&job, KILN_ATTENTION_SUM, threads);
    free(job.kt);
    return status;
}
