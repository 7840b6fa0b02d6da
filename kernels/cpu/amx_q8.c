// Block-int8 weights (the LM head: codes int8 [N, K], one float scale per 32 columns of a row)
// x float32 activations: y[M, N] float32.
//
// Here the weights are the A operand: a weight row's 32 columns of one block, times its
// scale and rounded to bf16, are one 64-byte A-tile row, so each row dequantizes on its own
// (no transpose). The activations are the B operand: rounded to bf16 and laid out in VNNI
// pairs once per call (tile u of a 32-row chunk: row kp holds, for 16 activation rows, the
// values at k = 2kp and 2kp + 1). C tiles come out as [output column][activation row] and are
// written transposed.

#include "amx.h"

#include <stdlib.h>
#include <string.h>

// x [M, K] float32 -> xt bf16: for each 16-row group g, K/2 rows of 16 x 2 values (rows past
// M are zero)
static void pack_activations(const float *x, int64_t ldx, int64_t M, int64_t K, uint16_t *xt) {
    const int64_t groups = (M + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        uint16_t *dst = xt + g * K * 16;
        for (int64_t kp = 0; kp < K / 2; kp++) {
            for (int r = 0; r < 16; r++) {
                const int64_t m = g * 16 + r;
                float a = 0.0f, b = 0.0f;
                if (m < M) {
                    a = x[m * ldx + 2 * kp];
                    b = x[m * ldx + 2 * kp + 1];
                }
                // round to nearest even, as _mm512_cvtneps_pbh (activations are finite)
                uint32_t ua, ub;
                memcpy(&ua, &a, 4);
                memcpy(&ub, &b, 4);
                ua += 0x7FFF + ((ua >> 16) & 1);
                ub += 0x7FFF + ((ub >> 16) & 1);
                dst[kp * 32 + 2 * r] = (uint16_t)(ua >> 16);
                dst[kp * 32 + 2 * r + 1] = (uint16_t)(ub >> 16);
            }
        }
    }
}

// rows n0..n0+31 of the int8 matrix over all K -> buf: per 32-column step s, two A tiles of
// 16 rows x 32 bf16 (tile t = rows n0 + 16t ..)
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
            _mm512_storeu_si512(dst + s * 1024, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

// tmm0..3: C (weight tile t x activation tile u at 2t + u), tmm4, 5: A (weights),
// tmm6, 7: B (activation tiles)
static void configure_q8(int cols0, int cols1) {
    const int rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    const int colsb[8] = {cols0 * 4, cols1 * 4, cols0 * 4, cols1 * 4, 64, 64, cols0 * 4,
                          cols1 * 4};
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
    uint16_t *xt = amx_scratch_get(1, (size_t)(groups * K * 16) * sizeof(uint16_t));
    if (!xt) return -1;
    pack_activations(x, ldx, M, K, xt);
#pragma omp parallel
    {
        uint16_t *buf = amx_scratch_get(0, (size_t)K * 32 * sizeof(uint16_t));
        float c[4][256] __attribute__((aligned(64)));
        int configured = -1;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += 32) {
            dequantize_rows_q8(codes, scales, K, n0, buf);
            for (int64_t g = 0; g < groups; g += 2) {
                const int64_t m0 = g * 16;
                const int cols0 = M - m0 < 16 ? (int)(M - m0) : 16;
                const int cols1 = M - m0 - 16 <= 0 ? 0 : (M - m0 - 16 < 16 ? (int)(M - m0 - 16) : 16);
                const int key = cols0 * 32 + cols1;
                if (key != configured) {
                    configure_q8(cols0, cols1 ? cols1 : 1);
                    configured = key;
                }
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t *b0 = xt + g * K * 16, *b1 = b0 + K * 16;
                for (int64_t s = 0; s < K / 32; s++) {
                    _tile_loadd(4, buf + s * 1024, 64);
                    _tile_loadd(5, buf + s * 1024 + 512, 64);
                    _tile_loadd(6, b0 + s * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(2, 5, 6);
                    if (cols1) {
                        _tile_loadd(7, b1 + s * 512, 64);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(2, c[2], 64);
                store_transposed(c[0], cols0, y + m0 * ldy + n0, ldy);
                store_transposed(c[2], cols0, y + m0 * ldy + n0 + 16, ldy);
                if (cols1) {
                    _tile_stored(1, c[1], 64);
                    _tile_stored(3, c[3], 64);
                    store_transposed(c[1], cols1, y + (m0 + 16) * ldy + n0, ldy);
                    store_transposed(c[3], cols1, y + (m0 + 16) * ldy + n0 + 16, ldy);
                }
            }
        }
        amx_scratch_put(buf);
    }
    amx_scratch_put(xt);
    return 0;
}

