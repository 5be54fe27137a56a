/* The fused attention's row work on a tile of scores (the online softmax of the forward, the probabilities
 * and softmax gradient of the backward), in a portable version and AVX2 and AVX-512 versions that do the
 * same roundings in the same order, so all three give the same bytes (tests/engine/test_attention_kernel.py
 * forces each). Included by attention.h, which picks the version together with the tile GEMM's.
 *
 * The work is written once, in attention_rows_body.h, over a chunk of 16 lanes; this file defines the chunk
 * three times (16 floats in C, two AVX2 vectors, one AVX-512 vector) and compiles the body for each.
 *
 * A tile holds `rows` query rows of `width` key scores, rows `ld` floats apart, ld a multiple of KILN_LANES:
 * the columns from width to ld are scratch (read as whole vectors, never used). Row r is the query at
 * position first_query + r / g; its key j (at position key_start + j) is visible when it is at or before
 * the query's position, and a visible key hidden by a window holds -inf. The exponential is
 * kiln_attention_expf, lane by lane (x * scale - shift is one fused multiply-add). Each reduction runs over
 * KILN_LANES lanes (lane j takes the row's elements j, j + 16, j + 32, ... in order), then over the lanes by a
 * fixed tree (lane j with lane j + 8, then j + 4, j + 2, j + 1): no reduction is a chain as long as the row.
 */

typedef void (*kiln_flash_forward_fn)(float *tile, int64_t ld, float *running_max, float *running_sum,
                                      float *alpha, float scale, int64_t rows, int64_t width, int64_t g,
                                      int64_t first_query, int64_t key_start);
typedef void (*kiln_flash_backward_fn)(float *tile, float *dtile, int64_t ld, const float *logsumexp,
                                       const float *delta, float scale, int64_t rows, int64_t width, int64_t g,
                                       int64_t first_query, int64_t key_start);

/* exp(x) for float32 to about 1 ulp: kiln_expf's range reduction and polynomial (Cephes' expf) with each
 * multiply-add fused, so fewer operations and roundings (the vector versions below do the same, lane by lane;
 * fmaf is correctly rounded wherever it runs). 0 below -87.3. */
static inline float kiln_attention_expf(float x) {
    const float hi = 88.3762626647949f, lo = -87.3f;
    float clamped = x > hi ? hi : x;
    clamped = clamped < lo ? lo : clamped;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = fmaf(clamped, 1.44269504088896341f, shifter) - shifter;
    float r = fmaf(-n, 0.693359375f, clamped);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    const float result = p * scale.f;
    return x < lo ? 0.0f : result;
}

/* Row r's visible keys: 0 to width. */
static inline int64_t kiln_rows_visible(int64_t r, int64_t width, int64_t g, int64_t first_query,
                                        int64_t key_start) {
    const int64_t visible = first_query + r / g - key_start + 1;
    return visible > width ? width : visible < 0 ? 0 : visible;
}

/* The row's new running maximum from the block's (its largest visible score times scale, -inf with none
 * visible) and the old one, and the factor alpha that rescales the row's earlier accumulator and sum. */
static inline float kiln_rows_join_max(float block_max, float old, float *alpha) {
    const float mx = old > block_max ? old : block_max;
    *alpha = mx == -INFINITY ? 1.0f : (old == -INFINITY ? 0.0f : kiln_attention_expf(old - mx));
    return mx;
}

/* What the exponent subtracts: the running maximum, or 0 while that is -inf. */
static inline float kiln_rows_shift(float mx) {
    return mx == -INFINITY ? 0.0f : mx;
}

/* The portable chunk: 16 floats, and 16 double sums. */
typedef struct { float v[KILN_LANES]; } kiln_chunk_portable;
typedef struct { double v[KILN_LANES]; } kiln_sums_portable;

