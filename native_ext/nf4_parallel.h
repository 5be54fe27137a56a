/* kiln_nf4_dequantize on several threads of the shared pool (parallel.h): the element range is cut into
 * fixed chunks, each dequantized on its own, so the bytes are those of one call on one thread. */
#include "nf4.h"
#include "parallel.h"

#define KILN_NF4_CHUNK 65536

typedef struct {
    const uint8_t *packed, *absmax_codes;
    const float *absmax, *absmax_scales, *absmax_map;
    float offset;
    int64_t block, start;
    float *out;
} kiln_nf4_ctx;

static void kiln_nf4_dequantize_body(const void *arg, int64_t e0, int64_t e1, int64_t chunk) {
    const kiln_nf4_ctx *c = (const kiln_nf4_ctx *)arg;
    (void)chunk;
    kiln_nf4_dequantize(c->packed, c->absmax, c->absmax_codes, c->absmax_scales, c->absmax_map, c->offset,
                        c->block, c->start + e0, e1 - e0, c->out + e0);
}

static void kiln_nf4_dequantize_parallel(const uint8_t *packed, const float *absmax, const uint8_t *absmax_codes,
                                         const float *absmax_scales, const float *absmax_map, float offset,
                                         int64_t block, int64_t start, int64_t count, float *out, int threads) {
    kiln_nf4_ctx c = {packed, absmax_codes, absmax, absmax_scales, absmax_map, offset, block, start, out};
    kiln_rows(threads, count, KILN_NF4_CHUNK, kiln_nf4_dequantize_body, &c);
}
