// Host build of kiln_cuda_index.h for the tests: each helper over arrays, called through ctypes
// (g++ -O2 -shared -fPIC index_host.cpp). Not part of libkiln_cuda.so.
#include "kiln_cuda_index.h"

extern "C" {

void kiln_index_tile_end(const int64_t *start, int64_t tile, int64_t n, int64_t *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = kiln_tile_end(start[i], tile, n);
}

void kiln_index_ceil_div(const int64_t *a, int64_t b, int64_t *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = kiln_ceil_div(a[i], b);
}

// mask [R,S] of rows (query position past + r / g) against keys key_start + s
void kiln_index_mask(int64_t R, int64_t S, int64_t g, int64_t past, int64_t key_start, int64_t window,
                     uint8_t *mask) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t s = 0; s < S; s++)
            mask[r * S + s] = (uint8_t)kiln_attention_visible(key_start + s, kiln_query_position(r, g, past), window);
}

void kiln_index_last_key(int64_t S, const int64_t *row_end, int64_t g, int64_t past, int64_t *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = kiln_last_key(S, row_end[i], g, past);
}

void kiln_index_first_row(const int64_t *key_start, int64_t g, int64_t past, int64_t *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = kiln_first_row(key_start[i], g, past);
}

void kiln_index_first_key(const int64_t *row_start, int64_t g, int64_t past, int64_t window, int64_t *out,
                          int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = kiln_first_key(row_start[i], g, past, window);
}

void kiln_index_row_end(const int64_t *key_end, int64_t R, int64_t g, int64_t past, int64_t window, int64_t *out,
                        int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = kiln_row_end(key_end[i], R, g, past, window);
}

// out[b,t,h,d] = the flat [B,KV,T,g,D] index of that element
void kiln_index_rope_out(int64_t B, int64_t T, int64_t KV, int64_t g, int64_t D, int64_t *out) {
    int64_t H = KV * g, i = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t d = 0; d < D; d++) out[i++] = kiln_rope_out_index(b, t, h, d, T, KV, g, D);
}

// out[b,t,h,d] = the flat index of element (b, t, h, d) of a [B,T,H,D] view with strides (b, t, h) and a
// contiguous last axis, from the view's first element
void kiln_index_strided(int64_t B, int64_t T, int64_t H, int64_t D, int64_t stride_b, int64_t stride_t,
                        int64_t stride_h, int64_t *out) {
    int64_t i = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t d = 0; d < D; d++)
                    out[i++] = kiln_strided_index(b, t, h, d, stride_b, stride_t, stride_h);
}

void kiln_index_gqa(const int64_t *head, int64_t g, int64_t *kv_head, int64_t *slot, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        kv_head[i] = kiln_gqa_kv_head(head[i], g);
        slot[i] = kiln_gqa_slot(head[i], g);
    }
}

// for elements start .. start+count-1: their byte, nibble value and absmax block
void kiln_index_nf4(const uint8_t *packed, int64_t start, int64_t count, int64_t block_size, int64_t *byte,
                    int64_t *nibble, int64_t *block) {
    for (int64_t i = 0; i < count; i++) {
        int64_t index = start + i;
        byte[i] = kiln_nf4_byte(index);
        nibble[i] = kiln_nf4_nibble(packed[byte[i]], index);
        block[i] = kiln_nf4_block(index, block_size);
    }
}

// a lone last element is padded with code 7 (0.0), as the quantizer pads a zero
void kiln_index_nf4_pack(const int64_t *codes, int64_t count, uint8_t *packed) {
    for (int64_t i = 0; i < count; i += 2)
        packed[i / 2] = (uint8_t)kiln_nf4_pack((int)codes[i], i + 1 < count ? (int)codes[i + 1] : 7);
}

void kiln_index_absmax_scale(const int64_t *block, int64_t *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = kiln_absmax_scale_index(block[i]);
}

}
