// kquants.c's records (every GGUF kind, and q4_rows.c's x16 Q4_1, whose record is KQ_Q4M's)
// x int8 activations on AMX-INT8 tiles: the same bits as kquants.c's VNNI kernel and as
// q4_rows.c, faster from a dozen rows (prefill chunks, batched decode, verifies, experts).
//
// kq_expand16 turns a record into 8 vectors whose byte 4r + j of vector t is code[r][4t + j]:
// exactly the 8 rows of an AMX B tile for K = 32 and 16 output columns. One `tdpbsud` (signed
// activation bytes x unsigned codes) then gives a block's integer dots for up to 16
// activation rows x 16 output rows: the sums `vpdpbusd` adds up in kquants.c (integers, so
// any order gives the same number). Q6_K's scale per 16 columns needs its two halves apart:
// two tile products of K = 16. Each block is then scaled with kquants.c's float steps in its
// order, so a row's result is the same bits here as there, alone or in any batch: switching
// kernels by row count changes no output (tests/kernels/test_gguf_kernels.py).
//
// Work item: one group of 16 output rows over a run of activation rows: the group's records
// are expanded once into a B-tile buffer (512 bytes a block), then each 16-row chunk walks
// the blocks, block b's tile product issued before block b - 1's scaling so the two overlap.

#include "amx.h"
#include "kquants.h"

#include <stdlib.h>

#define KQ_ROW_BLOCK 128  // activation rows per work item of kq_amx_matmul (stay in L2)

void q4_1_quantize_row_q8(const float *x, int K, int8_t *q, float *e, float *S);

// tiles: even blocks C 0 (and 1: the high half for Q6_K), odd blocks C 2 (and 3); A 4, B 5
// for K = 32, or A 4 / 6 and B 5 / 7 for the two halves of K = 16
static void configure_kq(int mode, int rows) {
    if (mode == MODE_OFF16) {
        const int r[8] = {rows, rows, rows, rows, rows, 4, rows, 4};
        const int colsb[8] = {64, 64, 64, 64, 16, 64, 16, 64};
        amx_configure(r, colsb);
    } else {
        const int r[8] = {rows, 0, rows, 0, rows, 8, 0, 0};
        const int colsb[8] = {64, 0, 64, 0, 32, 64, 0, 0};
        amx_configure(r, colsb);
    }
}

// block b's integer dots for the configured rows (q at the block, row stride K) into out
// (16 x 16 int32; Q6_K: out + 256 the high half), on C tiles c / c + 1 (immediates)
#define KQ_DOTS32(c, q, K, bt, out) \
    do {                            \
        _tile_zero(c);              \
        _tile_loadd(4, q, K);       \
        _tile_loadd(5, bt, 64);     \
        _tile_dpbsud(c, 4, 5);      \
        _tile_stored(c, out, 64);   \
    } while (0)
#define KQ_DOTS16(c, c1, q, K, bt, out)    \
    do {                                   \
        _tile_zero(c);                     \
        _tile_zero(c1);                    \
        _tile_loadd(4, q, K);              \
        _tile_loadd(5, bt, 64);            \
        _tile_loadd(6, (q) + 16, K);       \
        _tile_loadd(7, (bt) + 256, 64);    \
        _tile_dpbsud(c, 4, 5);             \
        _tile_dpbsud(c1, 6, 7);            \
        _tile_stored(c, out, 64);          \
        _tile_stored(c1, (out) + 256, 64); \
    } while (0)

typedef struct {
    const int8_t *q;  // [rows, K]
    const float *e, *S;  // [rows, nb]
    const int32_t *qs;   // [rows, 2 nb] (offset kinds)
} kq_rows;

