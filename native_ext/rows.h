/* The row kernels of kiln_kernels.h on several threads: rows cut into fixed chunks, taken by the
 * threads of native_ext/pool.h's pool in any order. A chunk writes only its own rows, and where rows are
 * reduced (RMSNorm's weight gradient) each chunk keeps its own partial sum and the partials are added in
 * chunk order: chunk sizes are constants, so the bytes are the same for every thread count.
 *
 * The pool lives in native_ext._attention (one pool per process, shared with OpenBLAS): native_ext.kernels
 * hands its kiln_pool_run here at import (kiln_rows_use_pool); without it every kernel runs on one thread.
 */
#include "kiln_kernels.h"
#include "parallel.h"

#include <stdlib.h>

/* rows per chunk: RMSNorm's chunk also fixes where its weight gradient's partial sums are cut */
#define KILN_ROWS_CHUNK 16
#define KILN_RMSNORM_CHUNK 64
#define KILN_LOSS_CHUNK 2

typedef struct {
    const float *x, *w, *dout, *rstd_in;
    float *out, *rstd, *dx;
    double *partials;
    double eps;
    int64_t C;
} kiln_rmsnorm_ctx;

static void kiln_rmsnorm_forward_body(const void *arg, int64_t r0, int64_t r1, int64_t chunk) {
    const kiln_rmsnorm_ctx *c = (const kiln_rmsnorm_ctx *)arg;
    (void)chunk;
    kiln_rmsnorm_forward(c->x + r0 * c->C, c->w, c->eps, c->out + r0 * c->C, c->rstd + r0, r1 - r0, c->C);
}

static void kiln_rmsnorm_forward_rows(const float *x, const float *w, double eps, float *out, float *rstd,
                                      int64_t N, int64_t C, int threads) {
    kiln_rmsnorm_ctx c = {x, w, NULL, NULL, out, rstd, NULL, NULL, eps, C};
    kiln_rows(threads, N, KILN_ROWS_CHUNK, kiln_rmsnorm_forward_body, &c);
}

static void kiln_rmsnorm_backward_body(const void *arg, int64_t r0, int64_t r1, int64_t chunk) {
    const kiln_rmsnorm_ctx *c = (const kiln_rmsnorm_ctx *)arg;
    kiln_rmsnorm_backward_part(c->dout + r0 * c->C, c->x + r0 * c->C, c->w, c->rstd_in + r0, c->dx + r0 * c->C,
                               c->partials + chunk * c->C, r1 - r0, c->C);
}

/* dx += ..., dw += the chunks' partial sums added in chunk order; -1 when out of memory (nothing done). */
static int kiln_rmsnorm_backward_rows(const float *dout, const float *x, const float *w, const float *rstd,
                                      float *dx, float *dw, int64_t N, int64_t C, int threads) {
    const int64_t chunks = (N + KILN_RMSNORM_CHUNK - 1) / KILN_RMSNORM_CHUNK;
    double *partials = (double *)malloc(sizeof(double) * chunks * C);
    if (partials == NULL) return -1;
    kiln_rmsnorm_ctx c = {x, w, dout, rstd, NULL, NULL, dx, partials, 0.0, C};
    kiln_rows(threads, N, KILN_RMSNORM_CHUNK, kiln_rmsnorm_backward_body, &c);
    for (int64_t j = 0; j < C; j++) {
        double total = partials[j];
        for (int64_t i = 1; i < chunks; i++) total += partials[i * C + j];
        dw[j] = dw[j] + (float)total;
    }
    free(partials);
    return 0;
}

typedef struct {
    const float *gate_up, *dout;
    float *out, *dgate_up;
    int64_t F, ld, ld_grad; /* row strides of gate_up and dgate_up, in floats */
} kiln_swiglu_ctx;

static void kiln_swiglu_forward_body(const void *arg, int64_t r0, int64_t r1, int64_t chunk) {
    const kiln_swiglu_ctx *c = (const kiln_swiglu_ctx *)arg;
    (void)chunk;
    kiln_swiglu_forward(c->gate_up + r0 * c->ld, c->out + r0 * c->F, r1 - r0, c->F, c->ld);
}

static void kiln_swiglu_backward_body(const void *arg, int64_t r0, int64_t r1, int64_t chunk) {
    const kiln_swiglu_ctx *c = (const kiln_swiglu_ctx *)arg;
    (void)chunk;
    kiln_swiglu_backward(c->dout + r0 * c->F, c->gate_up + r0 * c->ld, c->dgate_up + r0 * c->ld_grad, r1 - r0,
                         c->F, c->ld, c->ld_grad);
}

static void kiln_swiglu_forward_rows(const float *gate_up, float *out, int64_t N, int64_t F, int64_t ld,
                                     int threads) {
    kiln_swiglu_ctx c = {gate_up, NULL, out, NULL, F, ld, 0};
    kiln_rows(threads, N, KILN_ROWS_CHUNK, kiln_swiglu_forward_body, &c);
}

