/* NF4 block quantization of frozen weights in plain C, called from native_ext/_nf4.pyx.
 *
 * Every function reproduces bitsandbytes 0.50's CPU arithmetic bit for bit (see
 * docs/quantization.md): quantize_4bit(quant_type="nf4") is PyTorch tensor code there,
 * the 8-bit quantizer of double quantization is its C LUT kernel, and the offset is
 * PyTorch's float32 mean. No -ffast-math, no FMA contraction (setup.py), so every clone
 * of a function gives the same bytes. Element positions run over the flattened tensor.
 */
#ifndef KILN_NF4_H
#define KILN_NF4_H
#include "isa.h"
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef KILN_CLONES
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define KILN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KILN_CLONES
#endif
#endif

/* The 16 NF4 codes (bitsandbytes get_4bit_type("nf4")), sorted. */
static const float kiln_nf4_code[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

/* torch clamps a zero absmax to 1e-38 (a float32 subnormal) before taking its reciprocal. */
#define KILN_NF4_TINY 1e-38f
/* Float32 lanes of PyTorch's vectorised sum: its sum kernel has no AVX-512 variant, so x86
 * builds run the AVX2 (or default 256-bit) one, 8 floats wide. */
#define KILN_NF4_SUM_LANES 8
#define KILN_NF4_LUT_SIZE 65536
#define KILN_NF4_ABSMAX_BLOCK 256

/* torch.bucketize(s, midpoints): how many midpoints lie strictly below s (ties go low). */
static inline uint8_t kiln_nf4_nibble(float s, const float *bounds) {
    int q = 0;
    for (int i = 0; i < 15; i++) q += s > bounds[i];
    return (uint8_t)q;
}

/* x [n] -> packed [(n+1)/2] (element 2i in the high nibble of byte i; an odd count pads
 * the last low nibble with the code of 0.0), absmax [ceil(n/block)]. Full blocks are
 * scaled by the reciprocal of max(absmax, 1e-38); a last partial block is divided by it
 * and stores the clamped value, as torch's remainder branch does. Returns -1, or the
 * index of the first non-finite element (then the outputs are incomplete). */
KILN_CLONES
static int64_t kiln_nf4_quantize(const float *x, int64_t n, int64_t block, uint8_t *packed,
                                 float *absmax) {
    float bounds[15];
    for (int i = 0; i < 15; i++) bounds[i] = (kiln_nf4_code[i] + kiln_nf4_code[i + 1]) / 2.0f;
    const uint8_t pad = kiln_nf4_nibble(0.0f, bounds);
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        const int64_t len = n - start < block ? n - start : block;
        const float *xb = x + start;
        uint8_t *pb = packed + start / 2; /* blocks are even-sized: start is even */
        float m = 0.0f;
        int finite = 1;
        for (int64_t i = 0; i < len; i++) {
            float a = fabsf(xb[i]);
            finite &= a <= FLT_MAX;
            m = a > m ? a : m;
        }
        if (!finite) {
            for (int64_t i = 0; i < len; i++)
                if (!(fabsf(xb[i]) <= FLT_MAX)) return start + i;
        }
        const float clamped = m < KILN_NF4_TINY ? KILN_NF4_TINY : m;
        const int64_t pairs = len / 2;
        if (len == block) {
            absmax[b] = m;
            const float r = 1.0f / clamped;
            for (int64_t j = 0; j < pairs; j++)
                pb[j] = (uint8_t)(kiln_nf4_nibble(xb[2 * j] * r, bounds) << 4 |
                                  kiln_nf4_nibble(xb[2 * j + 1] * r, bounds));
        } else {
            absmax[b] = clamped;
            for (int64_t j = 0; j < pairs; j++)
                pb[j] = (uint8_t)(kiln_nf4_nibble(xb[2 * j] / clamped, bounds) << 4 |
                                  kiln_nf4_nibble(xb[2 * j + 1] / clamped, bounds));
            if (len & 1)
                pb[pairs] = (uint8_t)(kiln_nf4_nibble(xb[len - 1] / clamped, bounds) << 4 | pad);
        }
    }
    return -1;
}

