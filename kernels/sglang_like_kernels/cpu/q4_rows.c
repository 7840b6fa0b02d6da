// Q4_1 weights repacked 16 output rows at a time ("x16"), x int8 activations: the decode
// step's and the speculative verify's matmul.
//
// q4_1.c's kernel walks one weight row at a time: every 32-weight block is expanded from
// nibbles, dotted with one activation block, converted to float and scaled, so each block
// costs a dozen instructions per activation row, and its time grows by about one row's for
// every 4 rows. Here the weights are stored transposed in groups of 16 rows, so that one
// 512-bit register holds 4 consecutive codes of each of the 16 rows: 8 `vpdpbusd` against a
// broadcast of 4 activation bytes give the 16 rows' integer dots over one block, and only
// then are they scaled (by the 16 rows' scales at once). The float work is per 16 rows,
// not per row, and the codes are expanded once for all activation rows.
//
// Layout, per group of 16 rows and block of 32 columns (320 bytes, group-major):
//   4 x 64 bytes: vector t in 0..3, 4 bytes per row r: byte j holds code[r][4t + j] in its
//                 low nibble and code[r][4(t + 4) + j] in its high nibble
//   16 x fp16 d, 16 x fp16 m    (w[r][i] = d[r] * code[r][i] + m[r], GGUF Q4_1's values)
// Activations are quantized per row and block of 32 to int8 (q4_1.c's quantize_row_q8: code
// q, scale e, sum S = e * sum(q)), so a block adds d * e * dot(code, q) + m * S.
//
// A row's sums run in the same order whatever M is (each activation row has its own
// accumulators; the blocks come in order), so its result is the same bits alone, in a batch
// or as a node of a speculative verify.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "ops.h"

#define XQK 32
#define X16_ROWS 16
#define X16_RECORD 320  // bytes per (group, block)
// each record's cache lines are prefetched this far ahead of its use: a thread streams its
// groups' records in order, and the prefetch keeps more of them in flight than the hardware
// prefetcher does (docs/cpu-kernels.md)
#define X16_PREFETCH (4 * X16_RECORD)

void *q4_1_quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t **q,
                         float **e, float **S);

// ---- the 16-lane dot: AVX-512 VNNI, or AVX2 on two halves --------------------------------
#ifdef Q4_VNNI
#define X16_MAX_ACT 8  // activation rows per pass over a group's codes (registers)

#define X16_PASS(R)                                                                            \
    static void x16_pass_##R(const uint8_t *grp, int nb, const int8_t *q, const float *e,     \
                             const float *S, int K, float *y, int64_t ldy) {                  \
        __m512 sum[R];                                                                         \
        for (int i = 0; i < R; i++) sum[i] = _mm512_setzero_ps();                              \
        const __m512i low = _mm512_set1_epi8(0x0F);                                            \
        for (int b = 0; b < nb; b++) {                                                         \
            const uint8_t *rec = grp + (int64_t)b * X16_RECORD;                                \
            for (int l = 0; l < X16_RECORD; l += 64)                                           \
                _mm_prefetch((const char *)rec + X16_PREFETCH + l, _MM_HINT_T0);               \
            __m512i c[8];                                                                      \
            for (int t = 0; t < 4; t++) {                                                      \
                const __m512i v = _mm512_loadu_si512((const void *)(rec + 64 * t));            \
                c[t] = _mm512_and_si512(v, low);                                               \
                c[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);                     \
            }                                                                                  \
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256)));\
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)));\
            for (int i = 0; i < R; i++) {                                                      \
                const int32_t *qb = (const int32_t *)(q + (int64_t)i * K + b * XQK);           \
                __m512i acc = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();           \
                for (int t = 0; t < 8; t += 2) { /* two chains: half the latency */            \
                    acc = _mm512_dpbusd_epi32(acc, c[t], _mm512_set1_epi32(qb[t]));            \
                    acc1 = _mm512_dpbusd_epi32(acc1, c[t + 1], _mm512_set1_epi32(qb[t + 1]));  \
                }                                                                              \
                acc = _mm512_add_epi32(acc, acc1);                                             \
                const int nbk = i * nb + b;                                                    \
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc),                              \
                                         _mm512_mul_ps(d, _mm512_set1_ps(e[nbk])), sum[i]);    \
                sum[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(S[nbk]), sum[i]);                   \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < R; i++) _mm512_storeu_ps(y + i * ldy, sum[i]);                     \
    }
