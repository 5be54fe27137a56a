/* A prototype measured for issue 19 and not adopted (bench/packed_gemm.py builds and times it; docs/engine.md,
 * "The 2-core AMX Xeon on 2026-12-03"): float32 products over a frozen weight W [N, K] kept pre-packed once,
 * Wb[K/16][N][16] (16 input features of one output row per 64-byte line), so that no product packs W again, the
 * cost OpenBLAS pays on every call. Forward y [M, N] = x [M, K] @ W.T: x transposed in 16x16 blocks, tiles of 32
 * rows x 12 outputs vectorised along the rows; input gradient dx [M, K] = dy [M, N] @ W: tiles of BR rows x 16*KV
 * inputs, dy broadcast. Threads (OpenMP) take contiguous row ranges. Needs AVX-512, N % 12 == 0 and K % 48 == 0
 * (M as below): the four shapes bench/packed_gemm.py times. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <omp.h>
#define FNR 12
#define FMV 2
#ifndef BR
#define BR 8
#endif
#ifndef KV
#define KV 3
#endif
#define NC 256
void pack16(int64_t N, int64_t K, const float *W, float *Wb) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t kp = 0; kp < K / 16; kp++)
            memcpy(Wb + (kp * N + n) * 16, W + n * K + kp * 16, 64);
}
__attribute__((target("avx512f"))) static void transpose16(const float *x, int64_t ldx, float *out) {
    /* out[k*16 + i] = x[i*ldx + k] for 16x16 */
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(x + i * ldx);
    for (int i = 0; i < 8; i++) { t[2*i] = _mm512_unpacklo_ps(r[2*i], r[2*i+1]); t[2*i+1] = _mm512_unpackhi_ps(r[2*i], r[2*i+1]); }
    for (int i = 0; i < 4; i++) for (int j = 0; j < 2; j++) {
        __m512d a = _mm512_castps_pd(t[4*i+j]), b = _mm512_castps_pd(t[4*i+j+2]);
        r[4*i+j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)); r[4*i+j+2] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
    for (int i = 0; i < 2; i++) for (int j = 0; j < 4; j++) {
        t[8*i+j] = _mm512_shuffle_f32x4(r[8*i+j], r[8*i+j+4], 0x88); t[8*i+j+4] = _mm512_shuffle_f32x4(r[8*i+j], r[8*i+j+4], 0xdd);
    }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j+8], 0x88); r[j+8] = _mm512_shuffle_f32x4(t[j], t[j+8], 0xdd);
    }
    /* after the three stages register j holds column map[j] (map is its own inverse) */
    static const int map[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
    for (int j = 0; j < 16; j++) _mm512_storeu_ps(out + j * 16, r[map[j]]);
}
__attribute__((target("avx512f"))) static void fwd_rows(int64_t m0, int64_t m1, int64_t N, int64_t K, const float *x, int64_t ldx,
        const float *Wb, float *y, int64_t ldy, float *xt) {
    for (int64_t m = m0; m < m1; m += 16)
        for (int64_t k0 = 0; k0 < K; k0 += 16) transpose16(x + m * ldx + k0, ldx, xt + ((m - m0) / 16 * K + k0) * 16);
    float buf[FNR][FMV * 16];
    for (int64_t n = 0; n + FNR <= N; n += FNR) {
        for (int64_t m = m0; m + 16 * FMV <= m1; m += 16 * FMV) {
            __m512 c[FNR][FMV];
            for (int j = 0; j < FNR; j++) for (int v = 0; v < FMV; v++) c[j][v] = _mm512_setzero_ps();
            const float *a = xt + (m - m0) / 16 * K * 16;
            const float *wp = Wb + n * 16;
            for (int64_t kp = 0; kp < K / 16; kp++, wp += N * 16) {
                for (int kk = 0; kk < 16; kk++) {
                    const int64_t k = kp * 16 + kk;
                    __m512 xv[FMV];
                    for (int v = 0; v < FMV; v++) xv[v] = _mm512_loadu_ps(a + (v * K + k) * 16);
                    for (int j = 0; j < FNR; j++) {
                        __m512 b = _mm512_set1_ps(wp[j * 16 + kk]);
                        for (int v = 0; v < FMV; v++) c[j][v] = _mm512_fmadd_ps(b, xv[v], c[j][v]);
                    }
                }
            }
            for (int j = 0; j < FNR; j++) for (int v = 0; v < FMV; v++) _mm512_storeu_ps(buf[j] + v * 16, c[j][v]);
            for (int i = 0; i < 16 * FMV; i++) { float *out = y + (m + i) * ldy + n; for (int j = 0; j < FNR; j++) out[j] = buf[j][i]; }
        }
    }
}
__attribute__((target("avx512f"))) static void bwd_rows(int64_t m0, int64_t m1, int64_t N, int64_t K, const float *dy, int64_t lddy,
        const float *Wb, float *dx, int64_t lddx) {
    for (int64_t nb = 0; nb < N; nb += NC) {
        int64_t ne = nb + NC < N ? nb + NC : N;
        for (int64_t p = 0; p + KV <= K / 16; p += KV) {
            for (int64_t m = m0; m + BR <= m1; m += BR) {
                __m512 c[BR][KV];
                for (int i = 0; i < BR; i++) for (int v = 0; v < KV; v++)
                    c[i][v] = nb ? _mm512_loadu_ps(dx + (m + i) * lddx + (p + v) * 16) : _mm512_setzero_ps();
                const float *d = dy + m * lddy;
                for (int64_t n = nb; n < ne; n++) {
                    __m512 wv[KV];
                    for (int v = 0; v < KV; v++) wv[v] = _mm512_loadu_ps(Wb + ((p + v) * N + n) * 16);
                    for (int i = 0; i < BR; i++) {
                        __m512 b = _mm512_set1_ps(d[i * lddy + n]);
                        for (int v = 0; v < KV; v++) c[i][v] = _mm512_fmadd_ps(b, wv[v], c[i][v]);
                    }
                }
                for (int i = 0; i < BR; i++) for (int v = 0; v < KV; v++)
                    _mm512_storeu_ps(dx + (m + i) * lddx + (p + v) * 16, c[i][v]);
            }
        }
    }
}
/* thread t of T computes rows [t * per, (t + 1) * per): per rounded up to the tile's rows (M a multiple of
 * 32 * T for the forward and of BR * T for the input gradient; the tails are not computed) */
void fwd(int64_t M, int64_t N, int64_t K, const float *x, const float *Wb, float *y, float *xt, int threads) {
    #pragma omp parallel num_threads(threads)
    { int t = omp_get_thread_num(); int64_t per = (M / threads + 31) / 32 * 32; int64_t m0 = t * per, m1 = m0 + per < M ? m0 + per : M;
      fwd_rows(m0, m1, N, K, x, K, Wb, y, N, xt + m0 * K); }
}
void bwd(int64_t M, int64_t N, int64_t K, const float *dy, const float *Wb, float *dx, int threads) {
    #pragma omp parallel num_threads(threads)
    { int t = omp_get_thread_num(); int64_t per = (M / threads + BR - 1) / BR * BR; int64_t m0 = t * per, m1 = m0 + per < M ? m0 + per : M;
      bwd_rows(m0, m1, N, K, dy, N, Wb, dx, K); }
}
