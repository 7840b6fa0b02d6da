// int4 weights x bf16 activations on AMX tiles, the codes going in as exact bf16 integers:
// the kernel for mid-sized batches (decode batches of a dozen rows and up, verifies of many
// trees, short prompts), between the integer kernel (a few rows) and the bf16 one (long
// prefill chunks), both in amx_q4.c, whose weight layout this one reads too.
//
// Each code c (0..15) is exactly representable in bf16, so per block of 32 columns one
// tdpbf16ps of the activations as they come (bf16) against the codes gives
//     D = sum_k x_k (c_k - 8)
// with exact products and fp32 sums, and with w = (c - 8) * scale + zero in a group,
//     sum_k w_k x_k = scale * D + zero * X,    X = sum_k x_k over the block.
// Against the integer kernel this is one tile product per block and output tile instead of
// two (the activations need no second part to keep their bits: they go in whole), no
// activation quantization, and an epilogue of two fused multiply-adds per row and 16
// outputs instead of nine operations. Against the bf16 kernel the weights are only
// regrouped (a table lookup per code), not converted and split in two. At 32 rows a
// decode step's 120 int4 matmuls took 9.2 ms here against the integer kernel's 14.1 and
// the bf16 kernel's 13.2; below a dozen rows the integer kernel's VNNI path is faster
// (one row: 2.8 ms against 5.0, the tiles' fixed cost per block).
//
// A row's result does not depend on the other rows (the tiles compute each row alone), but
// it is not bit-equal to the integer kernel's: callers that need one result whatever the
// batch keep the integer kernel at every row count.

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

// Block sums X[m, b] of the activations, in fp32 (the same order for every row)
static void block_sums(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, float *X) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const uint16_t *xb = x + m * ldx + b * 32;
            const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)xb)), 16));
            const __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + 16))), 16));
            X[m * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
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
    float *X = amx_scratch_get(1, sizeof(float) * M * nb);
    if (!X) return -1;
    block_sums(x, ldx, M, K, X);
    const __m512i table = code_table();
#pragma omp parallel
    {
        uint16_t *buf = amx_scratch_get(0, (size_t)K * 64);
        float c[2][2][256] __attribute__((aligned(64)));
        __m512 acc[16][2];
        int configured = -1;
#pragma omp for schedule(static)
        for (int64_t h = 0; h < halves; h++) {
            regroup_half(codes, K, h / 2, (int)(h % 2), table, buf);
            const int64_t n0 = h * 32;
            const uint8_t *next_codes = h / 2 + 1 < N / 64 ? codes + (h / 2 + 1) * K * 32 : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
                if (rows != configured) {
                    configure(rows);
                    configured = rows;
                }
                for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
                // block b's tile work goes out before block b - 1's epilogue, into the other
                // pair of C tiles and buffers, so that the two overlap
                for (int64_t b = 0; b <= nb; b++) {
                    if (b < nb) {
                        if (m0 == 0) prefetch_next_codes(next_codes, (int)(h % 2), nb, b);
                        const uint16_t *xa = x + m0 * ldx + b * 32, *bt = buf + b * 1024;
                        if (b & 1)
                            BLOCK_DOTS(5, 6, xa, ldx, bt, c[1]);
                        else
                            BLOCK_DOTS(0, 1, xa, ldx, bt, c[0]);
                    }
                    if (b == 0) continue;
                    const int64_t bp = b - 1, g = bp * 32 / group;
                    float(*cp)[256] = c[bp & 1];
                    __m512 s[2], z[2];
                    load_scale_zero(sz, g, N, n0, s, z);
                    for (int i = 0; i < rows; i++) {
                        const __m512 xr = _mm512_set1_ps(X[(m0 + i) * nb + bp]);
                        for (int t = 0; t < 2; t++)
                            acc[i][t] = _mm512_fmadd_ps(_mm512_load_ps(cp[t] + 16 * i), s[t],
                                                        _mm512_fmadd_ps(z[t], xr, acc[i][t]));
                    }
                }
                store_rows_bf16(acc, rows, y + m0 * ldy, ldy, n0);
            }
        }
        amx_scratch_put(buf);
    }
    amx_scratch_put(X);
    return 0;
}
