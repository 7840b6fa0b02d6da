// The LM head's block-int8 rows in q8_rows.c's x16 layout x float32 activations on AMX-INT8
// tiles: the same bits as q8_rows.c's kernel (q8_x16_matmul), faster from about 16 rows, on
// the one copy of the head the x16 kernel and its argmax read.
//
// q8_rows.c stores, per group of 16 vocabulary rows and block of 32 columns, 8 vectors of 64
// bytes, vector t holding codes 4t .. 4t + 3 of each of the 16 rows: that is an AMX B tile
// for K = 32 as it lies in memory (row kq: 4 consecutive codes of each of 16 output rows),
// signed, as `tdpbssd` takes them. Each activation row is rounded as q8_rows.c rounds it, to
// two int8 parts per block (x ~ e * (254 q1 + q2); the same `quantize_row_2x8` (simd.h),
// the same operations), so a block's two tile products are the integer dots the x16 kernel
// adds up, 254 * dot(c, q1) + dot(c, q2) exact in int32, and each block is scaled with its
// fused multiply-add, blocks in the same order:
//     y += (254 dot1 + dot2) * (d * e)
// A row's logits are therefore the same bits here as on the x16 kernel, in any batch.

#include "amx.h"
#include "simd.h"

#include <math.h>
#include <stdlib.h>

#define Q8X_QK 32
#define Q8X_ROWS 16
#define Q8X_ROW_BLOCK 128  // activation rows per work item

// tmm0, 1: C of q1, q2 (even blocks), tmm2, 3 (odd blocks); tmm4, 5: A (q1, q2 rows x 32
// bytes); tmm6: B (8 rows x 64 bytes)
static void configure_q8x16(int rows) {
    const int r[8] = {rows, rows, rows, rows, rows, rows, 8, 0};
    const int colsb[8] = {64, 64, 64, 64, 32, 32, 64, 0};
    amx_configure(r, colsb);
}

#define Q8X16_BLOCK_DOTS(c1, c2, q1, q2, two, K, codes) \
    do {                                                \
        _tile_zero(c1);                                 \
        _tile_loadd(4, q1, K);                          \
        _tile_loadd(6, codes, 64);                      \
        _tile_dpbssd(c1, 4, 6);                         \
        if (two) {                                      \
            _tile_zero(c2);                             \
            _tile_loadd(5, q2, K);                      \
            _tile_dpbssd(c2, 5, 6);                     \
        }                                               \
    } while (0)

// sum[0 .. rows) = one group's 16 outputs for <= 16 activation rows (q1, q2 at row stride K):
// sum_b (254 dot(c, q1) + dot(c, q2)) * (d * e), blocks in order; `two` 0 (a constant once
// inlined), the first part alone, sum_b dot(c, q1) * (d * e) (the argmax's first pass, whose
// e is 254 e)
static inline __attribute__((always_inline)) void group_sums(
    const int8_t *codes, const float *scales, int64_t nb, int64_t K, const int8_t *q1,
    const int8_t *q2, int two, const float *e, int rows, __m512 *sum) {
    int32_t c[2][2][256] __attribute__((aligned(64)));
    for (int i = 0; i < rows; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b <= nb; b++) {
        if (b < nb) {  // block b's dots, issued before block b - 1's scaling
            const int8_t *blk = codes + b * 512, *b2 = two ? q2 + b * Q8X_QK : NULL;
            if (b & 1)
                Q8X16_BLOCK_DOTS(2, 3, q1 + b * Q8X_QK, b2, two, K, blk);
            else
                Q8X16_BLOCK_DOTS(0, 1, q1 + b * Q8X_QK, b2, two, K, blk);
        }
        if (b > 0) {
            const int64_t bp = b - 1;
            const __m512 d = _mm512_loadu_ps(scales + bp * Q8X_ROWS);
            const int32_t *c1 = c[bp & 1][0], *c2 = c[bp & 1][1];
            for (int i = 0; i < rows; i++) {
                const __m512i a1 = _mm512_load_si512(c1 + 16 * i);
                const __m512i a =
                    two ? _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(a1, 8),
                                                           _mm512_slli_epi32(a1, 1)),
                                          _mm512_load_si512(c2 + 16 * i))
                       : a1;
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a),
                                         _mm512_mul_ps(d, _mm512_set1_ps(e[i * nb + bp])), sum[i]);
            }
        }
        if (b < nb) {  // stored after the scaling above: its loads need not wait for these
            if (b & 1) {
                _tile_stored(2, c[1][0], 64);
                if (two) _tile_stored(3, c[1][1], 64);
            } else {
                _tile_stored(0, c[0][0], 64);
                if (two) _tile_stored(1, c[0][1], 64);
            }
        }
    }
}