/* The pairs of a block: out[2j] = code(high nibble of p[j]) * s, out[2j+1] = code(low nibble) * s.
 * A table lookup and one float multiply per element, so every version below gives the same bytes;
 * the x86 ones look the 16 codes up in registers (one AVX-512 permute, or two AVX2 permutes and a
 * blend) where GCC's vectoriser would gather from memory, several times slower. */
static void kiln_nf4_pairs_portable(const uint8_t *p, int64_t pairs, float s, float *o) {
    for (int64_t j = 0; j < pairs; j++) {
        o[2 * j] = kiln_nf4_code[p[j] >> 4] * s;
        o[2 * j + 1] = kiln_nf4_code[p[j] & 15] * s;
    }
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
#define KILN_NF4_X86 1

/* 16 bytes -> their 32 nibbles in element order (high nibble first), one per byte. */
__attribute__((target("sse2")))
static inline void kiln_nf4_nibbles(__m128i bytes, __m128i *first, __m128i *second) {
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m128i low = _mm_and_si128(bytes, mask);
    *first = _mm_unpacklo_epi8(high, low);  /* bytes 0..7 */
    *second = _mm_unpackhi_epi8(high, low); /* bytes 8..15 */
}

__attribute__((target("avx512f")))
static void kiln_nf4_pairs_avx512(const uint8_t *p, int64_t pairs, float s, float *o) {
    const __m512 table = _mm512_loadu_ps(kiln_nf4_code);
    const __m512 scale = _mm512_set1_ps(s);
    int64_t j = 0;
    for (; j + 16 <= pairs; j += 16) {
        __m128i first, second;
        kiln_nf4_nibbles(_mm_loadu_si128((const __m128i *)(p + j)), &first, &second);
        _mm512_storeu_ps(o + 2 * j, _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(first), table), scale));
        _mm512_storeu_ps(o + 2 * j + 16,
                         _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(second), table), scale));
    }
    kiln_nf4_pairs_portable(p + j, pairs - j, s, o + 2 * j);
}

__attribute__((target("avx2")))
static inline __m256 kiln_nf4_codes8(__m128i nibbles, __m256 low_codes, __m256 high_codes) {
    const __m256i index = _mm256_cvtepu8_epi32(nibbles); /* the first 8 nibbles */
    const __m256 low = _mm256_permutevar8x32_ps(low_codes, index);   /* codes 0..7 by the low 3 bits */
    const __m256 high = _mm256_permutevar8x32_ps(high_codes, index); /* codes 8..15 */
    return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(index, 28))); /* bit 3 */
}

__attribute__((target("avx2")))
static void kiln_nf4_pairs_avx2(const uint8_t *p, int64_t pairs, float s, float *o) {
    const __m256 low_codes = _mm256_loadu_ps(kiln_nf4_code);
    const __m256 high_codes = _mm256_loadu_ps(kiln_nf4_code + 8);
    const __m256 scale = _mm256_set1_ps(s);
    int64_t j = 0;
    for (; j + 16 <= pairs; j += 16) {
        __m128i first, second;
        kiln_nf4_nibbles(_mm_loadu_si128((const __m128i *)(p + j)), &first, &second);
        _mm256_storeu_ps(o + 2 * j, _mm256_mul_ps(kiln_nf4_codes8(first, low_codes, high_codes), scale));
        _mm256_storeu_ps(o + 2 * j + 8,
                         _mm256_mul_ps(kiln_nf4_codes8(_mm_srli_si128(first, 8), low_codes, high_codes), scale));
        _mm256_storeu_ps(o + 2 * j + 16, _mm256_mul_ps(kiln_nf4_codes8(second, low_codes, high_codes), scale));
        _mm256_storeu_ps(o + 2 * j + 24,
                         _mm256_mul_ps(kiln_nf4_codes8(_mm_srli_si128(second, 8), low_codes, high_codes), scale));
    }
    kiln_nf4_pairs_portable(p + j, pairs - j, s, o + 2 * j);
}
#endif

typedef void (*kiln_nf4_pairs_fn)(const uint8_t *, int64_t, float, float *);