static inline kiln_chunk_portable kiln_chunk_load_portable(const float *p) {
    kiln_chunk_portable x;
    memcpy(x.v, p, sizeof x.v);
    return x;
}
static inline void kiln_chunk_store_portable(float *p, kiln_chunk_portable x) { memcpy(p, x.v, sizeof x.v); }
static inline kiln_chunk_portable kiln_chunk_set1_portable(float value) {
    kiln_chunk_portable x;
    for (int j = 0; j < KILN_LANES; j++) x.v[j] = value;
    return x;
}
/* the lanes below n from p, -inf in the others */
static inline kiln_chunk_portable kiln_chunk_visible_portable(const float *p, int64_t n) {
    kiln_chunk_portable x;
    for (int j = 0; j < KILN_LANES; j++) x.v[j] = j < n ? p[j] : -INFINITY;
    return x;
}
/* x's lanes below n, +0 in the others */
static inline kiln_chunk_portable kiln_chunk_keep_portable(kiln_chunk_portable x, int64_t n) {
    for (int j = 0; j < KILN_LANES; j++) x.v[j] = j < n ? x.v[j] : 0.0f;
    return x;
}
/* a > b ? a : b, lane by lane */
static inline kiln_chunk_portable kiln_chunk_max_portable(kiln_chunk_portable a, kiln_chunk_portable b) {
    for (int j = 0; j < KILN_LANES; j++) a.v[j] = a.v[j] > b.v[j] ? a.v[j] : b.v[j];
    return a;
}
static inline float kiln_chunk_max_tree_portable(kiln_chunk_portable x) {
    for (int half = KILN_LANES / 2; half > 0; half /= 2)
        for (int j = 0; j < half; j++) x.v[j] = x.v[j + half] > x.v[j] ? x.v[j + half] : x.v[j];
    return x.v[0];
}
/* exp(a * b - c) */
static inline kiln_chunk_portable kiln_chunk_exp_portable(kiln_chunk_portable a, float b, float c) {
    for (int j = 0; j < KILN_LANES; j++) a.v[j] = kiln_attention_expf(fmaf(a.v[j], b, -c));
    return a;
}
/* p * (d - c) * b */
static inline kiln_chunk_portable kiln_chunk_softmax_grad_portable(kiln_chunk_portable p, kiln_chunk_portable d,
                                                                   float c, float b) {
    for (int j = 0; j < KILN_LANES; j++) p.v[j] = p.v[j] * (d.v[j] - c) * b;
    return p;
}
static inline kiln_sums_portable kiln_sums_zero_portable(void) {
    kiln_sums_portable s = {{0}};
    return s;
}
static inline kiln_sums_portable kiln_sums_add_portable(kiln_sums_portable s, kiln_chunk_portable x) {
    for (int j = 0; j < KILN_LANES; j++) s.v[j] += (double)x.v[j];
    return s;
}
static inline double kiln_sums_tree_portable(kiln_sums_portable s) {
    for (int half = KILN_LANES / 2; half > 0; half /= 2)
        for (int j = 0; j < half; j++) s.v[j] = s.v[j] + s.v[j + half];
    return s.v[0];
}

#define KILN_ROWS_ISA portable
#define KILN_ROWS_TARGET
#include "attention_rows_body.h"
#undef KILN_ROWS_ISA
#undef KILN_ROWS_TARGET

#ifdef KILN_ATTENTION_X86
/* kiln_attention_expf on whole vectors, the same operations in the same order, lane by lane: V the vector type,
 * VI its integer type, P(op) the intrinsic of that width, CAST its integer-to-float cast, ZERO_BELOW(x, lo, y)
 * y with 0 in the lanes where x < lo. */
#define KILN_EXP_VECTOR(NAME, TARGET, V, VI, P, CAST, ZERO_BELOW)                                         \
    __attribute__((target(TARGET))) static inline V NAME(V x) {                                          \
        const V hi = P(set1_ps)(88.3762626647949f), lo = P(set1_ps)(-87.3f);                             \
        const V shifter = P(set1_ps)(12582912.0f);                                                        \
        const V clamped = P(max_ps)(lo, P(min_ps)(hi, x)); /* x > hi ? hi : x, then < lo ? lo */         \
        const V n = P(sub_ps)(P(fmadd_ps)(clamped, P(set1_ps)(1.44269504088896341f), shifter), shifter); \
        V r = P(fnmadd_ps)(n, P(set1_ps)(0.693359375f), clamped);                                         \
        r = P(fnmadd_ps)(n, P(set1_ps)(-2.12194440e-4f), r);                                              \
        V p = P(set1_ps)(1.9875691500e-4f);                                                               \
        p = P(fmadd_ps)(p, r, P(set1_ps)(1.3981999507e-3f));                                              \
        p = P(fmadd_ps)(p, r, P(set1_ps)(8.3334519073e-3f));                                              \
        p = P(fmadd_ps)(p, r, P(set1_ps)(4.1665795894e-2f));                                              \
        p = P(fmadd_ps)(p, r, P(set1_ps)(1.6666665459e-1f));                                              \
        p = P(fmadd_ps)(p, r, P(set1_ps)(5.0000001201e-1f));                                              \
        p = P(add_ps)(P(fmadd_ps)(P(mul_ps)(p, r), r, r), P(set1_ps)(1.0f));                              \
        const VI e = P(slli_epi32)(P(add_epi32)(P(cvttps_epi32)(n), P(set1_epi32)(127)), 23);            \
        return ZERO_BELOW(x, lo, P(mul_ps)(p, CAST(e)));                                                  \
    }
