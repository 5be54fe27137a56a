/* The index arithmetic of the CUDA kernels (tiles, causal and window masks, GQA head mapping,
 * rotary layouts, NF4 nibbles and blocks) as __host__ __device__ inline functions, so the same code
 * compiles for the host and is tested against numpy (tests/engine/test_cuda_library.py through
 * index_host.cpp). Integers are int64_t everywhere: a flat index of a large weight passes 2^31.
 */
#ifndef KILN_CUDA_INDEX_H
#define KILN_CUDA_INDEX_H

#include <stdint.h>

#ifdef __CUDACC__
#define KILN_HD __host__ __device__ __forceinline__
#else
#define KILN_HD static inline
#endif

/* ceil(a / b) for a >= 0, b > 0 */
KILN_HD int64_t kiln_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* the end of the tile that starts at `start`: min(start + tile, n) */
KILN_HD int64_t kiln_tile_end(int64_t start, int64_t tile, int64_t n) {
    return start + tile < n ? start + tile : n;
}

/* row r of a head group [T*g, D] is query position past + r / g (its g heads sit next to each other) */
KILN_HD int64_t kiln_query_position(int64_t row, int64_t g, int64_t past) { return past + row / g; }

/* key `key` is visible to query position `query` when causal and, with window > 0, within the window */
KILN_HD int kiln_attention_visible(int64_t key, int64_t query, int64_t window) {
    return key <= query && (window <= 0 || query - key < window);
}

/* keys a tile of rows [.., row_end) can see at all: min(S, last query position + 1) */
KILN_HD int64_t kiln_last_key(int64_t S, int64_t row_end, int64_t g, int64_t past) {
    int64_t last = kiln_query_position(row_end - 1, g, past) + 1;
    return last < S ? last : S;
}

/* the first row whose query position reaches key_start (rows before it see none of the keys from key_start on) */
KILN_HD int64_t kiln_first_row(int64_t key_start, int64_t g, int64_t past) {
    return key_start <= past ? 0 : (key_start - past) * g;
}

/* the first key any row from row_start on can see: 0 without a window (window <= 0), else the smallest query
 * position's first key inside the window */
KILN_HD int64_t kiln_first_key(int64_t row_start, int64_t g, int64_t past, int64_t window) {
    int64_t first = kiln_query_position(row_start, g, past) - window + 1;
    return window > 0 && first > 0 ? first : 0;
}

/* the end of the rows that can see any key before key_end: R without a window, else the first row whose window
 * starts at key_end or later (clamped to [0, R]) */
KILN_HD int64_t kiln_row_end(int64_t key_end, int64_t R, int64_t g, int64_t past, int64_t window) {
    if (window <= 0) return R;
    int64_t end = (key_end - 1 + window - past) * g;
    return end < 0 ? 0 : (end < R ? end : R);
}

/* GQA: query head h reads KV head h / g and is slot h % g of that group */
KILN_HD int64_t kiln_gqa_kv_head(int64_t head, int64_t g) { return head / g; }
KILN_HD int64_t kiln_gqa_slot(int64_t head, int64_t g) { return head % g; }

/* the rotary output layout [B,KV,T,g,D]: flat index of (b, t, head, d) */
KILN_HD int64_t kiln_rope_out_index(int64_t b, int64_t t, int64_t head, int64_t d, int64_t T, int64_t KV,
                                    int64_t g, int64_t D) {
    return (((b * KV + kiln_gqa_kv_head(head, g)) * T + t) * g + kiln_gqa_slot(head, g)) * D + d;
}

/* a strided input [B,T,H,D] with a contiguous last axis: flat index of (b, t, head, d) */
KILN_HD int64_t kiln_strided_index(int64_t b, int64_t t, int64_t head, int64_t d, int64_t stride_b,
                                   int64_t stride_t, int64_t stride_h) {
    return b * stride_b + t * stride_t + head * stride_h + d;
}

/* NF4: element i lives in byte i / 2, the high nibble for even i (bitsandbytes' packing) */
KILN_HD int64_t kiln_nf4_byte(int64_t i) { return i >> 1; }
KILN_HD int kiln_nf4_nibble(unsigned byte, int64_t i) { return (i & 1) ? (int)(byte & 15u) : (int)(byte >> 4); }
KILN_HD unsigned kiln_nf4_pack(int first, int second) { return ((unsigned)first << 4) | ((unsigned)second & 15u); }
/* the absmax block of element i, and the second-level (double quantization) scale of an absmax block */
KILN_HD int64_t kiln_nf4_block(int64_t i, int64_t block_size) { return i / block_size; }
KILN_HD int64_t kiln_absmax_scale_index(int64_t block) { return block / 256; }

/* rows of the RMSNorm weight-gradient chunk c: [c * rows, min((c + 1) * rows, N)) */
#define KILN_RMSNORM_CHUNK_ROWS 64

#endif
