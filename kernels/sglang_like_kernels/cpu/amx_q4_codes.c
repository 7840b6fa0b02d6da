// int4 weights x bf16 activations below 256 rows (decode steps, speculative verifies, short
// prompts); the bf16 kernel in amx_q4.c, whose weight layout this one reads too, takes
// prefill chunks.
//
// The activations are first put on a grid per block of 32 columns: with the block's
// amax in [2^E, 2^(E+1)), each x becomes x' = Q * 2^(E-14), Q an integer (|Q| <= 32640).
// Values from 2^(E-7) up are on that grid already (bf16 keeps 8 bits); smaller ones keep an
// absolute 2^(E-15), about the precision of llama.cpp's int8 activations times 256. Then
// with c the int4 code (0..15) and w = (c - 8) * scale + zero in a group,
//     sum_k w_k x_k = scale * D + zero * X,   D = sum_k x'_k (c_k - 8),   X = sum_k x'_k,
// and D is a multiple of 2^(E-14) below 2^(E+9): 23 bits, so every way of adding it up,
// in any order and rounding, gives the same number. Two ways do:
// - tiles (more than VNNI_MAX_ROWS rows): each code as an exact bf16 integer, one
//   tdpbf16ps per block and 16 outputs against the x' as bf16;
// - VNNI (up to VNNI_MAX_ROWS rows, where the tiles' fixed cost per block dominates): Q as
//   256 Qh + Ql (Qh signed, Ql unsigned bytes), D = 2^(E-14) (256 sum Qh c + sum Ql c -
//   8 sum Q), vpdpbusd over the codes as bytes.
// Both then scale D in the same two fused multiply-adds, so a row's result is the same bits
// alone or in any batch, whichever path its batch took (a lone decode, its speculative
// verify and a batch of 32 agree). Putting the activations on the grid costs a little of
// each call, but without it the tiles' sums are not the VNNI path's: not batch invariant.
// Against the integer kernel it replaced (activations as two int8 parts, two tile products
// and nine vector operations a block) it is faster from 8 rows; timings in
// docs/cpu-kernels.md.

#include "amx.h"

#include <string.h>

// tmm0, 1 and 5, 6: C of even / odd blocks (output tile 0 / 1), tmm2: A (activation rows
// x 32 bf16), tmm3, 4: B (16 rows: k pairs, x 16 output columns x 2 bf16)
static void configure(int rows) {
    const int r[8] = {rows, rows, rows, 16, 16, rows, rows, 1};
    const int colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure(r, colsb);
}

// A 32-word table: entry i is the bf16 of (i & 15) - 8, so that an index whose bit 4 is
// the low bit of another nibble (vpermw reads bits 0..4) still finds its code
static __m512i code_table(void) {
    uint16_t t[32];
    for (int i = 0; i < 32; i++) {
        const float f = (float)((i & 15) - 8);
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        t[i] = (uint16_t)(u >> 16);
    }
    return _mm512_loadu_si512(t);
}

// One 32-row half (rows half * 32 .. of 64-row block blk) over all K -> buf: per block b of
// 32 columns, two B tiles (t = output rows 16t..) of 16 rows x 32 bf16: row kp holds, for
// each of 16 output rows j, the codes at k = 2kp and 2kp + 1 as bf16 (c - 8).
static void regroup_half(const uint8_t *codes, int64_t K, int64_t blk, int half,
                         const __m512i table, uint16_t *buf) {
    const uint8_t *base = codes + blk * K * 32;
    for (int64_t k = 0; k < K; k += 2) {
        uint16_t *row = buf + (k / 32) * 1024 + ((k % 32) / 2) * 32;
        // byte j of a k: row j's code in the low nibble, row j + 32's in the high one
        const __m256i a = _mm256_loadu_si256((const __m256i *)(base + k * 32));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(base + (k + 1) * 32));
        // per 128-bit lane, the bytes of k and k + 1 interleaved: rows 0-7 | 16-23, 8-15 | 24-31
        const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
        __m512i t0 = _mm512_cvtepu8_epi16(_mm256_permute2x128_si256(lo, hi, 0x20));
        __m512i t1 = _mm512_cvtepu8_epi16(_mm256_permute2x128_si256(lo, hi, 0x31));
        if (half) {
            t0 = _mm512_srli_epi16(t0, 4);
            t1 = _mm512_srli_epi16(t1, 4);
        }
        _mm512_store_si512(row, _mm512_permutexvar_epi16(t0, table));
        _mm512_store_si512(row + 512, _mm512_permutexvar_epi16(t1, table));
    }
}