// y[0 .. rows) x 16 outputs of one group, for <= 16 activation rows
static inline __attribute__((always_inline)) void chunk(int kind, const uint8_t *grp,
                                                        const uint8_t *tiles, int64_t nb,
                                                        int64_t K, const kq_rows *a, int rows,
                                                        float *y, int64_t ldy) {
    const int rs = kq_record_size(kind), cb = code_bytes(KQ_BITS[kind]);
    const int mode = KQ_MODE[kind], off = KQ_OFF[kind];
    int32_t c[2][512] __attribute__((aligned(64)));
    __m512 sum[16];
    for (int i = 0; i < rows; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b <= nb; b++) {
        if (b < nb) {
            const int8_t *qb = a->q + b * XQK;
            const uint8_t *bt = tiles + b * 512;
            if (mode == MODE_OFF16) {
                if (b & 1)
                    KQ_DOTS16(2, 3, qb, K, bt, c[1]);
                else
                    KQ_DOTS16(0, 1, qb, K, bt, c[0]);
            } else {
                if (b & 1)
                    KQ_DOTS32(2, qb, K, bt, c[1]);
                else
                    KQ_DOTS32(0, qb, K, bt, c[0]);
            }
        }
        if (b == 0) continue;
        const int64_t bp = b - 1;
        const uint8_t *rec = grp + bp * rs;
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb)));
        const __m512 d1 = mode == MODE_OFF32
                              ? d0
                              : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb + 32)));
        const int32_t *cp = c[bp & 1];
        for (int i = 0; i < rows; i++) {
            const int64_t at = (int64_t)i * nb + bp;
            const __m512 e = _mm512_set1_ps(a->e[at]);
            const __m512i dot = _mm512_load_si512(cp + 16 * i);
            if (mode == MODE_OFF16) {
                const int32_t *qs = a->qs + 2 * at;
                const __m512i hi = _mm512_load_si512(cp + 256 + 16 * i);
                const __m512i lo = _mm512_sub_epi32(dot, _mm512_set1_epi32(off * qs[0]));
                const __m512i hs = _mm512_sub_epi32(hi, _mm512_set1_epi32(off * qs[1]));
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(d0, e), sum[i]);
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hs), _mm512_mul_ps(d1, e), sum[i]);
            } else if (mode == MODE_OFF32) {
                const int32_t *qs = a->qs + 2 * at;
                const __m512i acc = _mm512_sub_epi32(dot, _mm512_set1_epi32(off * (qs[0] + qs[1])));
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d0, e), sum[i]);
            } else {
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d0, e), sum[i]);
                sum[i] = _mm512_fmadd_ps(d1, _mm512_set1_ps(a->S[at]), sum[i]);
            }
        }
    }
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(y + i * ldy, sum[i]);
}

// one kind's work item: group `grp` (nb records) over M rows, with the thread's tile buffer
#define KQ_GROUP_FN(KIND)                                                                      \
    static void group_##KIND(const uint8_t *grp, uint8_t *tiles, int64_t nb, int64_t K,       \
                             const kq_rows *a, int64_t M, float *y, int64_t ldy) {            \
        const int rs = kq_record_size(KIND);                                                  \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            __m512i v[8];                                                                     \
            kq_expand16(grp + b * rs, KIND, v);                                               \
            for (int t = 0; t < 8; t++) _mm512_store_si512(tiles + b * 512 + 64 * t, v[t]);  \
        }                                                                                     \
        int configured = -1;                                                                  \
        for (int64_t m0 = 0; m0 < M; m0 += 16) {                                              \
            const int rows = M - m0 < 16 ? (int)(M - m0) : 16;                                \
            if (rows != configured) {                                                         \
                configure_kq(KQ_MODE[KIND], rows);                                            \
                configured = rows;                                                            \
            }                                                                                 \
            const int64_t nbk = m0 * nb;                                                      \
            const kq_rows r = {a->q + m0 * K, a->e + nbk, a->S + nbk,                         \
                               a->qs ? a->qs + 2 * nbk : NULL};                               \
            chunk(KIND, grp, tiles, nb, K, &r, rows, y + m0 * ldy, ldy);                      \
        }                                                                                     \
    }
KQ_GROUP_FN(KQ_Q4M)
KQ_GROUP_FN(KQ_IQ4)
KQ_GROUP_FN(KQ_Q5O)
KQ_GROUP_FN(KQ_Q5M)
KQ_GROUP_FN(KQ_Q6)
KQ_GROUP_FN(KQ_Q8)

