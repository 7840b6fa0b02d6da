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

// ---- the integer kernel's pieces: activations as two int8 parts ------------------------------
//
// A block of 32 activations is taken as e * (q + r / 256) with one scale e = amax / 127:
// q = round(x / e) (|q| <= 127, llama.cpp's activation rounding) and r the rounded rest in
// 256ths of e, so the activations keep about 15 bits. The weights go in as unsigned bytes,
// regrouped into B tiles of 8 rows x 64 bytes (row kq: for each of 16 output columns, the
// bytes at k = 4kq .. 4kq + 3), and each block's two integer dots (q and r against the
// weights) come out as int32 C rows of 16 output columns, which the caller scales.

// 32 floats (v0: the first 16) -> q[0..32), r[0..32); returns e, and the sums of q and r
static inline float split_int8_block(__m512 v0, __m512 v1, int8_t *q, int8_t *r,
                                     int32_t *qsum, int32_t *rsum) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float scale = amax / 127.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    const __m512 v[2] = {v0, v1};
    __m128i qb[2], rb[2];
    __m512i sum = _mm512_setzero_si512(), rs = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        // x / e, its nearest integer, and the remainder in 256ths
        const __m512 u = _mm512_mul_ps(v[h], _mm512_set1_ps(inv));
        const __m512i qi = _mm512_cvtps_epi32(u);
        const __m512 rest = _mm512_mul_ps(_mm512_sub_ps(u, _mm512_cvtepi32_ps(qi)),
                                          _mm512_set1_ps(256.0f));
        const __m512i ri = _mm512_cvtps_epi32(rest);
        qb[h] = _mm512_cvtsepi32_epi8(qi);
        rb[h] = _mm512_cvtsepi32_epi8(ri);
        sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(qb[h]));
        rs = _mm512_add_epi32(rs, _mm512_cvtepi8_epi32(rb[h]));
    }
    _mm256_storeu_si256((__m256i *)q, _mm256_set_m128i(qb[1], qb[0]));
    _mm256_storeu_si256((__m256i *)r, _mm256_set_m128i(rb[1], rb[0]));
    *qsum = _mm512_reduce_add_epi32(sum);
    *rsum = _mm512_reduce_add_epi32(rs);
    return scale;
}


// tmm0, 1: C of q (output tile 0 / 1), tmm6, 7: C of r, tmm2, 5: A (q, r: rows activation
// rows x 32 bytes), tmm3, 4: B
static inline void configure_i8(int rows) {
    const int r[8] = {rows, rows, rows, 8, 8, rows, rows, rows};
    const int colsb[8] = {64, 64, 32, 64, 64, 32, 64, 64};
    amx_configure(r, colsb);
}

// Activation rows m0.. of M as one chunk of at most 16: its row count, and in *tiles whether
// it runs on the tiles (loading their configuration when the row count changed) or on VNNI
static inline int i8_chunk_rows(int64_t M, int64_t m0, int *configured, int *tiles) {
    const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
    *tiles = rows > VNNI_MAX_ROWS;
    if (*tiles && rows != *configured) {
        configure_i8(rows);
        *configured = rows;
    }
    return rows;
}