// The VNNI path's B: one 32-row half over all K -> buf: per block b of 32 columns, two
// 8 rows x 64 bytes (t = output rows 16t..): row kq holds, for each of 16 output rows j,
// the codes at k = 4kq .. 4kq + 3.
static void regroup_half_bytes(const uint8_t *codes, int64_t K, int64_t blk, int half, uint8_t *buf) {
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

// Per block of 32 columns of one activation row: x' as bf16 (tiles) or Q as Qh, Ql bytes
// (VNNI), and the block's G = 2^(E-14), X = G sum Q and S = sum Q
typedef struct {
    float G, X;
    int32_t S;
} block_grid;

// Row-major x [M, K] (row stride ldx) onto the grid: xr bf16 [M, K] when xr, else qh, ql
// [M, K]; g[M, K/32]. A block below 2^-100 is zeros; one with an infinity or NaN gives NaN.
static void grid_activations(const uint16_t *x, int64_t ldx, int64_t M, int64_t K,
                             uint16_t *xr, int8_t *qh, uint8_t *ql, block_grid *g) {
    const int64_t nb = K / 32;
    // a few rows are not worth a parallel region (120 calls a decode step)
#pragma omp parallel for schedule(static) if (M > VNNI_MAX_ROWS)
    for (int64_t mb = 0; mb < M * nb; mb++) {
        const int64_t m = mb / nb, b = mb % nb;
        const uint16_t *xb = x + m * ldx + b * 32;
        __m512 v[2];
        for (int h = 0; h < 2; h++)
            v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256((const __m256i *)(xb + 16 * h))), 16));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]),
                                                              _mm512_abs_ps(v[1])));
        uint32_t bits;
        memcpy(&bits, &amax, sizeof bits);
        const int e = (int)(bits >> 23);  // biased exponent of amax (E + 127)
        // (max_ps passes a NaN over: found apart)
        const int nan = (_mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) |
                         _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q)) != 0;
        const int finite = e < 255 && !nan, ok = finite && e >= 27;
        // G = 2^(E-14), 1/G, and 1.5 * 2^(E+9), whose float spacing is G: x + that - that
        // is x rounded to the grid (to nearest even, as Q is)
        const uint32_t gbits = ok ? (uint32_t)(e - 14) << 23 : 0;
        const uint32_t ibits = ok ? (uint32_t)(268 - e) << 23 : 0;
        const uint32_t mbits = ok ? (uint32_t)(e + 9) << 23 | 0x400000u : 0;
        float G, inv, magic;
        memcpy(&G, &gbits, sizeof G);
        memcpy(&inv, &ibits, sizeof inv);
        memcpy(&magic, &mbits, sizeof magic);
        const int64_t at = m * K + b * 32;
        int32_t S = 0;
        float X;
        if (xr) {
            const __m512 mg = _mm512_set1_ps(magic);
            __m512 r[2];
            for (int h = 0; h < 2; h++) {
                r[h] = ok ? _mm512_sub_ps(_mm512_add_ps(v[h], mg), mg) : _mm512_setzero_ps();
                _mm256_storeu_si256((__m256i *)(xr + at + 16 * h),
                                    (__m256i)_mm512_cvtneps_pbh(r[h]));
            }
            X = _mm512_reduce_add_ps(_mm512_add_ps(r[0], r[1]));  // exact: on the grid
        } else {
            __m512i sum = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)));
                sum = _mm512_add_epi32(sum, q);
                _mm_storeu_si128((__m128i *)(qh + at + 16 * h),
                                 _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 8)));
                _mm_storeu_si128((__m128i *)(ql + at + 16 * h),
                                 _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(255))));
            }
            S = _mm512_reduce_add_epi32(sum);
            X = (float)S * G;
        }
        g[mb] = (block_grid){G, finite ? X : __builtin_nanf(""), S};
    }
}

// One block's D for `rows` (<= VNNI_MAX_ROWS) rows on VNNI: out[t][16 i ..] as the tiles
// would store them (b_bytes: regroup_half_bytes's block; qh, ql at the block, row stride K)
static inline void block_dots_vnni(const uint8_t *b_bytes, const int8_t *qh, const uint8_t *ql,
                                   const block_grid *g, int64_t nb, int64_t K, int rows,
                                   float out[2][256]) {
    for (int i = 0; i < rows; i++) {
        for (int t = 0; t < 2; t++) {
            const uint8_t *bt = b_bytes + t * 512;
            __m512i dh = _mm512_setzero_si512(), dl = _mm512_setzero_si512();
            for (int kq = 0; kq < 8; kq++) {
                const __m512i w = _mm512_load_si512(bt + kq * 64);
                int32_t h4, l4;
                memcpy(&h4, qh + i * K + 4 * kq, 4);
                memcpy(&l4, ql + i * K + 4 * kq, 4);
                dh = _mm512_dpbusd_epi32(dh, w, _mm512_set1_epi32(h4));  // codes x Qh
                dl = _mm512_dpbusd_epi32(dl, _mm512_set1_epi32(l4), w);  // Ql x codes
            }
            // 256 sum Qh c + sum Ql c - 8 sum Q: below 2^23 in magnitude, exact in a float
            const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(dh, 8), dl),
                                               _mm512_set1_epi32(8 * g[i * nb].S));
            _mm512_store_ps(out[t] + 16 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(d),
                                                           _mm512_set1_ps(g[i * nb].G)));
        }
    }
}

