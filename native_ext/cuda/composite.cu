// Host orchestrations of cuBLAS GEMMs and kernels, all on the handle's stream: the fused linear
// cross-entropy (chunk by chunk, never the whole [N,V] logits), the NF4 linear (dequantize a tile of
// weight rows, multiply, next tile) and the LoRA pair. Row-major throughout (kiln_cuda_gemm).
#include "kiln_cuda_internal.h"

extern "C" {

int kiln_cuda_fused_linear_cross_entropy(void *blas, const float *hidden, const float *weight,
                                         const int64_t *targets, int64_t N, int64_t C, int64_t V, int64_t chunk,
                                         int mode, float grad_scale, const float *row_scales, int64_t ignore_index,
                                         float *per_row, float *dhidden, float *dhead, float *logits, int precision) {
    KilnBlas *handle = (KilnBlas *)blas;
    KILN_REQUIRE(handle, "no cuBLAS handle");
    KILN_REQUIRE(chunk > 0 && N >= 0 && C > 0 && V > 0, "chunk, C and V must be positive, N >= 0");
    KILN_REQUIRE(mode >= 0 && mode <= 2, "mode must be 0 (log p), 1 (grad_scale) or 2 (row_scales)");
    KILN_REQUIRE(mode == 0 || dhidden, "a backward mode needs dhidden");
    KILN_REQUIRE(mode != 0 || !dhead, "a head gradient needs mode 1 or 2");
    KILN_REQUIRE(logits, "the logits workspace [chunk,V] is required");
    for (int64_t start = 0; start < N; start += chunk) {
        int64_t n = kiln_tile_end(start, chunk, N) - start;
        const float *rows = hidden + start * C;
        // logits [n,V] = hidden[rows] [n,C] @ weight^T [C,V]
        KILN_TRY(kiln_cuda_gemm(blas, 0, 1, n, V, C, 1.0f, rows, C, weight, C, 0.0f, logits, V, precision));
        KILN_TRY(kiln_cuda_cross_entropy_rows(logits, targets + start, per_row + start, mode, grad_scale,
                                              row_scales ? row_scales + start : nullptr, ignore_index, n, V,
                                              handle->stream));
        if (mode == 0) continue;
        // dhidden[rows] [n,C] = dlogits [n,V] @ weight [V,C]
        KILN_TRY(kiln_cuda_gemm(blas, 0, 0, n, C, V, 1.0f, logits, V, weight, C, 0.0f, dhidden + start * C, C,
                                precision));
        // dhead [V,C] += dlogits^T [V,n] @ hidden[rows] [n,C]
        if (dhead)
            KILN_TRY(kiln_cuda_gemm(blas, 1, 0, V, C, n, 1.0f, logits, V, rows, C, 1.0f, dhead, C, precision));
    }
    return 0;
}

int kiln_cuda_nf4_linear(void *blas, const float *x, const uint8_t *packed, const float *absmax,
                         int64_t block_size, float *out, float beta, float *tile, int64_t tile_rows, int64_t N,
                         int64_t K, int64_t M, int precision) {
    KilnBlas *handle = (KilnBlas *)blas;
    KILN_REQUIRE(handle, "no cuBLAS handle");
    KILN_REQUIRE(tile && tile_rows > 0 && N >= 0 && K > 0 && M > 0, "tile_rows, K, M positive, N >= 0, a tile");
    for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
        int64_t rows = kiln_tile_end(m0, tile_rows, M) - m0;
        // tile [rows,K] = W[m0:m0+rows] (flat elements m0*K ..), then out[:, m0:m0+rows] = x @ tile^T
        KILN_TRY(kiln_cuda_nf4_dequantize(packed, absmax, tile, m0 * K, rows * K, block_size, handle->stream));
        KILN_TRY(kiln_cuda_gemm(blas, 0, 1, N, rows, K, 1.0f, x, K, tile, K, beta, out + m0, M, precision));
    }
    return 0;
}

int kiln_cuda_lora_forward(void *blas, const float *x, const float *A, const float *B, float scaling, float *xa,
                           float *out, int64_t N, int64_t K, int64_t M, int64_t r, int precision) {
    KILN_REQUIRE(r > 0, "the LoRA rank must be positive");
    // xa [N,r] = x [N,K] @ A^T [K,r]; out [N,M] += scaling * xa @ B^T [r,M]
    KILN_TRY(kiln_cuda_gemm(blas, 0, 1, N, r, K, 1.0f, x, K, A, K, 0.0f, xa, r, precision));
    KILN_TRY(kiln_cuda_gemm(blas, 0, 1, N, M, r, scaling, xa, r, B, r, 1.0f, out, M, precision));
    return 0;
}

int kiln_cuda_lora_backward(void *blas, const float *x, const float *A, const float *B, const float *xa,
                            const float *dout, float scaling, float *dA, float *dB, float *dx, float *dxa, int64_t N,
                            int64_t K, int64_t M, int64_t r, int precision) {
    KILN_REQUIRE(r > 0, "the LoRA rank must be positive");
    // dB [M,r] += scaling * dout^T [M,N] @ xa [N,r]
    KILN_TRY(kiln_cuda_gemm(blas, 1, 0, M, r, N, scaling, dout, M, xa, r, 1.0f, dB, r, precision));
    // dxa [N,r] = scaling * dout [N,M] @ B [M,r]
    KILN_TRY(kiln_cuda_gemm(blas, 0, 0, N, r, M, scaling, dout, M, B, r, 0.0f, dxa, r, precision));
    // dA [r,K] += dxa^T [r,N] @ x [N,K]
    KILN_TRY(kiln_cuda_gemm(blas, 1, 0, r, K, N, 1.0f, dxa, r, x, K, 1.0f, dA, K, precision));
    // dx [N,K] += dxa [N,r] @ A [r,K]
    if (dx) KILN_TRY(kiln_cuda_gemm(blas, 0, 0, N, K, r, 1.0f, dxa, r, A, K, 1.0f, dx, K, precision));
    return 0;
}

}  // extern "C"