// One block of 32 columns: c[t] (q) and c[2 + t] (r), rows x 16 int32 each (ld 16), of
// `rows` activation rows (q, r at row stride K) against the two B tiles at b_tiles (output
// tile t at b_tiles + 512 t); on tiles when `tiles` (configure_i8(rows) loaded), else VNNI.
static inline void block_dots_i8(const uint8_t *b_tiles, const int8_t *q, const int8_t *r,
                                 int64_t K, int rows, int tiles, int32_t c[4][256]) {
    if (tiles) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(6);
        _tile_zero(7);
        _tile_loadd(2, q, K);
        _tile_loadd(5, r, K);
        _tile_loadd(3, b_tiles, 64);
        _tile_loadd(4, b_tiles + 512, 64);
        _tile_dpbsud(0, 2, 3);
        _tile_dpbsud(1, 2, 4);
        _tile_dpbsud(6, 5, 3);
        _tile_dpbsud(7, 5, 4);
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(6, c[2], 64);
        _tile_stored(7, c[3], 64);
        return;
    }
    for (int i = 0; i < rows; i++) {
        for (int t = 0; t < 2; t++) {
            const uint8_t *bt = b_tiles + t * 512;
            __m512i dq = _mm512_setzero_si512(), dr = _mm512_setzero_si512();
            for (int kq = 0; kq < 8; kq++) {
                const __m512i w = _mm512_load_si512(bt + kq * 64);
                int32_t q4, r4;
                memcpy(&q4, q + i * K + 4 * kq, 4);
                memcpy(&r4, r + i * K + 4 * kq, 4);
                dq = _mm512_dpbusd_epi32(dq, w, _mm512_set1_epi32(q4));
                dr = _mm512_dpbusd_epi32(dr, w, _mm512_set1_epi32(r4));
            }
            _mm512_store_si512(c[t] + 16 * i, dq);
            _mm512_store_si512(c[2 + t] + 16 * i, dr);
        }
    }
}

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

// ---------------------------------------------------------------------------------------------
// The same int8 matrix x integer activations (AMX-INT8; amx.h's two-part activations), below
// Q8HeadMethod.amx_min_rows (24): the decode steps and verifies of a quantized model. The
// kernel above streams the weights as four bf16 products and rounds every activation in two
// on each call; here the codes go to the tile unit as they are, with one scaling per block of
// 32 columns (w = code * s, no zero point):
//     sum_k w_k x_k ~= s * e * (sum_k code_k q_k + sum_k code_k r_k / 256)
// Per 32 output rows, each block's codes are regrouped into two B tiles (a 16 x 8 transpose of
// 4-byte groups) as unsigned bytes code + 128, so tiles (tdpbsud) and VNNI (vpdpbusd) take
// them as they are; the 128 * sum(q) they add is taken off in integers. Every row's sums are
// the same whatever the batch, on tiles or VNNI, so the logits do not depend on the batch.

// rows n0..n0+31 (row-major codes, row stride K) -> buf: per block b, the two B tiles (t:
// rows n0 + 16t ..) at buf + 1024 b; their scales to sbuf[b * 32 + j]
static void regroup_rows_q8(const int8_t *codes, const float *scales, int64_t K, int64_t n0,
                            uint8_t *buf, float *sbuf) {
    const int64_t nb = K / 32;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi_idx = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int64_t b = 0; b < nb; b++) {
        for (int t = 0; t < 2; t++) {
            const int8_t *src = codes + (n0 + 16 * t) * K + b * 32;
            // z[i]: rows i (low half) and i + 8 (high half), 8 groups of 4 bytes each
            __m512i z[8];
            for (int i = 0; i < 8; i++)
                z[i] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(src + i * K))),
                    _mm256_loadu_si256((const __m256i *)(src + (i + 8) * K)), 1);
            // per 128-bit lane, 4 x 4 transposes: u[g][d] holds group d (lanes 0, 2) and
            // d + 4 (lanes 1, 3) of rows 4g .. 4g + 3 (and 8 + 4g ..)
            __m512i u[2][4];
            for (int g = 0; g < 2; g++) {
                const __m512i *w = z + 4 * g;
                const __m512i t0 = _mm512_unpacklo_epi32(w[0], w[1]);
                const __m512i t1 = _mm512_unpackhi_epi32(w[0], w[1]);
                const __m512i t2 = _mm512_unpacklo_epi32(w[2], w[3]);
                const __m512i t3 = _mm512_unpackhi_epi32(w[2], w[3]);
                u[g][0] = _mm512_unpacklo_epi64(t0, t2);
                u[g][1] = _mm512_unpackhi_epi64(t0, t2);
                u[g][2] = _mm512_unpacklo_epi64(t1, t3);
                u[g][3] = _mm512_unpackhi_epi64(t1, t3);
            }
            uint8_t *dst = buf + b * 1024 + t * 512;
            for (int d = 0; d < 4; d++) {
                const __m512i a = _mm512_permutex2var_epi64(u[0][d], lo_idx, u[1][d]);
                const __m512i c = _mm512_permutex2var_epi64(u[0][d], hi_idx, u[1][d]);
                _mm512_store_si512(dst + d * 64, _mm512_xor_si512(a, flip));
                _mm512_store_si512(dst + (d + 4) * 64, _mm512_xor_si512(c, flip));
            }
        }
        for (int j = 0; j < 32; j++) sbuf[b * 32 + j] = scales[(n0 + j) * nb + b];
    }
}