// y[0 .. rows, 16 outputs of one group] for <= 16 activation rows (q1, q2 at row stride K)
static void chunk_rows(const int8_t *codes, const float *scales, int64_t nb, int64_t K,
                       const int8_t *q1, const int8_t *q2, const float *e, int rows, float *y,
                       int64_t ldy) {
    __m512 sum[16];
    group_sums(codes, scales, nb, K, q1, q2, 1, e, rows, sum);
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(y + i * ldy, sum[i]);
}

// y [M, N] float32 (row stride ldy) = x [M, K] float32 (row stride ldx) @ W.T, W as
// q8_x16_pack leaves it (codes int8 [N/16, K/32, 8, 16, 4], scales [N/16, K/32, 16]).
// Returns -1 unless K % 32 == 0, N % 16 == 0 and M > 0 (or out of memory).
int q8_x16_amx_matmul(const int8_t *codes, const float *scales, int64_t N, int64_t K,
                      const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy) {
    if (K % Q8X_QK || N % Q8X_ROWS || M <= 0 || N <= 0) return -1;
    const int64_t nb = K / Q8X_QK, groups = N / Q8X_ROWS;
    // q1, q2 int8 [M, K], then e float [M, nb]
    int8_t *q1 = amx_scratch_get(1, (size_t)(2 * M * K) + sizeof(float) * (size_t)(M * nb));
    if (!q1) return -1;
    int8_t *q2 = q1 + M * K;
    float *e = (float *)(q2 + M * K);
#pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t r = 0; r < M; r++)
        quantize_row_2x8(x + r * ldx, (int)K, q1 + r * K, q2 + r * K, e + r * nb, NULL);
    const int64_t row_blocks = (M + Q8X_ROW_BLOCK - 1) / Q8X_ROW_BLOCK;
#pragma omp parallel
    {
        int configured = -1;
#pragma omp for collapse(2) schedule(static)
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            for (int64_t g = 0; g < groups; g++) {
                const int64_t end = (rb + 1) * Q8X_ROW_BLOCK < M ? (rb + 1) * Q8X_ROW_BLOCK : M;
                for (int64_t m0 = rb * Q8X_ROW_BLOCK; m0 < end; m0 += 16) {
                    const int rows = end - m0 < 16 ? (int)(end - m0) : 16;
                    if (rows != configured) {
                        configure_q8x16(rows);
                        configured = rows;
                    }
                    chunk_rows(codes + g * nb * 512, scales + g * nb * Q8X_ROWS, nb, K,
                               q1 + m0 * K, q2 + m0 * K, e + m0 * nb, rows,
                               y + m0 * ldy + g * Q8X_ROWS, ldy);
                }
            }
        }
    }
    amx_scratch_put(q1);
    return 0;
}

// q8_rows.c's greedy argmax first pass (q8x_hi_pass_*) on the tiles: for groups [g0, g1) and
// the M activation rows' first parts q1 (row stride K; e1 = 254 e, per row and block), each
// row's one-part logits of the group, y = sum_b dot(c, q1) * (d * e1), reduced to lo = max_j
// (y_j - B_j) and up = max_j (y_j + B_j), B_j = w1[j] * ab[row] (both NaN when a logit is),
// into lo / up [M, ld] at column g. `tdpbssd` gives dot(c, q1) exactly as the vector pass's
// `vpdpbusd` on the flipped codes less its correction does, and the float steps are its own in
// its order: the same bounds, so the same groups computed in full. Returns -1 for a bad shape.
int q8_x16_amx_hi_pass(const int8_t *codes, const float *scales, const float *w1, int64_t nb,
                       int64_t K, const int8_t *q1, const float *e1, const float *ab, int64_t M,
                       int64_t g0, int64_t g1, float *lo, float *up, int64_t ld) {
    if (K != nb * Q8X_QK || M <= 0) return -1;
    int configured = -1;
    for (int64_t g = g0; g < g1; g++) {
        const __m512 w = _mm512_loadu_ps(w1 + g * Q8X_ROWS);
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
            if (rows != configured) {
                configure_q8x16(rows);
                configured = rows;
            }
            __m512 sum[16];
            group_sums(codes + g * nb * 512, scales + g * nb * Q8X_ROWS, nb, K, q1 + m0 * K,
                       NULL, 0, e1 + m0 * nb, rows, sum);
            for (int i = 0; i < rows; i++) {
                float *l = lo + (m0 + i) * ld + g, *u = up + (m0 + i) * ld + g;
                if (_mm512_cmp_ps_mask(sum[i], sum[i], _CMP_UNORD_Q)) {
                    *l = *u = NAN;
                    continue;
                }
                const __m512 bnd = _mm512_mul_ps(w, _mm512_set1_ps(ab[m0 + i]));
                *l = _mm512_reduce_max_ps(_mm512_sub_ps(sum[i], bnd));
                *u = _mm512_reduce_max_ps(_mm512_add_ps(sum[i], bnd));
            }
        }
    }
    return 0;
}
