/* The fused attention's row work on a tile of scores (the online softmax of the forward, the probabilities
 * and softmax gradient of the backward), in a portable version and AVX2 and AVX-512 versions that do the
 * same roundings in the same order, so all three give the same bytes (tests/engine/test_attention_kernel.py
 * forces each). Included by attention.h, which picks the version together with the tile GEMM's.
 *
 * A tile holds `rows` query rows of `width` key scores, rows `ld` floats apart, ld a multiple of KILN_LANES:
 * the columns from width to ld are scratch (read as whole vectors, never used). Row r is the query at
 * position first_query + r / g; its key j (at position key_start + j) is visible when it is at or before
 * the query's position, and a visible key hidden by a window holds -inf. The exponential is
 * kiln_attention_expf, lane by lane (x * scale - shift is one fused multiply-add). Each reduction runs over KILN_LANES lanes (lane j takes the row's
 * elements j, j + 16, j + 32, ... in order), then over the lanes by a fixed tree (lane j with lane j + 8,
 * then j + 4, j + 2, j + 1): no reduction is a chain as long as the row.
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

/* One key block of the online softmax: each row's maximum over its visible scores (times scale) joins
 * running_max, the scores become exp(score * scale - max) (0 where not visible), their sum joins
 * running_sum, and alpha is the factor the rows' earlier accumulators are rescaled by. */
static void kiln_rows_flash_forward_portable(float *tile, int64_t ld, float *running_max, float *running_sum,
                                             float *alpha, float scale, int64_t rows, int64_t width, int64_t g,
                                             int64_t first_query, int64_t key_start) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        float *row = tile + r * ld;
        float lanes[KILN_LANES];
        for (int j = 0; j < KILN_LANES; j++) lanes[j] = -INFINITY;
        for (int64_t c = 0; c < visible; c += KILN_LANES)
            for (int j = 0; j < KILN_LANES; j++) {
                const float x = c + j < visible ? row[c + j] : -INFINITY;
                lanes[j] = x > lanes[j] ? x : lanes[j];
            }
        for (int half = KILN_LANES / 2; half > 0; half /= 2)
            for (int j = 0; j < half; j++) lanes[j] = lanes[j + half] > lanes[j] ? lanes[j + half] : lanes[j];
        float a;
        const float mx = kiln_rows_join_max(visible > 0 ? lanes[0] * scale : -INFINITY, running_max[r], &a);
        const float safe = kiln_rows_shift(mx);
        double sums[KILN_LANES] = {0};
        for (int64_t c = 0; c < width; c += KILN_LANES)
            for (int j = 0; j < KILN_LANES; j++) {
                const float p = c + j < visible ? kiln_attention_expf(fmaf(row[c + j], scale, -safe)) : 0.0f;
                row[c + j] = p;
                sums[j] += (double)p;
            }
        for (int half = KILN_LANES / 2; half > 0; half /= 2)
            for (int j = 0; j < half; j++) sums[j] = sums[j] + sums[j + half];
        running_sum[r] = running_sum[r] * a + (float)sums[0];
        running_max[r] = mx;
        alpha[r] = a;
    }
}

/* One key block of the backward: the probabilities recomputed from the forward's logsumexp,
 * P = exp(score * scale - lse) into tile, and dS = P * (dP - delta) * scale into dtile (rows ld apart in
 * both), 0 where not visible. */
static void kiln_rows_flash_backward_portable(float *tile, float *dtile, int64_t ld, const float *logsumexp,
                                              const float *delta, float scale, int64_t rows, int64_t width,
                                              int64_t g, int64_t first_query, int64_t key_start) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        float *row = tile + r * ld, *d = dtile + r * ld;
        const float lse = logsumexp[r], dl = delta[r];
        for (int64_t j = 0; j < visible; j++) {
            const float p = kiln_attention_expf(fmaf(row[j], scale, -lse));
            row[j] = p;
            d[j] = p * (d[j] - dl) * scale;
        }
        for (int64_t j = visible; j < (width + KILN_LANES - 1) / KILN_LANES * KILN_LANES; j++) {
            row[j] = 0.0f;
            d[j] = 0.0f;
        }
    }
}

#ifdef KILN_ATTENTION_X86
/* kiln_attention_expf on 16 lanes: the same operations in the same order. */
__attribute__((target("avx512f,fma"))) static inline __m512 kiln_exp_512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.3f);
    const __m512 shifter = _mm512_set1_ps(12582912.0f);
    const __m512 clamped = _mm512_max_ps(lo, _mm512_min_ps(hi, x)); /* x > hi ? hi : x, then < lo ? lo */
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(clamped, _mm512_set1_ps(1.44269504088896341f), shifter), shifter);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), clamped);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), result, _mm512_setzero_ps());
}