// y[M, N] float32 (row stride ldy) = x[M, K] float32 (row stride ldx) @ W.T, W as for
// q8_amx_matmul. Returns -1 unless N % 32 == 0 and K % 32 == 0.
int q8_amx_matmul_i8(const int8_t *codes, const float *scales, int64_t N, int64_t K,
                     const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy) {
    if (N % 32 || K % 32 || M <= 0) return -1;
    const int64_t nb = K / 32;
    // q, r int8 [M, K] each, e float [M, nb], then the sums of q and r int32 [M, nb] each
    int8_t *q = amx_scratch_get(1, (size_t)(2 * M * K) + sizeof(float) * 3 * M * nb);
    if (!q) return -1;
    int8_t *r = q + M * K;
    float *e = (float *)(q + 2 * M * K);
    int32_t *qs = (int32_t *)(e + M * nb), *rs = qs + M * nb;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + m * ldx + b * 32;
            e[m * nb + b] = split_int8_block(_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16),
                                             q + m * K + b * 32, r + m * K + b * 32,
                                             qs + m * nb + b, rs + m * nb + b);
        }
    const __m512 fine = _mm512_set1_ps(1.0f / 256.0f);
#pragma omp parallel
    {
        uint8_t *buf = amx_scratch_get(0, (size_t)K * 32 + sizeof(float) * nb * 32);
        float *sbuf = (float *)(buf + K * 32);
        int32_t c[4][256] __attribute__((aligned(64)));
        __m512 acc[16][2];
        int configured = -1;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += 32) {
            regroup_rows_q8(codes, scales, K, n0, buf, sbuf);
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                int tiles;
                const int rows = i8_chunk_rows(M, m0, &configured, &tiles);
                for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; b++) {
                    block_dots_i8(buf + b * 1024, q + m0 * K + b * 32, r + m0 * K + b * 32, K,
                                  rows, tiles, c);
                    const __m512 s[2] = {_mm512_loadu_ps(sbuf + b * 32),
                                         _mm512_loadu_ps(sbuf + b * 32 + 16)};
                    for (int i = 0; i < rows; i++) {
                        const int64_t at = (m0 + i) * nb + b;
                        const __m512i q128 = _mm512_set1_epi32(128 * qs[at]);
                        const __m512i r128 = _mm512_set1_epi32(128 * rs[at]);
                        const __m512 er = _mm512_set1_ps(e[at]);
                        for (int t = 0; t < 2; t++) {
                            const __m512i dq = _mm512_sub_epi32(
                                _mm512_load_si512(c[t] + 16 * i), q128);
                            const __m512i dr = _mm512_sub_epi32(
                                _mm512_load_si512(c[2 + t] + 16 * i), r128);
                            const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dr), fine,
                                                               _mm512_cvtepi32_ps(dq));
                            acc[i][t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s[t], er), acc[i][t]);
                        }
                    }
                }
                for (int i = 0; i < rows; i++)
                    for (int t = 0; t < 2; t++)
                        _mm512_storeu_ps(y + (m0 + i) * ldy + n0 + 16 * t, acc[i][t]);
            }
        }
        amx_scratch_put(buf);
    }
    amx_scratch_put(q);
    return 0;
}
