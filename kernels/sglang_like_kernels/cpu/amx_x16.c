// Q4_1 weights in the x16 layout (q4_rows.c) x int8 activations on AMX-INT8 tiles: the same
// bits as q4_rows.c's kernel, faster from a few dozen rows (prefill chunks, large verifies).
//
// q4_rows.c stores, per group of 16 output rows and block of 32 columns, 4 vectors of 64
// bytes: byte 4r + j of vector t holds code[r][4t + j] (low nibble) and code[r][4(t+4) + j]
// (high nibble). Split into nibbles, those are the 8 rows of an AMX B tile for K = 32: tile
// row kq holds, for each of the 16 output rows, the 4 codes at k = 4kq .. 4kq + 3. So one
// `tdpbsud` (signed activation bytes x unsigned codes) gives a block's integer dots of 16
// activation rows x 16 output rows, exactly the sums `vpdpbusd` adds up there (integers:
// any order gives the same number). Then each block is scaled as q4_rows.c scales it, with
// the same two fused multiply-adds in the same order of blocks:
//     y += dot * (d * e);  y += m * S
// and the activations are quantized by q4_1.c's own q4_1_quantize_row_q8 (linked into this
// library). A row's result is therefore the same bits here as on the x16 kernel, alone or in
// any batch: a switch between the two by row count changes no output.
//
// Work: per 128 activation rows and group of 16 output rows (split over the team), the
// group's codes are split into nibbles once into a B-tile buffer (512 bytes a block), then
// each 16-row chunk of activations walks the blocks, block b's tile product issued before
// block b - 1's scaling so that the two overlap (two C tiles, two A/B tile pairs).

#include "amx.h"

#include <stdlib.h>

#define XQK 32
#define X16_ROWS 16
#define X16_RECORD 320       // bytes per (group, block) in the x16 layout
#define X16_ROW_BLOCK 128    // activation rows per work item (their codes stay in L2)

void q4_1_quantize_row_q8(const float *x, int K, int8_t *q, float *e, float *S);

// tmm0, 1: C of even / odd blocks; tmm2, 4: A (activation rows x 32 bytes); tmm3, 5: B (8
// rows x 64 bytes)
static void configure_x16(int rows) {
    const int r[8] = {rows, rows, rows, 8, rows, 8, 0, 0};
    const int colsb[8] = {64, 64, 32, 64, 32, 64, 0, 0};
    amx_configure(r, colsb);
}

// one group's records (nb blocks) -> buf: per block, the B tile (8 rows x 64 bytes)
static void split_group(const uint8_t *grp, int64_t nb, uint8_t *buf) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = grp + b * X16_RECORD;
        uint8_t *dst = buf + b * 512;
        for (int t = 0; t < 4; t++) {
            const __m512i v = _mm512_loadu_si512((const void *)(rec + 64 * t));
            _mm512_store_si512(dst + 64 * t, _mm512_and_si512(v, low));
            _mm512_store_si512(dst + 64 * (t + 4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    }
}

// One block's dots for the configured rows (q at the block, row stride K) into out, on C
// tile c, A tile a, B tile bt (tile numbers are immediates)
#define X16_BLOCK_DOTS(c, a, bt, q, K, b_tile, out) \
    do {                                            \
        _tile_zero(c);                              \
        _tile_loadd(a, q, K);                       \
        _tile_loadd(bt, b_tile, 64);                \
        _tile_dpbsud(c, a, bt);                     \
        _tile_stored(c, out, 64);                   \
    } while (0)

// y[m0 .. m0 + rows, 16 outputs of group grp] for one chunk of <= 16 activation rows
static void chunk_rows(const uint8_t *grp, const uint8_t *tiles, int64_t nb, int64_t K,
                       const int8_t *q, const float *e, const float *S, int rows, float *y,
                       int64_t ldy) {
    int32_t c[2][256] __attribute__((aligned(64)));
    __m512 sum[16];
    for (int i = 0; i < rows; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b <= nb; b++) {
        if (b < nb) {
            if (b & 1)
                X16_BLOCK_DOTS(1, 4, 5, q + b * XQK, K, tiles + b * 512, c[1]);
            else
                X16_BLOCK_DOTS(0, 2, 3, q + b * XQK, K, tiles + b * 512, c[0]);
        }
        if (b == 0) continue;
        const int64_t bp = b - 1;
        const uint8_t *rec = grp + bp * X16_RECORD;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)));
        const int32_t *cp = c[bp & 1];
        for (int i = 0; i < rows; i++) {
            const int64_t at = (int64_t)i * nb + bp;
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(cp + 16 * i));
            sum[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(e[at])), sum[i]);
            sum[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(S[at]), sum[i]);
        }
    }
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(y + i * ldy, sum[i]);
}

// y [M, N] float32 (row stride ldy) = x [M, K] float32 (row stride ldx) @ W.T, W [N, K] in
// the x16 layout. Returns -1 unless K % 32 == 0, N % 16 == 0 and M > 0 (or out of memory).
int q4_x16_amx_matmul(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t ldx,
                      int64_t M, float *y, int64_t ldy) {
    if (K % XQK || N % X16_ROWS || M <= 0 || N <= 0) return -1;
    const int64_t nb = K / XQK, groups = N / X16_ROWS;
    // q int8 [M, K], then e and S float [M, nb]
    int8_t *q = amx_scratch_get(1, (size_t)(M * K) + sizeof(float) * 2 * (size_t)(M * nb));
    if (!q) return -1;
    float *e = (float *)(q + M * K), *S = e + M * nb;
#pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t r = 0; r < M; r++)
        q4_1_quantize_row_q8(x + r * ldx, (int)K, q + r * K, e + r * nb, S + r * nb);
    const int64_t row_blocks = (M + X16_ROW_BLOCK - 1) / X16_ROW_BLOCK;
    int failed = 0;
#pragma omp parallel
    {
        uint8_t *tiles = amx_scratch_get(0, (size_t)nb * 512);
        int configured = -1;
        if (!tiles) failed = 1;
#pragma omp for collapse(2) schedule(static)
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            for (int64_t g = 0; g < groups; g++) {
                if (!tiles) continue;
                const uint8_t *grp = w + g * nb * X16_RECORD;
                split_group(grp, nb, tiles);
                const int64_t end = (rb + 1) * X16_ROW_BLOCK < M ? (rb + 1) * X16_ROW_BLOCK : M;
                for (int64_t m0 = rb * X16_ROW_BLOCK; m0 < end; m0 += 16) {
                    const int rows = end - m0 < 16 ? (int)(end - m0) : 16;
                    if (rows != configured) {
                        configure_x16(rows);
                        configured = rows;
                    }
                    chunk_rows(grp, tiles, nb, K, q + m0 * K, e + m0 * nb, S + m0 * nb, rows,
                               y + m0 * ldy + g * X16_ROWS, ldy);
                }
            }
        }
        amx_scratch_put(tiles);
    }
    amx_scratch_put(q);
    return failed ? -1 : 0;
}
