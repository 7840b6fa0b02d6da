// int4 weights x activations on AMX tiles: the bf16 kernel, for long prefill chunks (fewer
// rows take amx_q4_codes.c's, which reads the same layout).
//
// The weights stay in the layout torch packs them in for `_weight_int4pack_mm_for_cpu` on
// AVX-512 (quant/int4.py reads the same bytes):
//   codes  uint8 [N/64, K, 32]: byte j of (block, k) holds row j of the 64-row block in its
//                               low nibble and row j + 32 in its high one
//   sz     bf16  [K/group, N, 2]: (scale, zero), w = (code - 8) * scale + zero
// The bf16 kernel: for each 32-row half of a 64-row block, the whole K is dequantized into an
// L2 buffer laid out as AMX's B operand (VNNI pairs: row kp of a tile holds, for 16 output
// columns, the weights at k = 2kp and 2kp + 1), once, then the activations stream through it
// 32 rows at a time: per 32 columns of K, two A tiles (16 activation rows x 32 bf16) times
// two B tiles (32 output columns) accumulate four 16x16 fp32 C tiles. So the dequantization is
// paid once per weight whatever the batch, and the multiply-adds run on the tile unit.
// Each weight goes in as two bf16 parts, its rounding and the rounding of the rest (16 bits
// of it, so the sums are those of the exact weights, as in torch's kernel and the integer
// one): with one part, the weights' fixed rounding added up over the layers and moved a flat
// next-token distribution's top-2 gap by 0.4 nats, where the exact kernels agree within 0.1.
//
// Each output is one fp32 sum over K in a fixed order that does not depend on the other rows
// of the batch: a row's result is the same alone or in a batch of 64. Outputs are rounded to
// bf16 as torch's kernel returns them.
//

#include "amx.h"

#include <stdlib.h>
#include <string.h>

// tmm0..3: C (rows m of tile 0 / 1 of the 32-row activation chunk x output tile 0 / 1),
// tmm4, 5: A (activation rows), tmm6, 7: B (weights)
static void configure(int rows0, int rows1) {
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    const int colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure(rows, colsb);
}

// Dequantize one 32-row half (rows `half * 32 ..` of 64-row block `blk`) over all K into
// buf: for each 32-column step s, two B tiles of 16 rows x 64 bytes (tile t = output rows
// 16t..16t+15) of the weights' bf16 tops, then the two of their rests (2048 values a step).
static void dequantize_half(const uint8_t *codes, const uint16_t *sz, int64_t N, int64_t K,
                            int64_t group, int64_t blk, int half, uint16_t *buf) {
    const uint8_t *base = codes + blk * K * 32;
    const int64_t n0 = blk * 64 + half * 32;
    const __m512i pair_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i pair_hi = _mm512_add_epi32(pair_lo, _mm512_set1_epi32(8));
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m128i nibble = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    __m512 s_lo[2], s_hi[2], z_lo[2], z_hi[2];
    for (int64_t k = 0; k < K; k += 2) {
        if (k % group == 0) {
            for (int t = 0; t < 2; t++) {
                // 16 (scale, zero) bf16 pairs: dword j = scale_j | zero_j << 16
                const __m512i p = _mm512_loadu_si512(sz + ((k / group) * N + n0 + 16 * t) * 2);
                const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
                const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(p, hi16));
                s_lo[t] = _mm512_permutexvar_ps(pair_lo, s);
                s_hi[t] = _mm512_permutexvar_ps(pair_hi, s);
                z_lo[t] = _mm512_permutexvar_ps(pair_lo, z);
                z_hi[t] = _mm512_permutexvar_ps(pair_hi, z);
            }
        }
        uint16_t *row = buf + (k / 32) * 2048 + ((k % 32) / 2) * 32;
        for (int t = 0; t < 2; t++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(base + k * 32 + 16 * t));
            __m128i b = _mm_loadu_si128((const __m128i *)(base + (k + 1) * 32 + 16 * t));
            if (half) {
                a = _mm_srli_epi16(a, 4);
                b = _mm_srli_epi16(b, 4);
            }
            a = _mm_sub_epi8(_mm_and_si128(a, nibble), eight);
            b = _mm_sub_epi8(_mm_and_si128(b, nibble), eight);
            // (k, k+1) interleaved for output rows 0..7 and 8..15 of the tile
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(a, b)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(a, b)));
            const __m512 wlo = _mm512_fmadd_ps(lo, s_lo[t], z_lo[t]);
            const __m512 whi = _mm512_fmadd_ps(hi, s_hi[t], z_hi[t]);
            store_bf16_split(wlo, whi, row + t * 512, row + 1024 + t * 512);
        }
    }
}

// 16 fp32 C rows (ld 16) -> bf16 y rows
static void store_bf16(const float *c, int rows, uint16_t *y, int64_t ldy) {
    for (int i = 0; i < rows; i++) {
        const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(c + 16 * i));
        _mm256_storeu_si256((__m256i *)(y + i * ldy), (__m256i)v);
    }
}

// y[M, N] (bf16, row stride ldy) = x[M, K] (bf16, row stride ldx) @ W.T.
// Returns -1 unless N % 64 == 0, K % 32 == 0 and group % 32 == 0.
int q4_amx_matmul(const uint8_t *codes, const uint16_t *sz, int64_t N, int64_t K, int64_t group,
                  const uint16_t *x, int64_t ldx, int64_t M, uint16_t *y, int64_t ldy) {
    if (N % 64 || K % 32 || group % 32 || group <= 0) return -1;
    const int64_t halves = N / 32;
#pragma omp parallel
    {
        uint16_t *buf = amx_scratch_get(0, (size_t)K * 64 * sizeof(uint16_t));
        float c[4][256] __attribute__((aligned(64)));
        int configured = -1;
#pragma omp for schedule(static)
        for (int64_t h = 0; h < halves; h++) {
            dequantize_half(codes, sz, N, K, group, h / 2, (int)(h % 2), buf);
            const int64_t n0 = h * 32;
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                const int rows0 = M - m0 < 16 ? (int)(M - m0) : 16;
                const int rows1 = M - m0 - 16 <= 0 ? 0 : (M - m0 - 16 < 16 ? (int)(M - m0 - 16) : 16);
                const int key = rows0 * 32 + rows1;
                if (key != configured) {
                    configure(rows0, rows1 ? rows1 : 1);
                    configured = key;
                }
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                const uint16_t *xa = x + m0 * ldx;
                for (int64_t s = 0; s < K / 32; s++) {
                    _tile_loadd(4, xa + s * 32, ldx * 2);
                    if (rows1) _tile_loadd(5, xa + 16 * ldx + s * 32, ldx * 2);
                    for (int part = 0; part < 2; part++) {  // the weights' bf16 top, then rest
                        const uint16_t *b = buf + s * 2048 + part * 1024;
                        _tile_loadd(6, b, 64);
                        _tile_loadd(7, b + 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        if (rows1) {
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                store_bf16(c[0], rows0, y + m0 * ldy + n0, ldy);
                store_bf16(c[1], rows0, y + m0 * ldy + n0 + 16, ldy);
                if (rows1) {
                    _tile_stored(2, c[2], 64);
                    _tile_stored(3, c[3], 64);
                    store_bf16(c[2], rows1, y + (m0 + 16) * ldy + n0, ldy);
                    store_bf16(c[3], rows1, y + (m0 + 16) * ldy + n0 + 16, ldy);
                }
            }
        }
        amx_scratch_put(buf);
    }
    return 0;
}