/* Lanes 8-15 (AVX512F has no extractf32x8). */
__attribute__((target("avx512f"))) static inline __m256 kiln_rows_high_256(__m512 x) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
}

/* The lanes below n (all 16 from n >= 16 on). */
static inline __mmask16 kiln_rows_mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

__attribute__((target("avx512f,fma")))
static void kiln_rows_flash_forward_avx512(float *tile, int64_t ld, float *running_max, float *running_sum,
                                           float *alpha, float scale, int64_t rows, int64_t width, int64_t g,
                                           int64_t first_query, int64_t key_start) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY), scales = _mm512_set1_ps(scale);
    /* three passes over the rows, so that no row waits on the one before: the block maxima (in alpha),
     * the running maxima and alphas, then the exponentials and their sums */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        const float *row = tile + r * ld;
        __m512 m = minus_inf;
        for (int64_t c = 0; c < visible; c += 16)
            m = _mm512_max_ps(_mm512_mask_loadu_ps(minus_inf, kiln_rows_mask16(visible - c), row + c), m);
        const __m256 m8 = _mm256_max_ps(kiln_rows_high_256(m), _mm512_castps512_ps256(m));
        const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
        const __m128 m2 = _mm_max_ps(_mm_movehl_ps(m4, m4), m4);
        const __m128 m1 = _mm_max_ps(_mm_shuffle_ps(m2, m2, 1), m2);
        alpha[r] = visible > 0 ? _mm_cvtss_f32(m1) * scale : -INFINITY;
    }
    for (int64_t r = 0; r < rows; r++) running_max[r] = kiln_rows_join_max(alpha[r], running_max[r], alpha + r);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        float *row = tile + r * ld;
        const __m512 shift = _mm512_set1_ps(kiln_rows_shift(running_max[r]));
        __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
        for (int64_t c = 0; c < width; c += 16) {
            const __mmask16 keep = kiln_rows_mask16(visible - c);
            __m512 p = _mm512_setzero_ps();
            if (keep) {
                p = kiln_exp_512(_mm512_fmsub_ps(_mm512_loadu_ps(row + c), scales, shift));
                p = _mm512_maskz_mov_ps(keep, p);
                low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(p)));
                high = _mm512_add_pd(high, _mm512_cvtps_pd(kiln_rows_high_256(p)));
            }
            _mm512_storeu_ps(row + c, p);
        }
        const __m512d s8 = _mm512_add_pd(low, high);
        const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
        const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
        const double total = _mm_cvtsd_f64(s2) + _mm_cvtsd_f64(_mm_unpackhi_pd(s2, s2));
        running_sum[r] = running_sum[r] * alpha[r] + (float)total;
    }
}

__attribute__((target("avx512f,fma")))
static void kiln_rows_flash_backward_avx512(float *tile, float *dtile, int64_t ld, const float *logsumexp,
                                            const float *delta, float scale, int64_t rows, int64_t width,
                                            int64_t g, int64_t first_query, int64_t key_start) {
    const __m512 scales = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        float *row = tile + r * ld, *d = dtile + r * ld;
        const __m512 lse = _mm512_set1_ps(logsumexp[r]), dl = _mm512_set1_ps(delta[r]);
        for (int64_t c = 0; c < width; c += 16) {
            const __mmask16 keep = kiln_rows_mask16(visible - c);
            __m512 p = _mm512_setzero_ps(), ds = _mm512_setzero_ps();
            if (keep) {
                p = kiln_exp_512(_mm512_fmsub_ps(_mm512_loadu_ps(row + c), scales, lse));
                ds = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(d + c), dl)), scales);
                p = _mm512_maskz_mov_ps(keep, p);
                ds = _mm512_maskz_mov_ps(keep, ds);
            }
            _mm512_storeu_ps(row + c, p);
            _mm512_storeu_ps(d + c, ds);
        }
    }
}

/* kiln_attention_expf on 8 lanes, as kiln_exp_512. */
__attribute__((target("avx2,fma"))) static inline __m256 kiln_exp_256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3f);
    const __m256 shifter = _mm256_set1_ps(12582912.0f);
    const __m256 clamped = _mm256_max_ps(lo, _mm256_min_ps(hi, x));
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(clamped, _mm256_set1_ps(1.44269504088896341f), shifter), shifter);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(result, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}