#else
// 8 as with VNNI: 1.2x faster than 4 on a Zen 3 at 8 and 32 rows (kquants.c measured it)
#define X16_MAX_ACT 8

// 8 int32 lanes of sum(code * q) over the 32 bytes of c[0..7] (4 each): maddubs (u8 x s8
// pairs, each at most 15 * 127 * 2), the eight int16 results added while they cannot
// overflow (8 * 3810 < 2^15), then one madd against ones: the same integers as widening each
static inline __m256i x16_dot32(const __m256i c[8], const int32_t *qb) {
    __m256i p[8];
    for (int t = 0; t < 8; t++) p[t] = _mm256_maddubs_epi16(c[t], _mm256_set1_epi32(qb[t]));
    const __m256i a = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
    const __m256i b = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
    return _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
}

#define X16_PASS(R)                                                                            \
    static void x16_pass_##R(const uint8_t *grp, int nb, const int8_t *q, const float *e,     \
                             const float *S, int K, float *y, int64_t ldy) {                  \
        __m256 sum[R][2];                                                                      \
        for (int i = 0; i < R; i++) sum[i][0] = sum[i][1] = _mm256_setzero_ps();               \
        const __m256i low = _mm256_set1_epi8(0x0F);                                            \
        for (int b = 0; b < nb; b++) {                                                         \
            const uint8_t *rec = grp + (int64_t)b * X16_RECORD;                                \
            for (int l = 0; l < X16_RECORD; l += 64)                                           \
                _mm_prefetch((const char *)rec + X16_PREFETCH + l, _MM_HINT_T0);               \
            for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */                              \
                __m256i c[8];                                                                  \
                for (int t = 0; t < 4; t++) {                                                  \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * t + 32 * h));\
                    c[t] = _mm256_and_si256(v, low);                                           \
                    c[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);                 \
                }                                                                              \
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 256 + 16 * h)));\
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h)));\
                for (int i = 0; i < R; i++) {                                                  \
                    const int32_t *qb = (const int32_t *)(q + (int64_t)i * K + b * XQK);       \
                    const __m256i acc = x16_dot32(c, qb);                                      \
                    const int nbk = i * nb + b;                                                \
                    sum[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc),                       \
                                                _mm256_mul_ps(d, _mm256_set1_ps(e[nbk])),      \
                                                sum[i][h]);                                    \
                    sum[i][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(S[nbk]), sum[i][h]);         \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < R; i++) {                                                          \
            _mm256_storeu_ps(y + i * ldy, sum[i][0]);                                          \
            _mm256_storeu_ps(y + i * ldy + 8, sum[i][1]);                                      \
        }                                                                                      \
    }
#endif

X16_PASS(1)
X16_PASS(2)
X16_PASS(3)
X16_PASS(4)
#if X16_MAX_ACT > 4
X16_PASS(5)
X16_PASS(6)
X16_PASS(7)
X16_PASS(8)
#endif

typedef void (*x16_pass_fn)(const uint8_t *, int, const int8_t *, const float *, const float *,
                            int, float *, int64_t);
static const x16_pass_fn X16_PASSES[X16_MAX_ACT + 1] = {
    0, x16_pass_1, x16_pass_2, x16_pass_3, x16_pass_4,
#if X16_MAX_ACT > 4
    x16_pass_5, x16_pass_6, x16_pass_7, x16_pass_8,
#endif
};

// y [M, N] (row stride ldy) = activation rows already quantized (q [M, K], e/S [M, K/32])
// @ W.T: the groups of 16 output rows split over the team (ops.h)
void q4_x16_matmul_team(const uint8_t *w, int64_t N, int64_t K, const int8_t *q,
                        const float *e, const float *S, int64_t M, float *y, int64_t ldy) {
    const int nb = (int)(K / XQK);
    const int64_t groups = N / X16_ROWS, group_bytes = (int64_t)nb * X16_RECORD;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t r = 0; r < M; r += X16_MAX_ACT) {
            const int rows = (int)(M - r < X16_MAX_ACT ? M - r : X16_MAX_ACT);
            X16_PASSES[rows](w + g * group_bytes, nb, q + r * K, e + r * nb, S + r * nb,
                             (int)K, y + r * ldy + g * X16_ROWS, ldy);
        }
    }
}

