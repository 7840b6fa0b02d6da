// int4 weights x activations on AMX tiles. The bf16 kernel (long prefill chunks) first, then
// the integer one (decode steps, verifies, prompts below 256 tokens).
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

// ---------------------------------------------------------------------------------------------
// The same int4 weights x integer activations (AMX-INT8), for up to a few hundred rows (decode
// steps, speculative verifies, short prompts): there the bf16 kernel above spends its time
// converting every weight to bf16, while here the codes go to the tiles as they are
// (unsigned bytes, only regrouped) and the scales apply once per 32 columns per output, a
// cost that grows with the rows (so long prefill chunks take the bf16 kernel).
//
// Each activation row is split per block of 32 columns into two int8 parts with one scale e:
// x ~= e * (q + r / 256), q = round(x / e) with |q| <= 127 (llama.cpp's activation rounding
// for its Q4 kernels) and r the rounded remainder in 256ths of e. One int8 part alone lost
// 2 points of top-1 agreement with fp32 on the default model (97.7% against 99.5% with bf16
// activations); with the remainder the activations carry about 15 bits. X = e * sum(q + r/256)
// is kept. With w = code * s + (z - 8 s) in a block,
//     sum_k w_k x_k ~= s * e * (sum_k code_k q_k + sum_k code_k r_k / 256)  +  (z - 8 s) * X
// Each integer dot is one tdpbsud (signed activations x unsigned codes): A = 16 activation
// rows x 32 bytes, B = 8 rows of (16 output columns x 4 consecutive k).

// bf16 rows x [M, K] -> q, r int8 [M, K], e and X float [M, K/32]
static void quantize_activations(const uint16_t *x, int64_t ldx, int64_t M, int64_t K,
                                 int8_t *q, int8_t *r, float *e, float *X) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *xb = x + m * ldx + b * 32;
            const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)xb)), 16));
            const __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + 16))), 16));
            int32_t sum, rsum;
            const float scale = split_int8_block(v0, v1, q + m * K + b * 32, r + m * K + b * 32,
                                                 &sum, &rsum);
            e[m * nb + b] = scale;
            X[m * nb + b] = scale * ((float)sum + (float)rsum / 256.0f);
        }
    }
}

// One 32-row half of a 64-row block over all K -> buf: per block b of 32 columns, two B tiles
// (t = output rows 16t..) of 8 rows x 64 bytes: row kq holds, for each of 16 output rows j,
// the codes at k = 4kq .. 4kq + 3.
static void regroup_half(const uint8_t *codes, int64_t K, int64_t blk, int half, uint8_t *buf) {
    const uint8_t *base = codes + blk * K * 32;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    for (int64_t k = 0; k < K; k += 4) {
        __m256i v[4];
        for (int i = 0; i < 4; i++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(base + (k + i) * 32));
            if (half) raw = _mm256_srli_epi16(raw, 4);
            v[i] = _mm256_and_si256(raw, nibble);
        }
        // per 128-bit lane (rows j and j + 16): bytes of k, k+1 interleaved, then of k+2, k+3
        const __m256i a01l = _mm256_unpacklo_epi8(v[0], v[1]), a01h = _mm256_unpackhi_epi8(v[0], v[1]);
        const __m256i a23l = _mm256_unpacklo_epi8(v[2], v[3]), a23h = _mm256_unpackhi_epi8(v[2], v[3]);
        const __m256i r0 = _mm256_unpacklo_epi16(a01l, a23l);  // rows 0-3 | 16-19
        const __m256i r1 = _mm256_unpackhi_epi16(a01l, a23l);  // rows 4-7 | 20-23
        const __m256i r2 = _mm256_unpacklo_epi16(a01h, a23h);  // rows 8-11 | 24-27
        const __m256i r3 = _mm256_unpackhi_epi16(a01h, a23h);  // rows 12-15 | 28-31
        uint8_t *row = buf + (k / 32) * 1024 + ((k % 32) / 4) * 64;
        _mm256_storeu_si256((__m256i *)row, _mm256_permute2x128_si256(r0, r1, 0x20));
        _mm256_storeu_si256((__m256i *)(row + 32), _mm256_permute2x128_si256(r2, r3, 0x20));
        _mm256_storeu_si256((__m256i *)(row + 512), _mm256_permute2x128_si256(r0, r1, 0x31));
        _mm256_storeu_si256((__m256i *)(row + 544), _mm256_permute2x128_si256(r2, r3, 0x31));
    }
}

