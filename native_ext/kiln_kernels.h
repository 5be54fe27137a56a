/* Row kernels of Kiln's CPU backend in plain C, called from native_ext/_kernels.pyx.
 *
 * Each loop is written so that GCC vectorises it without -ffast-math: the exponential
 * is a branch-free polynomial (kiln_expf), and every reduction keeps KILN_LANES explicit
 * partial sums in a fixed order (compiled with -fopenmp-simd; no OpenMP runtime), so the result is the same for every instruction set
 * the function is cloned for (target_clones) and for every thread count.
 * Dimension letters as in native_ext/reference.py.
 */
#ifndef KILN_KERNELS_H
#define KILN_KERNELS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KILN_LANES 16
/* The lane loops are independent accumulators, so vectorising them keeps the order. */
#define KILN_SIMD _Pragma("omp simd")
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define KILN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KILN_CLONES
#endif

/* exp(x) for float32 to about 2 ulp (Cephes' expf polynomial); 0 below -87.3. */
static inline float kiln_expf(float x) {
    const float hi = 88.3762626647949f, lo = -87.3f;
    float clamped = x > hi ? hi : x;
    clamped = clamped < lo ? lo : clamped;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (clamped * 1.44269504088896341f + shifter) - shifter;
    float r = clamped - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * r) * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    float result = p * scale.f;
    return x < lo ? 0.0f : result;
}

