/* The attention's row work written once, over a chunk of 16 lanes: attention_rows.h defines the chunk and its
 * operations for each instruction set (kiln_chunk_<isa>, kiln_sums_<isa>, kiln_chunk_load_<isa>, ...), then
 * includes this file with KILN_ROWS_ISA (the suffix) and KILN_ROWS_TARGET (a target attribute, or nothing)
 * defined. No include guard, on purpose. */
#define KILN_ROWS_CAT2(name, isa) name##_##isa
#define KILN_ROWS_CAT(name, isa) KILN_ROWS_CAT2(name, isa)
#define KILN_R(name) KILN_ROWS_CAT(name, KILN_ROWS_ISA)

/* One key block of the online softmax: each row's maximum over its visible scores (times scale) joins
 * running_max, the scores become exp(score * scale - max) (0 where not visible), their sum joins running_sum,
 * and alpha is the factor the rows' earlier accumulators are rescaled by. Three passes over the rows, so that no
 * row waits on the one before: the block maxima (in alpha), the running maxima and alphas, then the
 * exponentials and their sums. A chunk wholly visible skips the masking (keeping every lane is no change). */
KILN_ROWS_TARGET
static void KILN_R(kiln_rows_flash_forward)(float *tile, int64_t ld, float *running_max, float *running_sum,
                                            float *alpha, float scale, int64_t rows, int64_t width, int64_t g,
                                            int64_t first_query, int64_t key_start) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        const float *row = tile + r * ld;
        KILN_R(kiln_chunk) m = KILN_R(kiln_chunk_set1)(-INFINITY);
        int64_t c = 0;
        for (; c + KILN_LANES <= visible; c += KILN_LANES)
            m = KILN_R(kiln_chunk_max)(KILN_R(kiln_chunk_load)(row + c), m);
        if (c < visible) m = KILN_R(kiln_chunk_max)(KILN_R(kiln_chunk_visible)(row + c, visible - c), m);
        alpha[r] = visible > 0 ? KILN_R(kiln_chunk_max_tree)(m) * scale : -INFINITY;
    }
    for (int64_t r = 0; r < rows; r++) running_max[r] = kiln_rows_join_max(alpha[r], running_max[r], alpha + r);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        float *row = tile + r * ld;
        const float shift = kiln_rows_shift(running_max[r]);
        KILN_R(kiln_sums) sums = KILN_R(kiln_sums_zero)();
        for (int64_t c = 0; c < width; c += KILN_LANES) {
            KILN_R(kiln_chunk) p = KILN_R(kiln_chunk_set1)(0.0f);
            if (visible > c) {
                p = KILN_R(kiln_chunk_exp)(KILN_R(kiln_chunk_load)(row + c), scale, shift);
                if (visible - c < KILN_LANES) p = KILN_R(kiln_chunk_keep)(p, visible - c);
                sums = KILN_R(kiln_sums_add)(sums, p);
            }
            KILN_R(kiln_chunk_store)(row + c, p);
        }
        running_sum[r] = running_sum[r] * alpha[r] + (float)KILN_R(kiln_sums_tree)(sums);
    }
}

/* One key block of the backward: the probabilities recomputed from the forward's logsumexp,
 * P = exp(score * scale - lse) into tile, and dS = P * (dP - delta) * scale into dtile (rows ld apart in
 * both), 0 where not visible. */
KILN_ROWS_TARGET
static void KILN_R(kiln_rows_flash_backward)(float *tile, float *dtile, int64_t ld, const float *logsumexp,
                                             const float *delta, float scale, int64_t rows, int64_t width,
                                             int64_t g, int64_t first_query, int64_t key_start) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t visible = kiln_rows_visible(r, width, g, first_query, key_start);
        float *row = tile + r * ld, *d = dtile + r * ld;
        for (int64_t c = 0; c < width; c += KILN_LANES) {
            KILN_R(kiln_chunk) p = KILN_R(kiln_chunk_set1)(0.0f), ds = p;
            if (visible > c) {
                p = KILN_R(kiln_chunk_exp)(KILN_R(kiln_chunk_load)(row + c), scale, logsumexp[r]);
                ds = KILN_R(kiln_chunk_softmax_grad)(p, KILN_R(kiln_chunk_load)(d + c), delta[r], scale);
                if (visible - c < KILN_LANES) {
                    p = KILN_R(kiln_chunk_keep)(p, visible - c);
                    ds = KILN_R(kiln_chunk_keep)(ds, visible - c);
                }
            }
            KILN_R(kiln_chunk_store)(row + c, p);
            KILN_R(kiln_chunk_store)(d + c, ds);
        }
    }
}

#undef KILN_R
#undef KILN_ROWS_CAT
#undef KILN_ROWS_CAT2