/* The version this CPU runs, chosen once: KILN_NF4_PAIRS=portable|avx2|avx512 asks for one (tests). */
static kiln_nf4_pairs_fn kiln_nf4_pairs_version(void) {
    static kiln_nf4_pairs_fn chosen = NULL;
    if (chosen) return chosen;
#ifdef KILN_NF4_X86
    static const kiln_nf4_pairs_fn versions[] = {kiln_nf4_pairs_portable, kiln_nf4_pairs_avx2, kiln_nf4_pairs_avx512};
    chosen = versions[kiln_isa_pick("KILN_NF4_PAIRS", 0)];
#else
    chosen = kiln_nf4_pairs_portable;
#endif
    return chosen;
}

/* out [count] = elements start .. start+count-1 of the dequantized tensor, block by block:
 * code * scale, where scale is absmax[b], or with double quantization (absmax == NULL)
 * (absmax_map[absmax_codes[b]] * absmax_scales[b / 256]) + offset, two float roundings as
 * in bitsandbytes' dequantize_blockwise followed by `absmax += offset`. */
KILN_CLONES
static void kiln_nf4_dequantize(const uint8_t *packed, const float *absmax,
                                const uint8_t *absmax_codes, const float *absmax_scales,
                                const float *absmax_map, float offset, int64_t block,
                                int64_t start, int64_t count, float *out) {
    const kiln_nf4_pairs_fn pairs_of = kiln_nf4_pairs_version();
    const int64_t end = start + count;
    int64_t e = start;
    float *o = out;
    while (e < end) {
        const int64_t b = e / block;
        const int64_t stop = (b + 1) * block < end ? (b + 1) * block : end;
        float s;
        if (absmax) {
            s = absmax[b];
        } else {
            float decoded = absmax_map[absmax_codes[b]] * absmax_scales[b / KILN_NF4_ABSMAX_BLOCK];
            s = decoded + offset;
        }
        if (e & 1) { /* a row may start on a low nibble */
            *o++ = kiln_nf4_code[packed[e >> 1] & 15] * s;
            e++;
        }
        const uint8_t *p = packed + (e >> 1);
        const int64_t pairs = (stop - e) / 2;
        pairs_of(p, pairs, s, o);
        o += 2 * pairs;
        e += 2 * pairs;
        if (e < stop) { /* ... and end on a high one */
            *o++ = kiln_nf4_code[packed[e >> 1] >> 4] * s;
            e++;
        }
    }
}

/* ATen's CeilLog2: 1 for x <= 2, else ceil(log2(x)). */
static inline int64_t kiln_nf4_ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) bits++;
    return bits;
}

/* ATen's multi_row_sum with nrows = 4 over `size` rows, each 4 elements of `lanes` floats
 * (row i at data + 4*lanes*i): a four-level cascade whose level width grows with size.
 * out [4*lanes] = the four row sums. */
static void kiln_nf4_cascade(const float *data, int64_t size, int lanes, float *out) {
    enum { W = 4 * KILN_NF4_SUM_LANES };
    float acc[4][W];
    const int width = 4 * lanes;
    memset(acc, 0, sizeof(acc));
    int64_t power = kiln_nf4_ceil_log2(size) / 4;
    if (power < 4) power = 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < width; k++) acc[0][k] += data[i * width + k];
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < width; k++) {
                acc[j][k] += acc[j - 1][k];
                acc[j - 1][k] = 0.0f;
            }
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < width; k++) acc[0][k] += data[i * width + k];
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < width; k++) acc[0][k] += acc[j][k];
    memcpy(out, acc[0], (size_t)width * sizeof(float));
}

/* ATen's row_sum: `count` elements of `lanes` floats, four interleaved partial sums. */
static void kiln_nf4_row_sum(const float *data, int64_t count, int lanes, float *out) {
    float part[4 * KILN_NF4_SUM_LANES];
    const int64_t rows = count / 4;
    kiln_nf4_cascade(data, rows, lanes, part);
    for (int64_t i = rows * 4; i < count; i++)
        for (int l = 0; l < lanes; l++) part[l] += data[i * lanes + l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < lanes; l++) part[l] += part[k * lanes + l];
    memcpy(out, part, (size_t)lanes * sizeof(float));
}