/* All ones in the lanes below n, as a blend mask. */
__attribute__((target("avx2,fma"))) static inline __m256 kiln_rows_mask8(int64_t n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int32_t count = n > 8 ? 8 : n < 0 ? 0 : (int32_t)n;
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
}

__attribute__((target("avx2,fma")))
static void kiln_rows_flash_forward_avx2(float *tile, int64_t ld, float *running_max, float *running_sum,
                                         float *alpha, float scale, int64_t rows, int64_t width, int64_t g,
                                         int64_t first_query, int64_t key_start) {
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY), scales = _mm256_set1_ps(scale);
    /* the passes of kiln_rows_flash_forward_avx512 */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        const float *row = tile + r * ld;
        __m256 m0 = minus_inf, m1 = minus_inf; /* lanes 0-7 and 8-15 */
        for (int64_t c = 0; c < visible; c += 16) {
            m0 = _mm256_max_ps(_mm256_blendv_ps(minus_inf, _mm256_loadu_ps(row + c), kiln_rows_mask8(visible - c)), m0);
            m1 = _mm256_max_ps(_mm256_blendv_ps(minus_inf, _mm256_loadu_ps(row + c + 8),
                                                kiln_rows_mask8(visible - c - 8)), m1);
        }
        const __m256 m8 = _mm256_max_ps(m1, m0);
        const __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
        const __m128 m2 = _mm_max_ps(_mm_movehl_ps(m4, m4), m4);
        const __m128 mm = _mm_max_ps(_mm_shuffle_ps(m2, m2, 1), m2);
        alpha[r] = visible > 0 ? _mm_cvtss_f32(mm) * scale : -INFINITY;
    }
    for (int64_t r = 0; r < rows; r++) running_max[r] = kiln_rows_join_max(alpha[r], running_max[r], alpha + r);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        float *row = tile + r * ld;
        const __m256 shift = _mm256_set1_ps(kiln_rows_shift(running_max[r]));
        __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0; /* lanes 0-3, 4-7, 8-11, 12-15 */
        for (int64_t c = 0; c < width; c += 16) {
            __m256 p0 = _mm256_setzero_ps(), p1 = p0;
            if (visible > c) {
                p0 = kiln_exp_256(_mm256_fmsub_ps(_mm256_loadu_ps(row + c), scales, shift));
                p1 = kiln_exp_256(_mm256_fmsub_ps(_mm256_loadu_ps(row + c + 8), scales, shift));
                p0 = _mm256_and_ps(p0, kiln_rows_mask8(visible - c));
                p1 = _mm256_and_ps(p1, kiln_rows_mask8(visible - c - 8));
                s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(p0)));
                s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(p0, 1)));
                s2 = _mm256_add_pd(s2, _mm256_cvtps_pd(_mm256_castps256_ps128(p1)));
                s3 = _mm256_add_pd(s3, _mm256_cvtps_pd(_mm256_extractf128_ps(p1, 1)));
            }
            _mm256_storeu_ps(row + c, p0);
            _mm256_storeu_ps(row + c + 8, p1);
        }
        const __m256d s4 = _mm256_add_pd(_mm256_add_pd(s0, s2), _mm256_add_pd(s1, s3));
        const __m128d t2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
        const double total = _mm_cvtsd_f64(t2) + _mm_cvtsd_f64(_mm_unpackhi_pd(t2, t2));
        running_sum[r] = running_sum[r] * alpha[r] + (float)total;
    }
}

__attribute__((target("avx2,fma")))
static void kiln_rows_flash_backward_avx2(float *tile, float *dtile, int64_t ld, const float *logsumexp,
                                          const float *delta, float scale, int64_t rows, int64_t width,
                                          int64_t g, int64_t first_query, int64_t key_start) {
    const __m256 scales = _mm256_set1_ps(scale);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        float *row = tile + r * ld, *d = dtile + r * ld;
        const __m256 lse = _mm256_set1_ps(logsumexp[r]), dl = _mm256_set1_ps(delta[r]);
        for (int64_t c = 0; c < width; c += 8) {
            __m256 p = _mm256_setzero_ps(), ds = p;
            if (visible > c) {
                const __m256 keep = kiln_rows_mask8(visible - c);
                p = kiln_exp_256(_mm256_fmsub_ps(_mm256_loadu_ps(row + c), scales, lse));
                ds = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(d + c), dl)), scales);
                p = _mm256_and_ps(p, keep);
                ds = _mm256_and_ps(ds, keep);
            }
            _mm256_storeu_ps(row + c, p);
            _mm256_storeu_ps(d + c, ds);
        }
    }
}
#endif