// y[M, N] (bf16, row stride ldy) = x[M, K] (bf16, row stride ldx) @ W.T, W as for
// q4_amx_matmul. Returns -1 unless N % 64 == 0, K % 32 == 0 and group % 32 == 0.
int q4_amx_matmul_i8(const uint8_t *codes, const uint16_t *sz, int64_t N, int64_t K,
                     int64_t group, const uint16_t *x, int64_t ldx, int64_t M, uint16_t *y,
                     int64_t ldy) {
    if (N % 64 || K % 32 || group % 32 || group <= 0 || M <= 0) return -1;
    const int64_t nb = K / 32, halves = N / 32;
    // q, r int8 [M, K] each, then e, X float [M, K/32] each
    int8_t *q = amx_scratch_get(1, (size_t)(2 * M * K) + sizeof(float) * 2 * M * nb);
    if (!q) return -1;
    int8_t *r = q + M * K;
    float *e = (float *)(q + 2 * M * K), *X = e + M * nb;
    quantize_activations(x, ldx, M, K, q, r, e, X);
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512 fine = _mm512_set1_ps(1.0f / 256.0f);
#pragma omp parallel
    {
        uint8_t *buf = amx_scratch_get(0, (size_t)K * 32);
        int32_t c[4][256] __attribute__((aligned(64)));
        __m512 acc[16][2];
        int configured = -1;
#pragma omp for schedule(static)
        for (int64_t h = 0; h < halves; h++) {
            regroup_half(codes, K, h / 2, (int)(h % 2), buf);
            const int64_t n0 = h * 32;
            const uint8_t *next_codes = h / 2 + 1 < N / 64 ? codes + (h / 2 + 1) * K * 32 : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                int tiles;
                const int rows = i8_chunk_rows(M, m0, &configured, &tiles);
                for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; b++) {
                    // the next block's codes, K / 2 cache lines over both halves' blocks, so
                    // that streaming the weights overlaps the tile work (one row measured 6.5
                    // ms a 120-matmul step without, against torch's 3.5)
                    if (m0 == 0 && next_codes) {
                        const uint8_t *line = next_codes + ((h % 2) * nb + b) * 8 * 64;
                        for (int l = 0; l < 8; l++) _mm_prefetch((const char *)(line + 64 * l), _MM_HINT_T0);
                    }
                    block_dots_i8(buf + b * 1024, q + m0 * K + b * 32, r + m0 * K + b * 32, K,
                                  rows, tiles, c);
                    const int64_t g = b * 32 / group;
                    __m512 s[2], z[2];
                    for (int t = 0; t < 2; t++) {
                        const __m512i p = _mm512_loadu_si512(sz + (g * N + n0 + 16 * t) * 2);
                        s[t] = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
                        z[t] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s[t],
                                                _mm512_castsi512_ps(_mm512_and_si512(p, hi16)));
                    }
                    for (int i = 0; i < rows; i++) {
                        const __m512 er = _mm512_set1_ps(e[(m0 + i) * nb + b]);
                        const __m512 xr = _mm512_set1_ps(X[(m0 + i) * nb + b]);
                        for (int t = 0; t < 2; t++) {
                            const __m512 dot = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(_mm512_load_si512(c[2 + t] + 16 * i)), fine,
                                _mm512_cvtepi32_ps(_mm512_load_si512(c[t] + 16 * i)));
                            acc[i][t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s[t], er),
                                                        _mm512_fmadd_ps(z[t], xr, acc[i][t]));
                        }
                    }
                }
                for (int i = 0; i < rows; i++)
                    for (int t = 0; t < 2; t++)
                        _mm256_storeu_si256((__m256i *)(y + (m0 + i) * ldy + n0 + 16 * t),
                                            (__m256i)_mm512_cvtneps_pbh(acc[i][t]));
            }
        }
        amx_scratch_put(buf);
    }
    amx_scratch_put(q);
    return 0;
}