#define KILN_P512(op) _mm512_##op
#define KILN_P256(op) _mm256_##op
#define KILN_ZERO_BELOW_512(x, lo, y) \
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), y, _mm512_setzero_ps())
#define KILN_ZERO_BELOW_256(x, lo, y) _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ))
KILN_EXP_VECTOR(kiln_exp_512, "avx512f,fma", __m512, __m512i, KILN_P512, _mm512_castsi512_ps, KILN_ZERO_BELOW_512)
KILN_EXP_VECTOR(kiln_exp_256, "avx2,fma", __m256, __m256i, KILN_P256, _mm256_castsi256_ps, KILN_ZERO_BELOW_256)

/* The last three steps of the max tree, on lanes 0-7 (j with j + 4, j + 2, j + 1), and of the sum tree, on lanes
 * 0-3 and 4-7 (both chunks': AVX2 and FMA are part of what the AVX-512 version's target has). */
#define KILN_256 __attribute__((target("avx2,fma"))) static inline
KILN_256 float kiln_max_tree_8(__m256 m8) {
    const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
    const __m128 m2 = _mm_max_ps(_mm_movehl_ps(m4, m4), m4);
    return _mm_cvtss_f32(_mm_max_ps(_mm_shuffle_ps(m2, m2, 1), m2));
}
KILN_256 double kiln_sum_tree_8(__m256d low, __m256d high) {
    const __m256d s4 = _mm256_add_pd(low, high);
    const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
    return _mm_cvtsd_f64(s2) + _mm_cvtsd_f64(_mm_unpackhi_pd(s2, s2));
}

/* The AVX-512 chunk: one vector, and its sums in two vectors of doubles (lanes 0-7, 8-15). */
#define KILN_512 __attribute__((target("avx512f,fma"))) static inline
typedef __m512 kiln_chunk_avx512;
typedef struct { __m512d low, high; } kiln_sums_avx512;