typedef void (*group_fn)(const uint8_t *, uint8_t *, int64_t, int64_t, const kq_rows *, int64_t,
                         float *, int64_t);
static const group_fn GROUP[KQ_KINDS] = {group_KQ_Q4M, group_KQ_IQ4, group_KQ_Q5O,
                                         group_KQ_Q5M, group_KQ_Q6,  group_KQ_Q8};

// Group g (output rows [16 g, 16 g + 16)) of W packed as `kind` (-1: x16 Q4_1) over M rows
// already quantized as kquants.c takes them (q [M, K], e/S [M, K/32], qs [M, K/16], qs
// unused by the min kinds and NULL allowed there), on the calling thread: y points at the
// group's first column. Returns -1 (nothing written) for a bad kind or shape or when the
// tile buffer could not be allocated: the caller then runs the vector kernel.
int kq_amx_group(int kind, const uint8_t *w, int64_t g, int64_t K, const int8_t *q,
                 const float *e, const float *S, const int32_t *qs, int64_t M, float *y,
                 int64_t ldy) {
    if (kind < 0) kind = KQ_Q4M;
    if (kind >= KQ_KINDS || K % XQK || M <= 0) return -1;
    if (KQ_MODE[kind] != MODE_MIN32 && !qs) return -1;
    const int64_t nb = K / XQK;
    uint8_t *tiles = amx_scratch_get(0, (size_t)nb * 512);
    if (!tiles) return -1;
    const kq_rows a = {q, e, S, qs};
    GROUP[kind](w + g * nb * kq_record_size(kind), tiles, nb, K, &a, M, y, ldy);
    amx_scratch_put(tiles);
    return 0;
}

// y [M, N] float32 (row stride ldy) = x [M, K] float32 (row stride ldx) @ W.T, W [N, K]
// packed as `kind` (-1: x16 Q4_1). Returns -1 for a bad kind or shape, or out of memory.
int kq_amx_matmul(int kind, const uint8_t *w, int64_t N, int64_t K, const float *x,
                  int64_t ldx, int64_t M, float *y, int64_t ldy) {
    if (kind < 0) kind = KQ_Q4M;
    if (kind >= KQ_KINDS || K % XQK || N % KQ_ROWS || M <= 0 || N <= 0) return -1;
    const int64_t nb = K / XQK, groups = N / KQ_ROWS;
    // q int8 [M, K], then e and S float [M, nb], then qs int32 [M, 2 nb]
    int8_t *q = amx_scratch_get(1, (size_t)(M * K) + sizeof(float) * 4 * (size_t)(M * nb));
    if (!q) return -1;
    float *e = (float *)(q + M * K), *S = e + M * nb;
    int32_t *qs = (int32_t *)(S + M * nb);
#pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t r = 0; r < M; r++) {
        q4_1_quantize_row_q8(x + r * ldx, (int)K, q + r * K, e + r * nb, S + r * nb);
        kq_sums16(q + r * K, K, qs + r * 2 * nb);
    }
    const int64_t row_blocks = (M + KQ_ROW_BLOCK - 1) / KQ_ROW_BLOCK;
    const int64_t group_bytes = nb * kq_record_size(kind);
    int failed = 0;
#pragma omp parallel
    {
        uint8_t *tiles = amx_scratch_get(0, (size_t)nb * 512);
        if (!tiles) failed = 1;
#pragma omp for collapse(2) schedule(static)
        for (int64_t rb = 0; rb < row_blocks; rb++) {
            for (int64_t g = 0; g < groups; g++) {
                if (!tiles) continue;
                const int64_t m0 = rb * KQ_ROW_BLOCK;
                const int64_t rows = M - m0 < KQ_ROW_BLOCK ? M - m0 : KQ_ROW_BLOCK;
                const kq_rows a = {q + m0 * K, e + m0 * nb, S + m0 * nb, qs + m0 * 2 * nb};
                GROUP[kind](w + g * group_bytes, tiles, nb, K, &a, rows,
                            y + m0 * ldy + g * KQ_ROWS, ldy);
            }
        }
        amx_scratch_put(tiles);
    }
    amx_scratch_put(q);
    return failed ? -1 : 0;
}