// One block's tile products for the configured rows of xa (row stride ldx) into out[0],
// out[1] (rows x 16 fp32 each), on C tiles c0, c1 (the tile numbers are immediates)
#define BLOCK_DOTS(c0, c1, xa, ldx, b_tiles, out) \
    do {                                        \
        _tile_zero(c0);                         \
        _tile_zero(c1);                         \
        _tile_loadd(2, xa, (ldx) * 2);          \
        _tile_loadd(3, b_tiles, 64);            \
        _tile_loadd(4, (b_tiles) + 512, 64);    \
        _tile_dpbf16ps(c0, 2, 3);               \
        _tile_dpbf16ps(c1, 2, 4);               \
        _tile_stored(c0, (out)[0], 64);         \
        _tile_stored(c1, (out)[1], 64);         \
    } while (0)

// y[M, N] (bf16, row stride ldy) = x[M, K] (bf16, row stride ldx) @ W.T, W as for
// q4_amx_matmul. Returns -1 unless N % 64 == 0, K % 32 == 0 and group % 32 == 0.
int q4_amx_matmul_codes(const uint8_t *codes, const uint16_t *sz, int64_t N, int64_t K,
                        int64_t group, const uint16_t *x, int64_t ldx, int64_t M, uint16_t *y,
                        int64_t ldy) {
    if (N % 64 || K % 32 || group % 32 || group <= 0 || M <= 0) return -1;
    const int64_t nb = K / 32, halves = N / 32;
    const int tiles = M > VNNI_MAX_ROWS;
    // the grid per block, then x' bf16 [M, K] (tiles) or Qh, Ql [M, K] (VNNI)
    block_grid *g = amx_scratch_get(1, sizeof(block_grid) * M * nb + (size_t)(2 * M * K));
    if (!g) return -1;
    uint8_t *act = (uint8_t *)(g + M * nb);
    uint16_t *xr = tiles ? (uint16_t *)act : NULL;
    int8_t *qh = (int8_t *)act;
    uint8_t *ql = act + M * K;
    grid_activations(x, ldx, M, K, xr, qh, ql, g);
    const __m512i table = code_table();
#pragma omp parallel
    {
        void *buf = amx_scratch_get(0, (size_t)K * (tiles ? 64 : 32));
        float c[2][2][256] __attribute__((aligned(64)));
        __m512 acc[16][2];
        int configured = -1;
#pragma omp for schedule(static)
        for (int64_t h = 0; h < halves; h++) {
            if (tiles)
                regroup_half(codes, K, h / 2, (int)(h % 2), table, buf);
            else
                regroup_half_bytes(codes, K, h / 2, (int)(h % 2), buf);
            const int64_t n0 = h * 32;
            const uint8_t *next_codes = h / 2 + 1 < N / 64 ? codes + (h / 2 + 1) * K * 32 : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
                if (tiles && rows != configured) {
                    configure(rows);
                    configured = rows;
                }
                for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
                // block b's dots go out before block b - 1's epilogue, into the other pair of
                // C tiles and buffers, so that the two overlap
                for (int64_t b = 0; b <= nb; b++) {
                    if (b < nb) {
                        if (m0 == 0) prefetch_next_codes(next_codes, (int)(h % 2), nb, b);
                        if (!tiles) {
                            block_dots_vnni((const uint8_t *)buf + b * 1024, qh + m0 * K + b * 32,
                                            ql + m0 * K + b * 32, g + m0 * nb + b, nb, K, rows,
                                            c[b & 1]);
                        } else {
                            const uint16_t *xa = xr + m0 * K + b * 32;
                            const uint16_t *bt = (const uint16_t *)buf + b * 1024;
                            if (b & 1)
                                BLOCK_DOTS(5, 6, xa, K, bt, c[1]);
                            else
                                BLOCK_DOTS(0, 1, xa, K, bt, c[0]);
                        }
                    }
                    if (b == 0) continue;
                    const int64_t bp = b - 1;
                    float(*cp)[256] = c[bp & 1];
                    __m512 s[2], z[2];
                    load_scale_zero(sz, bp * 32 / group, N, n0, s, z);
                    for (int i = 0; i < rows; i++) {
                        const __m512 xs = _mm512_set1_ps(g[(m0 + i) * nb + bp].X);
                        for (int t = 0; t < 2; t++)
                            acc[i][t] = _mm512_fmadd_ps(_mm512_load_ps(cp[t] + 16 * i), s[t],
                                                        _mm512_fmadd_ps(z[t], xs, acc[i][t]));
                    }
                }
                store_rows_bf16(acc, rows, y + m0 * ldy, ldy, n0);
            }
        }
        amx_scratch_put(buf);
    }
    amx_scratch_put(g);
    return 0;
}
