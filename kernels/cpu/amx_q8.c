// Block-int8 weights (the LM head: codes int8 [N, K], one float scale per 32 columns of a row)
// x float32 activations: y[M, N] float32.
//
// Here the weights are the A operand: a weight row's 32 columns of one block, times its
// scale, are one 64-byte A-tile row of bf16, so each row dequantizes on its own (no
// transpose). The activations are the B operand, laid out in VNNI pairs once per call (16
// activation rows a tile: row kp holds, for each, the values at k = 2kp and 2kp + 1). C tiles
// come out as [output column][activation row] and are written transposed.
//
// Weights and activations each go in as two bf16 parts (a value's rounding, and the rounding
// of the rest): hi*hi + lo*hi + hi*lo keeps 16 bits of both, so the logits are those of the
// float product (as the int8 kernel's, which multiplies float32 activations) rather than
// moving by 2e-3 of their norm, which had moved prompt logprobs by 0.03 between a cached and
// an uncached run.

#include "amx.h"

#include <stdlib.h>
#include <string.h>

// bf16 rounding (nearest even) of a finite float, and of what it leaves out
static inline void split_bf16(float v, uint16_t *hi, uint16_t *lo) {
    uint32_t u, t;
    memcpy(&u, &v, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    *hi = (uint16_t)(u >> 16);
    t = (uint32_t)*hi << 16;
    float top;
    memcpy(&top, &t, 4);
    const float rest = v - top;
    memcpy(&u, &rest, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    *lo = (uint16_t)(u >> 16);
}

// x [M, K] float32 -> xt: for each 16-row group g (at xt + g * K * 32), K/2 rows of 16 x 2 bf16
// tops, then K/2 rows of the rests (rows past M are zero)
static void pack_activations(const float *x, int64_t ldx, int64_t M, int64_t K, uint16_t *xt) {
    const int64_t groups = (M + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        uint16_t *hi = xt + g * K * 32, *lo = hi + K * 16;
        for (int64_t k = 0; k < K; k++) {
            for (int r = 0; r < 16; r++) {
                const int64_t m = g * 16 + r;
                const int64_t at = (k / 2) * 32 + 2 * r + (k % 2);
                split_bf16(m < M ? x[m * ldx + k] : 0.0f, hi + at, lo + at);
            }
        }
    }
}

// rows n0..n0+31 of the int8 matrix over all K -> buf: per 32-column step s, the two A tiles
// (t = rows n0 + 16t ..) of 16 rows x 32 bf16 tops, then the two of the rests
static void dequantize_rows_q8(const int8_t *codes, const float *scales, int64_t K,
                               int64_t n0, uint16_t *buf) {
    const int64_t nb = K / 32;
    for (int r = 0; r < 32; r++) {
        const int8_t *row = codes + (n0 + r) * K;
        const float *sc = scales + (n0 + r) * nb;
        uint16_t *dst = buf + (r / 16) * 512 + (r % 16) * 32;
        for (int64_t s = 0; s < nb; s++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(row + s * 32));
            const __m512 d = _mm512_set1_ps(sc[s]);
            const __m512 lo = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), d);
            const __m512 hi = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), d);
            store_bf16_split(lo, hi, dst + s * 2048, dst + s * 2048 + 1024);
        }
    }
}

// tmm0, 1: C (weight tile t x the activation tile), tmm2, 3: A tops (weight tiles 0, 1),
// tmm4, 5: A rests, tmm6, 7: B (the activation tile's tops, rests)
static void configure_q8(int cols) {
    const int rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    const int colsb[8] = {cols * 4, cols * 4, 64, 64, 64, 64, cols * 4, cols * 4};
    amx_configure(rows, colsb);
}

// C [16 output columns][cols activation rows] (ld 16) -> y[m][n0 + i]
static void store_transposed(const float *c, int cols, float *y, int64_t ldy) {
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(16));
    for (int m = 0; m < cols; m++)
        _mm512_storeu_ps(y + m * ldy, _mm512_i32gather_ps(idx, c + m, 4));
}

// y[M, N] float32 (row stride ldy) = x[M, K] float32 (row stride ldx) @ W.T with W = codes
// int8 [N, K] times scales [N, K/32]. Returns -1 unless N % 32 == 0 and K % 32 == 0.
int q8_amx_matmul(const int8_t *codes, const float *scales, int64_t N, int64_t K,
                  const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy) {
    if (N % 32 || K % 32 || M <= 0) return -1;
    const int64_t groups = (M + 15) / 16;
    uint16_t *xt = amx_scratch_get(1, (size_t)(groups * K * 32) * sizeof(uint16_t));
    if (!xt) return -1;
    pack_activations(x, ldx, M, K, xt);
#pragma omp parallel
    {
        uint16_t *buf = amx_scratch_get(0, (size_t)K * 64 * sizeof(uint16_t));
        float c[2][256] __attribute__((aligned(64)));
        int configured = -1;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += 32) {
            dequantize_rows_q8(codes, scales, K, n0, buf);
            for (int64_t g = 0; g < groups; g++) {
                const int cols = M - g * 16 < 16 ? (int)(M - g * 16) : 16;
                if (cols != configured) {
                    configure_q8(cols);
                    configured = cols;
                }
                _tile_zero(0);
                _tile_zero(1);
                const uint16_t *bt = xt + g * K * 32, *br = bt + K * 16;
                for (int64_t s = 0; s < K / 32; s++) {
                    const uint16_t *a = buf + s * 2048;
                    _tile_loadd(2, a, 64);
                    _tile_loadd(3, a + 512, 64);
                    _tile_loadd(4, a + 1024, 64);
                    _tile_loadd(5, a + 1536, 64);
                    _tile_loadd(6, bt + s * 512, 64);
                    _tile_loadd(7, br + s * 512, 64);
                    _tile_dpbf16ps(0, 2, 6);  // top x top
                    _tile_dpbf16ps(1, 3, 6);
                    _tile_dpbf16ps(0, 4, 6);  // rest x top
                    _tile_dpbf16ps(1, 5, 6);
                    _tile_dpbf16ps(0, 2, 7);  // top x rest
                    _tile_dpbf16ps(1, 3, 7);
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                store_transposed(c[0], cols, y + g * 16 * ldy + n0, ldy);
                store_transposed(c[1], cols, y + g * 16 * ldy + n0 + 16, ldy);
            }
        }
        amx_scratch_put(buf);
    }
    amx_scratch_put(xt);
    return 0;
}