static void kiln_swiglu_backward_rows(const float *dout, const float *gate_up, float *dgate_up, int64_t N,
                                      int64_t F, int64_t ld, int64_t ld_grad, int threads) {
    kiln_swiglu_ctx c = {gate_up, dout, NULL, dgate_up, F, ld, ld_grad};
    kiln_rows(threads, N, KILN_ROWS_CHUNK, kiln_swiglu_backward_body, &c);
}

typedef struct {
    float *logits;
    const int64_t *targets;
    float *losses;
    float grad_scale;
    const float *row_scales;
    int64_t ignore_index, V;
} kiln_loss_ctx;

static void kiln_cross_entropy_body(const void *arg, int64_t r0, int64_t r1, int64_t chunk) {
    const kiln_loss_ctx *c = (const kiln_loss_ctx *)arg;
    (void)chunk;
    kiln_cross_entropy(c->logits + r0 * c->V, c->targets + r0, c->losses + r0, c->grad_scale,
                       c->row_scales ? c->row_scales + r0 : NULL, c->ignore_index, r1 - r0, c->V);
}

static void kiln_cross_entropy_rows(float *logits, const int64_t *targets, float *losses, float grad_scale,
                                    const float *row_scales, int64_t ignore_index, int64_t N, int64_t V,
                                    int threads) {
    kiln_loss_ctx c = {logits, targets, losses, grad_scale, row_scales, ignore_index, V};
    kiln_rows(threads, N, KILN_LOSS_CHUNK, kiln_cross_entropy_body, &c);
}

typedef struct {
    const float *x, *cos, *sin;
    float *out;
    int64_t sb, st, sh, past, B, T, NH, g, D;
} kiln_rope_ctx;

static void kiln_rope_forward_body(const void *arg, int64_t t0, int64_t t1, int64_t chunk) {
    const kiln_rope_ctx *c = (const kiln_rope_ctx *)arg;
    (void)chunk;
    kiln_rope(c->x, c->out, c->sb, c->st, c->sh, c->cos, c->sin, c->past, c->B, c->T, t0, t1, c->NH, c->g, c->D, 0);
}

static void kiln_rope_backward_body(const void *arg, int64_t t0, int64_t t1, int64_t chunk) {
    const kiln_rope_ctx *c = (const kiln_rope_ctx *)arg;
    (void)chunk;
    kiln_rope(c->x, c->out, c->sb, c->st, c->sh, c->cos, c->sin, c->past, c->B, c->T, t0, t1, c->NH, c->g, c->D, 1);
}

/* Rotary positions over positions in chunks (every batch row of a chunk's positions together). */
static void kiln_rope_forward_rows(const float *x, int64_t sb, int64_t st, int64_t sh, const float *cos,
                                   const float *sin, int64_t past, float *out, int64_t B, int64_t T, int64_t NH,
                                   int64_t g, int64_t D, int threads) {
    kiln_rope_ctx c = {x, cos, sin, out, sb, st, sh, past, B, T, NH, g, D};
    kiln_rows(threads, T, KILN_ROWS_CHUNK, kiln_rope_forward_body, &c);
}

static void kiln_rope_backward_rows(const float *dout, const float *cos, const float *sin, int64_t past, float *dx,
                                    int64_t sb, int64_t st, int64_t sh, int64_t B, int64_t T, int64_t NH,
                                    int64_t g, int64_t D, int threads) {
    kiln_rope_ctx c = {dout, cos, sin, dx, sb, st, sh, past, B, T, NH, g, D};
    kiln_rows(threads, T, KILN_ROWS_CHUNK, kiln_rope_backward_body, &c);
}

/* Adam over its elements in chunks: every element's update reads and writes only that element (and the
 * kernel is built with -ffp-contract=off, so its vector and scalar loops round alike), so the bytes are those of
 * one pass for every thread count. KILN_ADAM_CHUNK elements (256 KiB of each array) per chunk. */
#define KILN_ADAM_CHUNK 65536

typedef struct {
    float *param, *m, *v;
    const float *grad;
    float b1, b2, omb1, omb2, wd, step_size, bc2_sqrt, eps;
    int decay;
} kiln_adam_ctx;

static void kiln_adam_body(const void *arg, int64_t i0, int64_t i1, int64_t chunk) {
    const kiln_adam_ctx *c = (const kiln_adam_ctx *)arg;
    (void)chunk;
    kiln_adam_update(c->param + i0, c->grad + i0, c->m + i0, c->v + i0, i1 - i0, c->b1, c->b2, c->omb1, c->omb2,
                     c->wd, c->decay, c->step_size, c->bc2_sqrt, c->eps);
}

static void kiln_adam_update_rows(float *param, const float *grad, float *m, float *v, int64_t n, float b1, float b2,
                                  float omb1, float omb2, float wd, int decay, float step_size, float bc2_sqrt,
                                  float eps, int threads) {
    kiln_adam_ctx c = {param, m, v, grad, b1, b2, omb1, omb2, wd, step_size, bc2_sqrt, eps, decay};
    kiln_rows(threads, n, KILN_ADAM_CHUNK, kiln_adam_body, &c);
}