// q4_x16_matmul_team's work for output group g (rows [16 g, 16 g + 16)) alone, on the
// calling thread: y points at the group's first column
void q4_x16_matmul_group(const uint8_t *w, int64_t g, int64_t K, const int8_t *q,
                         const float *e, const float *S, int64_t M, float *y, int64_t ldy) {
    const int nb = (int)(K / XQK);
    const uint8_t *grp = w + g * (int64_t)nb * X16_RECORD;
    for (int64_t r = 0; r < M; r += X16_MAX_ACT) {
        const int rows = (int)(M - r < X16_MAX_ACT ? M - r : X16_MAX_ACT);
        X16_PASSES[rows](grp, nb, q + r * K, e + r * nb, S + r * nb, (int)K, y + r * ldy, ldy);
    }
}

// y [M, N] (row stride ldy) = x [M, K] float32 (row stride ldx) @ W.T, W [N, K] in the x16
// layout (N a multiple of 16). Returns 0, or -1 when K is not a multiple of 32, N not of 16,
// or scratch could not be allocated.
int q4_x16_matmul(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t ldx,
                  int64_t M, float *y, int64_t ldy) {
    if (K % XQK != 0 || N % X16_ROWS != 0 || M <= 0 || N <= 0) return -1;
    int8_t *q;
    float *e, *S;
    void *scratch = q4_1_quantize_rows(x, ldx, M, K, &q, &e, &S);
    if (!scratch) return -1;
#pragma omp parallel
    q4_x16_matmul_team(w, N, K, q, e, S, M, y, ldy);
    free(scratch);
    return 0;
}

// Q4_1 blocks [N, K/32 * 20] -> the x16 layout [N/16 * K/32 * 320] (load time; plain C)
void q4_x16_pack(const uint8_t *blocks, int64_t N, int64_t K, uint8_t *out) {
    const int64_t nb = K / XQK, row_bytes = nb * 20;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / X16_ROWS; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *rec = out + (g * nb + b) * X16_RECORD;
            for (int r = 0; r < X16_ROWS; r++) {
                const uint8_t *blk = blocks + (g * X16_ROWS + r) * row_bytes + b * 20;
                uint8_t code[XQK];
                for (int j = 0; j < 16; j++) {
                    code[j] = blk[4 + j] & 0x0F;
                    code[j + 16] = blk[4 + j] >> 4;
                }
                for (int t = 0; t < 4; t++)
                    for (int j = 0; j < 4; j++)
                        rec[64 * t + 4 * r + j] =
                            (uint8_t)(code[4 * t + j] | (code[4 * (t + 4) + j] << 4));
                rec[256 + 2 * r] = blk[0];
                rec[256 + 2 * r + 1] = blk[1];
                rec[288 + 2 * r] = blk[2];
                rec[288 + 2 * r + 1] = blk[3];
            }
        }
    }
}

// the x16 layout -> float32 [N, K] (the prefill path's dense weight)
void q4_x16_dequantize(const uint8_t *w, int64_t N, int64_t K, float *out) {
    const int64_t nb = K / XQK;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / X16_ROWS; g++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *rec = w + (g * nb + b) * X16_RECORD;
            for (int r = 0; r < X16_ROWS; r++) {
                const float d = _cvtsh_ss(*(const uint16_t *)(rec + 256 + 2 * r));
                const float m = _cvtsh_ss(*(const uint16_t *)(rec + 288 + 2 * r));
                float *o = out + (g * X16_ROWS + r) * K + b * XQK;
                for (int t = 0; t < 4; t++) {
                    for (int j = 0; j < 4; j++) {
                        const uint8_t byte = rec[64 * t + 4 * r + j];
                        o[4 * t + j] = fmaf((float)(byte & 0x0F), d, m);
                        o[4 * (t + 4) + j] = fmaf((float)(byte >> 4), d, m);
                    }
                }
            }
        }
    }
}