/* torch.mean of a contiguous float32 vector on one thread: the cascade sum of
 * vectorized_inner_sum (8-float vectors, the scalar tail first, then the lanes in order;
 * plain row_sum below 8 elements), then sum / n in float32. */
static float kiln_nf4_torch_mean(const float *x, int64_t n) {
    float total;
    if (n >= KILN_NF4_SUM_LANES) {
        const int64_t vectors = n / KILN_NF4_SUM_LANES;
        float lanes[KILN_NF4_SUM_LANES];
        kiln_nf4_row_sum(x, vectors, KILN_NF4_SUM_LANES, lanes);
        total = 0.0f;
        for (int64_t k = vectors * KILN_NF4_SUM_LANES; k < n; k++) total += x[k];
        for (int l = 0; l < KILN_NF4_SUM_LANES; l++) total += lanes[l];
    } else {
        kiln_nf4_row_sum(x, n, 1, &total);
    }
    total = 0.0f + total; /* the output starts at 0 and is accumulated into */
    return total / (float)n;
}

/* bitsandbytes' norm_to_lut_index: clamp to [-1, 1] (NaN passes), then
 * trunc(fmaf((v + 1) * 0.5, 65535, 0.5)) to 16 bits. (v + 1) * 0.5 is a multiple of
 * 2^-25 below 1, so the double product and sum are exact and the float cast is the one
 * rounding fmaf makes. NaN converts to 0x80000000 there, whose low 16 bits are 0. */
static inline int kiln_nf4_lut_index(float v) {
    if (v < -1.0f) v = -1.0f;
    else if (v > 1.0f) v = 1.0f;
    float t = (v + 1.0f) * 0.5f;
    float r = (float)((double)t * 65535.0 + 0.5);
    if (r != r) return 0;
    return (int)r & 0xFFFF;
}

/* bitsandbytes' quantize LUT: entry i is the code for the grid value 2i/65535 - 1, found
 * by walking the midpoints of the sorted 256-entry map (ties go low). lut [65536]. */
static void kiln_nf4_build_lut(const float *map, uint8_t *lut) {
    float mid[255];
    for (int i = 0; i < 255; i++) mid[i] = (map[i] + map[i + 1]) * 0.5f;
    int c = 0;
    for (int i = 0; i < KILN_NF4_LUT_SIZE; i++) {
        float v = (2.0f * (float)i) / 65535.0f - 1.0f;
        while (c < 255 && mid[c] < v) c++;
        lut[i] = (uint8_t)c;
    }
}

/* Double quantization of absmax [n]: d = absmax - offset, then bitsandbytes'
 * quantize_blockwise (blocks of 256, signed dynamic map): scales [ceil(n/256)] = max |d|
 * per block; codes [n] = lut[index(d * (1 / scale))], 0 for a block whose scale is 0.
 * lut [65536] is scratch. */
static void kiln_nf4_quantize_absmax(const float *absmax, int64_t n, float offset,
                                     const float *map, uint8_t *lut, uint8_t *codes,
                                     float *scales) {
    kiln_nf4_build_lut(map, lut);
    for (int64_t start = 0, b = 0; start < n; start += KILN_NF4_ABSMAX_BLOCK, b++) {
        const int64_t len = n - start < KILN_NF4_ABSMAX_BLOCK ? n - start : KILN_NF4_ABSMAX_BLOCK;
        float m = 0.0f;
        for (int64_t i = 0; i < len; i++) {
            float a = fabsf(absmax[start + i] - offset);
            m = a > m ? a : m;
        }
        scales[b] = m;
        if (m == 0.0f) {
            memset(codes + start, 0, (size_t)len);
            continue;
        }
        const float inv = 1.0f / m;
        for (int64_t i = 0; i < len; i++)
            codes[start + i] = lut[kiln_nf4_lut_index((absmax[start + i] - offset) * inv)];
    }
}

#endif