static inline float kiln_row_max(const float *x, int64_t n) {
    float lanes[KILN_LANES];
    int64_t i = 0;
    if (n < KILN_LANES) {
        float m = -INFINITY;
        for (; i < n; i++) m = x[i] > m ? x[i] : m;
        return m;
    }
    for (int j = 0; j < KILN_LANES; j++) lanes[j] = x[j];
    for (i = KILN_LANES; i + KILN_LANES <= n; i += KILN_LANES) {
        KILN_SIMD
        for (int j = 0; j < KILN_LANES; j++) lanes[j] = x[i + j] > lanes[j] ? x[i + j] : lanes[j];
    }
    float m = lanes[0];
    for (int j = 1; j < KILN_LANES; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* y[i] = exp(x[i] * scale - shift) written to y (may alias x); returns the sum as double. */
static inline double kiln_row_exp_sum(const float *x, float *y, int64_t n, float scale, float shift) {
    double lanes[KILN_LANES] = {0};
    int64_t i = 0;
    for (int64_t k = 0; k < n; k++) y[k] = kiln_expf(x[k] * scale - shift);
    for (; i + KILN_LANES <= n; i += KILN_LANES) {
        KILN_SIMD
        for (int j = 0; j < KILN_LANES; j++) lanes[j] += (double)y[i + j];
    }
    double total = 0.0;
    for (int j = 0; j < KILN_LANES; j++) total += lanes[j];
    for (; i < n; i++) total += (double)y[i];
    return total;
}

static inline double kiln_row_dot(const float *a, const float *b, int64_t n) {
    double lanes[KILN_LANES] = {0};
    int64_t i = 0;
    for (; i + KILN_LANES <= n; i += KILN_LANES) {
        KILN_SIMD
        for (int j = 0; j < KILN_LANES; j++) lanes[j] += (double)(a[i + j] * b[i + j]);
    }
    double total = 0.0;
    for (int j = 0; j < KILN_LANES; j++) total += lanes[j];
    for (; i < n; i++) total += (double)(a[i] * b[i]);
    return total;
}

KILN_CLONES
static void kiln_rmsnorm_forward(const float *x, const float *w, double eps, float *out,
                                 float *rstd, int64_t N, int64_t C) {
    for (int64_t n = 0; n < N; n++) {
        const float *row = x + n * C;
        float r = (float)(1.0 / sqrt(kiln_row_dot(row, row, C) / (double)C + eps));
        rstd[n] = r;
        float *o = out + n * C;
        for (int64_t c = 0; c < C; c++) o[c] = (row[c] * r) * w[c];
    }
}

/* dx += ...; partial[C] = the rows' weight gradient, summed in double in row order (written, not added). */
KILN_CLONES
static void kiln_rmsnorm_backward_part(const float *dout, const float *x, const float *w,
                                       const float *rstd, float *dx, double *scratch,
                                       int64_t N, int64_t C) {
    memset(scratch, 0, (size_t)C * sizeof(double));
    for (int64_t n = 0; n < N; n++) {
        const float *g = dout + n * C, *row = x + n * C;
        float r = rstd[n];
        double acc[KILN_LANES] = {0};
        int64_t c = 0;
        for (; c + KILN_LANES <= C; c += KILN_LANES) {
            KILN_SIMD
            for (int j = 0; j < KILN_LANES; j++) {
                scratch[c + j] += (double)(g[c + j] * (row[c + j] * r));
                acc[j] += (double)((g[c + j] * w[c + j]) * row[c + j]);
            }
        }
        double total = 0.0;
        for (int j = 0; j < KILN_LANES; j++) total += acc[j];
        for (; c < C; c++) {
            scratch[c] += (double)(g[c] * (row[c] * r));
            total += (double)((g[c] * w[c]) * row[c]);
        }
        float dot = (float)(total / (double)C);
        float r3dot = (r * r * r) * dot;
        float *d = dx + n * C;
        for (c = 0; c < C; c++) d[c] = d[c] + (r * (g[c] * w[c]) - row[c] * r3dot);
    }
}

/* Rotary positions, rotate-half convention (pairs i and i + D/2), for positions t0..t1-1 of every batch row,
 * between a [B,T,NH,D] view with element strides sb, st, sh (last axis contiguous: a fused projection's output)
 * and a contiguous [B,KV,T,g,D] array (head h at (h / g, h % g)); cos, sin [positions, D/2].
 * Forward (backward = 0) reads the view and writes the array; backward reads the array's gradient and writes
 * the view's, rotating by -angle: a2 * (-s) and - a2 * (-s) are a2 * s negated exactly, so each element is
 * the same rounding as written out separately. */
KILN_CLONES
static void kiln_rope(const float *in, float *out, int64_t sb, int64_t st, int64_t sh, const float *cos,
                      const float *sin, int64_t past, int64_t B, int64_t T, int64_t t0, int64_t t1, int64_t NH,
                      int64_t g, int64_t D, int backward) {
    const int64_t half = D / 2, KV = NH / g, from_view = backward ? 0 : 1;
    const float sign = backward ? -1.0f : 1.0f;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = t0; t < t1; t++) {
            const float *c = cos + (t + past) * half, *s = sin + (t + past) * half;
            for (int64_t h = 0; h < NH; h++) {
                const int64_t view = b * sb + t * st + h * sh, grouped = (((b * KV + h / g) * T + t) * g + h % g) * D;
                /* no branch in the loop (tests/engine/test_kernels_build.py): offsets picked by arithmetic */
                const float *a = in + from_view * view + (1 - from_view) * grouped;
                float *o = out + (1 - from_view) * view + from_view * grouped;
                for (int64_t i = 0; i < half; i++) {
                    const float a1 = a[i], a2 = a[i + half], si = sign * s[i];
                    o[i] = a1 * c[i] - a2 * si;
                    o[i + half] = a2 * c[i] + a1 * si;
                }
            }
        }
}

KILN_CLONES
/* gate_up's rows are ld >= 2F floats apart (a fused projection output may carry adapter columns after them) */
static void kiln_swiglu_forward(const float *gate_up, float *out, int64_t N, int64_t F, int64_t ld) {
    for (int64_t n = 0; n < N; n++) {
        const float *gate = gate_up + n * ld, *up = gate + F;
        float *o = out + n * F;
        for (int64_t i = 0; i < F; i++) o[i] = gate[i] / (1.0f + kiln_expf(-gate[i])) * up[i];
    }
}

KILN_CLONES
/* gate_up's rows are ld floats apart and dgate_up's ld_grad (both >= 2F) */
static void kiln_swiglu_backward(const float *dout, const float *gate_up, float *dgate_up,
                                 int64_t N, int64_t F, int64_t ld, int64_t ld_grad) {
    for (int64_t n = 0; n < N; n++) {
        const float *gate = gate_up + n * ld, *up = gate + F, *d = dout + n * F;
        float *dg = dgate_up + n * ld_grad, *du = dg + F;
        for (int64_t i = 0; i < F; i++) {
            float g = gate[i];
            float sig = 1.0f / (1.0f + kiln_expf(-g));
            dg[i] = d[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
            du[i] = d[i] * g * sig;
        }
    }
}

/* scores [G,R,S] in place -> causal probabilities; row r sees keys 0..past + r/group_size. */
KILN_CLONES
static void kiln_softmax_causal_forward(float *scores, float scale, int64_t G, int64_t R,
                                        int64_t S, int64_t group_size, int64_t past) {
    for (int64_t gr = 0; gr < G * R; gr++) {
        int64_t r = gr % R;
        int64_t visible = past + r / group_size + 1;
        if (visible > S) visible = S;
        float *row = scores + gr * S;
        float mx = kiln_row_max(row, visible) * scale;
        double total = kiln_row_exp_sum(row, row, visible, scale, mx);
        float inv = (float)(1.0 / total);
        for (int64_t j = 0; j < visible; j++) row[j] = row[j] * inv;
        for (int64_t j = visible; j < S; j++) row[j] = 0.0f;
    }
}

KILN_CLONES
static void kiln_softmax_backward(const float *probs, float *dprobs, float scale, int64_t rows,
                                  int64_t S) {
    for (int64_t n = 0; n < rows; n++) {
        const float *p = probs + n * S;
        float *d = dprobs + n * S;
        float dot = (float)kiln_row_dot(p, d, S);
        for (int64_t j = 0; j < S; j++) d[j] = p[j] * (d[j] - dot) * scale;
    }
}

/* logits [N,V] in place -> dlogits * grad_scale (times row_scales[n] when given); losses [N]. */
KILN_CLONES
static void kiln_cross_entropy(float *logits, const int64_t *targets, float *losses,
                               float grad_scale, const float *row_scales, int64_t ignore_index,
                               int64_t N, int64_t V) {
    for (int64_t n = 0; n < N; n++) {
        float *row = logits + n * V;
        int64_t t = targets[n];
        if (t == ignore_index) {
            losses[n] = 0.0f;
            memset(row, 0, (size_t)V * sizeof(float));
            continue;
        }
        float scale = row_scales ? grad_scale * row_scales[n] : grad_scale;
        float target_logit = row[t];
        float mx = kiln_row_max(row, V);
        double total = kiln_row_exp_sum(row, row, V, 1.0f, mx);
        double lse = log(total) + (double)mx;
        losses[n] = (float)(lse - (double)target_logit);
        float inv = (float)((double)scale / total);
        for (int64_t j = 0; j < V; j++) row[j] = row[j] * inv;
        row[t] = row[t] - scale;
    }
}

KILN_CLONES
static void kiln_log_softmax_gather(const float *logits, const int64_t *targets, float *out,
                                    float *scratch, int64_t N, int64_t V) {
    for (int64_t n = 0; n < N; n++) {
        const float *row = logits + n * V;
        float mx = kiln_row_max(row, V);
        double total = kiln_row_exp_sum(row, scratch, V, 1.0f, mx);
        out[n] = (float)((double)row[targets[n]] - (log(total) + (double)mx));
    }
}

KILN_CLONES
static void kiln_adam_update(float *param, const float *grad, float *m, float *v, int64_t n,
                             float b1, float b2, float omb1, float omb2, float wd, int decay,
                             float step_size, float bc2_sqrt, float eps) {
    for (int64_t i = 0; i < n; i++) {
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

/* float32 -> bfloat16 (the upper 16 bits) rounded to nearest, ties to even, as PyTorch's and oneDNN's
 * conversions do; a NaN stays a quiet NaN with its sign. x and out have n elements. */
KILN_CLONES
static void kiln_to_bf16(const float *x, uint16_t *out, int64_t n) {
    KILN_SIMD
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
        uint32_t quiet = (b >> 16) | 0x40u;
        out[i] = (uint16_t)((b & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
    }
}

#endif