/* The lanes below n (all 16 from n >= 16 on). */
static inline __mmask16 kiln_rows_mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}
/* Lanes 8-15 (AVX512F has no extractf32x8). */
KILN_512 __m256 kiln_high_256(__m512 x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }
KILN_512 kiln_chunk_avx512 kiln_chunk_load_avx512(const float *p) { return _mm512_loadu_ps(p); }
KILN_512 void kiln_chunk_store_avx512(float *p, kiln_chunk_avx512 x) { _mm512_storeu_ps(p, x); }
KILN_512 kiln_chunk_avx512 kiln_chunk_set1_avx512(float value) { return _mm512_set1_ps(value); }
KILN_512 kiln_chunk_avx512 kiln_chunk_visible_avx512(const float *p, int64_t n) {
    return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), kiln_rows_mask16(n), p);
}
KILN_512 kiln_chunk_avx512 kiln_chunk_keep_avx512(kiln_chunk_avx512 x, int64_t n) {
    return _mm512_maskz_mov_ps(kiln_rows_mask16(n), x);
}
KILN_512 kiln_chunk_avx512 kiln_chunk_max_avx512(kiln_chunk_avx512 a, kiln_chunk_avx512 b) {
    return _mm512_max_ps(a, b);
}
KILN_512 float kiln_chunk_max_tree_avx512(kiln_chunk_avx512 x) {
    return kiln_max_tree_8(_mm256_max_ps(kiln_high_256(x), _mm512_castps512_ps256(x)));
}
KILN_512 kiln_chunk_avx512 kiln_chunk_exp_avx512(kiln_chunk_avx512 a, float b, float c) {
    return kiln_exp_512(_mm512_fmsub_ps(a, _mm512_set1_ps(b), _mm512_set1_ps(c)));
}
KILN_512 kiln_chunk_avx512 kiln_chunk_softmax_grad_avx512(kiln_chunk_avx512 p, kiln_chunk_avx512 d, float c, float b) {
    return _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(d, _mm512_set1_ps(c))), _mm512_set1_ps(b));
}
KILN_512 kiln_sums_avx512 kiln_sums_zero_avx512(void) {
    kiln_sums_avx512 s = {_mm512_setzero_pd(), _mm512_setzero_pd()};
    return s;
}
KILN_512 kiln_sums_avx512 kiln_sums_add_avx512(kiln_sums_avx512 s, kiln_chunk_avx512 x) {
    s.low = _mm512_add_pd(s.low, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
    s.high = _mm512_add_pd(s.high, _mm512_cvtps_pd(kiln_high_256(x)));
    return s;
}
KILN_512 double kiln_sums_tree_avx512(kiln_sums_avx512 s) {
    const __m512d s8 = _mm512_add_pd(s.low, s.high);
    return kiln_sum_tree_8(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
}

#define KILN_ROWS_ISA avx512
#define KILN_ROWS_TARGET __attribute__((target("avx512f,fma")))
#include "attention_rows_body.h"
#undef KILN_ROWS_ISA
#undef KILN_ROWS_TARGET

/* The AVX2 chunk: two vectors (lanes 0-7, 8-15), and its sums in four vectors of doubles (0-3, 4-7, 8-11, 12-15). */
typedef struct { __m256 low, high; } kiln_chunk_avx2;
typedef struct { __m256d s0, s1, s2, s3; } kiln_sums_avx2;

/* All ones in the lanes below n, as a blend mask. */
KILN_256 __m256 kiln_rows_mask8(int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int32_t count = n > 8 ? 8 : n < 0 ? 0 : (int32_t)n;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
}
KILN_256 kiln_chunk_avx2 kiln_chunk_load_avx2(const float *p) {
    kiln_chunk_avx2 x = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    return x;
}
KILN_256 void kiln_chunk_store_avx2(float *p, kiln_chunk_avx2 x) {
    _mm256_storeu_ps(p, x.low);
    _mm256_storeu_ps(p + 8, x.high);
}
KILN_256 kiln_chunk_avx2 kiln_chunk_set1_avx2(float value) {
    kiln_chunk_avx2 x = {_mm256_set1_ps(value), _mm256_set1_ps(value)};
    return x;
}
KILN_256 kiln_chunk_avx2 kiln_chunk_visible_avx2(const float *p, int64_t n) {
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    kiln_chunk_avx2 x = {_mm256_blendv_ps(minus_inf, _mm256_loadu_ps(p), kiln_rows_mask8(n)),
                         _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(p + 8), kiln_rows_mask8(n - 8))};
    return x;
}
KILN_256 kiln_chunk_avx2 kiln_chunk_keep_avx2(kiln_chunk_avx2 x, int64_t n) {
    x.low = _mm256_and_ps(x.low, kiln_rows_mask8(n));
    x.high = _mm256_and_ps(x.high, kiln_rows_mask8(n - 8));
    return x;
}
KILN_256 kiln_chunk_avx2 kiln_chunk_max_avx2(kiln_chunk_avx2 a, kiln_chunk_avx2 b) {
    a.low = _mm256_max_ps(a.low, b.low);
    a.high = _mm256_max_ps(a.high, b.high);
    return a;
}
KILN_256 float kiln_chunk_max_tree_avx2(kiln_chunk_avx2 x) { return kiln_max_tree_8(_mm256_max_ps(x.high, x.low)); }
KILN_256 kiln_chunk_avx2 kiln_chunk_exp_avx2(kiln_chunk_avx2 a, float b, float c) {
    const __m256 scale = _mm256_set1_ps(b), shift = _mm256_set1_ps(c);
    a.low = kiln_exp_256(_mm256_fmsub_ps(a.low, scale, shift));
    a.high = kiln_exp_256(_mm256_fmsub_ps(a.high, scale, shift));
    return a;
}
KILN_256 kiln_chunk_avx2 kiln_chunk_softmax_grad_avx2(kiln_chunk_avx2 p, kiln_chunk_avx2 d, float c, float b) {
    const __m256 shift = _mm256_set1_ps(c), scale = _mm256_set1_ps(b);
    p.low = _mm256_mul_ps(_mm256_mul_ps(p.low, _mm256_sub_ps(d.low, shift)), scale);
    p.high = _mm256_mul_ps(_mm256_mul_ps(p.high, _mm256_sub_ps(d.high, shift)), scale);
    return p;
}
KILN_256 kiln_sums_avx2 kiln_sums_zero_avx2(void) {
    kiln_sums_avx2 s = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    return s;
}
KILN_256 kiln_sums_avx2 kiln_sums_add_avx2(kiln_sums_avx2 s, kiln_chunk_avx2 x) {
    s.s0 = _mm256_add_pd(s.s0, _mm256_cvtps_pd(_mm256_castps256_ps128(x.low)));
    s.s1 = _mm256_add_pd(s.s1, _mm256_cvtps_pd(_mm256_extractf128_ps(x.low, 1)));
    s.s2 = _mm256_add_pd(s.s2, _mm256_cvtps_pd(_mm256_castps256_ps128(x.high)));
    s.s3 = _mm256_add_pd(s.s3, _mm256_cvtps_pd(_mm256_extractf128_ps(x.high, 1)));
    return s;
}
KILN_256 double kiln_sums_tree_avx2(kiln_sums_avx2 s) {
    return kiln_sum_tree_8(_mm256_add_pd(s.s0, s.s2), _mm256_add_pd(s.s1, s.s3)); /* first j with j + 8 */
}

#define KILN_ROWS_ISA avx2
#define KILN_ROWS_TARGET __attribute__((target("avx2,fma")))
#include "attention_rows_body.h"
#undef KILN_ROWS_ISA
#undef KILN_ROWS_TARGET
#endif

