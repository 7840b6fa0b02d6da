// Q8_0 weights (int8 codes, one scale per 32 columns) repacked 16 output rows at a time, x
// int8 activations: the LM head of a quantized model at decode and verify sizes.
//
// As q4_rows.c: one 512-bit register holds 4 consecutive codes of each of 16 rows, so 8
// integer dot instructions against a broadcast of 4 activation bytes give the 16 rows' dots
// over one block, scaled once per 16 rows. q8_0_matmul_f32 (q4_1.c) widens every block to
// float and spends 2 FMAs per 32 weights per activation row; here a row costs 8 integer dots
// per 16 x 32 weights.
//
// Logits stay near float32's: each activation block is rounded to two int8 parts, x ~ e * (254
// q1 + q2) with e = amax / (127 * 254) (about 15 bits; the second part is the first's
// rounding error), so a block costs 16 dots per row, and the sum 254 * dot(w, q1) + dot(w, q2)
// is exact in int32.
//
// Layout: codes int8 [N/16, K/32, 8, 16, 4] (vector t of block b, row r: codes 4t..4t+3) and
// scales float32 [N/16, K/32, 16]. The integer dot of AVX-512 VNNI is unsigned x signed: the
// codes are flipped to unsigned (xor 0x80 = +128) and 128 * sum(q) taken off again, exactly;
// AVX2's `vpmaddubsw` gets |code| and q with the code's sign (no int16 overflow: 128 * 127 * 2).

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define Q8X_QK 32
#define Q8X_ROWS 16

#ifdef Q4_VNNI
#define Q8X_MAX_ACT 8

// a block's 8 code vectors of 16 rows, flipped to unsigned for vpdpbusd (xor 0x80 = +128)
static inline void q8x_load_codes(const int8_t *blk, __m512i c[8]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int t = 0; t < 8; t++)
        c[t] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(blk + 64 * t)), flip);
}

#define Q8X_PASS(R)                                                                            \
    static void q8x_pass_##R(const int8_t *codes, const float *scales, int nb,                 \
                             const int8_t *q1, const int8_t *q2, const float *e,              \
                             const int32_t *corr, int K, float *y, int64_t ldy) {             \
        __m512 sum[R];                                                                         \
        for (int i = 0; i < R; i++) sum[i] = _mm512_setzero_ps();                              \
        for (int b = 0; b < nb; b++) {                                                         \
            __m512i c[8];                                                                      \
            q8x_load_codes(codes + (int64_t)b * 512, c);                                       \
            const __m512 d = _mm512_loadu_ps(scales + b * Q8X_ROWS);                           \
            for (int i = 0; i < R; i++) {                                                      \
                const int64_t at = (int64_t)i * K + b * Q8X_QK;                                \
                const int32_t *qa = (const int32_t *)(q1 + at), *qb = (const int32_t *)(q2 + at);\
                __m512i a1 = _mm512_setzero_si512(), a2 = _mm512_setzero_si512();              \
                for (int t = 0; t < 8; t++) {                                                  \
                    a1 = _mm512_dpbusd_epi32(a1, c[t], _mm512_set1_epi32(qa[t]));              \
                    a2 = _mm512_dpbusd_epi32(a2, c[t], _mm512_set1_epi32(qb[t]));              \
                }                                                                              \
                const int nbk = i * nb + b;                                                    \
                /* 254 * a1 + a2 - corr, exact in int32 */                                     \
                const __m512i a = _mm512_sub_epi32(                                            \
                    _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(a1, 8),                \
                                                      _mm512_slli_epi32(a1, 1)), a2),         \
                    _mm512_set1_epi32(corr[nbk]));                                             \
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a),                                \
                                         _mm512_mul_ps(d, _mm512_set1_ps(e[nbk])), sum[i]);    \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < R; i++) _mm512_storeu_ps(y + i * ldy, sum[i]);                     \
    }
#else
#define Q8X_MAX_ACT 4

#define Q8X_PASS(R)                                                                            \
    static void q8x_pass_##R(const int8_t *codes, const float *scales, int nb,                 \
                             const int8_t *q1, const int8_t *q2, const float *e,              \
                             const int32_t *corr, int K, float *y, int64_t ldy) {             \
        (void)corr;                                                                            \
        __m256 sum[R][2];                                                                      \
        for (int i = 0; i < R; i++) sum[i][0] = sum[i][1] = _mm256_setzero_ps();               \
        const __m256i ones = _mm256_set1_epi16(1);                                             \
        for (int b = 0; b < nb; b++) {                                                         \
            const int8_t *blk = codes + (int64_t)b * 512;                                      \
            for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */                              \
                __m256i c[8], a[8];                                                            \
                for (int t = 0; t < 8; t++) {                                                  \
                    c[t] = _mm256_loadu_si256((const __m256i *)(blk + 64 * t + 32 * h));       \
                    a[t] = _mm256_abs_epi8(c[t]);                                              \
                }                                                                              \
                const __m256 d = _mm256_loadu_ps(scales + b * Q8X_ROWS + 8 * h);               \
                for (int i = 0; i < R; i++) {                                                  \
                    const int64_t at = (int64_t)i * K + b * Q8X_QK;                            \
                    const int32_t *qa = (const int32_t *)(q1 + at);                            \
                    const int32_t *qb = (const int32_t *)(q2 + at);                            \
                    __m256i a1 = _mm256_setzero_si256(), a2 = _mm256_setzero_si256();          \
                    for (int t = 0; t < 8; t++) {                                              \
                        const __m256i v1 = _mm256_sign_epi8(_mm256_set1_epi32(qa[t]), c[t]);   \
                        const __m256i v2 = _mm256_sign_epi8(_mm256_set1_epi32(qb[t]), c[t]);   \
                        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(a[t], v1), ones));\
                        a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_maddubs_epi16(a[t], v2), ones));\
                    }                                                                          \
                    const __m256i acc = _mm256_add_epi32(                                      \
                        _mm256_sub_epi32(_mm256_slli_epi32(a1, 8), _mm256_slli_epi32(a1, 1)), a2);\
                    sum[i][h] = _mm256_fmadd_ps(                                               \
                        _mm256_cvtepi32_ps(acc),                                               \
                        _mm256_mul_ps(d, _mm256_set1_ps(e[i * nb + b])), sum[i][h]);           \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < R; i++) {                                                          \
            _mm256_storeu_ps(y + i * ldy, sum[i][0]);                                          \
            _mm256_storeu_ps(y + i * ldy + 8, sum[i][1]);                                      \
        }                                                                                      \
    }
#endif

Q8X_PASS(1)
Q8X_PASS(2)
Q8X_PASS(3)
Q8X_PASS(4)
#if Q8X_MAX_ACT > 4
Q8X_PASS(5)
Q8X_PASS(6)
Q8X_PASS(7)
Q8X_PASS(8)
#endif

typedef void (*q8x_pass_fn)(const int8_t *, const float *, int, const int8_t *, const int8_t *,
                            const float *, const int32_t *, int, float *, int64_t);
static const q8x_pass_fn Q8X_PASSES[Q8X_MAX_ACT + 1] = {
    0, q8x_pass_1, q8x_pass_2, q8x_pass_3, q8x_pass_4,
#if Q8X_MAX_ACT > 4
    q8x_pass_5, q8x_pass_6, q8x_pass_7, q8x_pass_8,
#endif
};

// y [M, N] (row stride ldy) = x [M, K] float32 @ W.T, W in the q8 x16 layout (codes, scales;
// N a multiple of 16), activations in two int8 parts. Returns 0, or -1 for a bad shape or failed scratch.
int q8_x16_matmul(const int8_t *codes, const float *scales, int64_t N, int64_t K,
                  const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy) {
    if (K % Q8X_QK != 0 || N % Q8X_ROWS != 0 || M <= 0 || N <= 0) return -1;
    const int nb = (int)(K / Q8X_QK);
    int8_t *q1 = (int8_t *)malloc((size_t)(M * K)), *q2 = (int8_t *)malloc((size_t)(M * K));
    float *e = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    int32_t *corr = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * nb));
    if (!q1 || !q2 || !e || !corr) {
        free(q1); free(q2); free(e); free(corr);
        return -1;
    }
    for (int64_t r = 0; r < M; r++)
        quantize_row_2x8(x + r * ldx, (int)K, q1 + r * K, q2 + r * K, e + r * nb, corr + r * nb);
    const int64_t groups = N / Q8X_ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t r = 0; r < M; r += Q8X_MAX_ACT) {
            const int rows = (int)(M - r < Q8X_MAX_ACT ? M - r : Q8X_MAX_ACT);
            Q8X_PASSES[rows](codes + g * nb * 512, scales + g * nb * Q8X_ROWS, nb, q1 + r * K,
                             q2 + r * K, e + r * nb, corr + r * nb, (int)K,
                             y + r * ldy + g * Q8X_ROWS, ldy);
        }
    }
    free(q1); free(q2); free(e); free(corr);
    return 0;
}

// ---- greedy rows: the argmax of the logits, the second part only where it can matter ------
//
// A greedy decode needs only each row's argmax. The first activation part alone gives every
// logit to within the second part's contribution, which |q2| <= 127 bounds per vocabulary row
// v and block b: |lo_vb| <= |d_vb| * sum_j |c_vbj| * 127 e_b, so |lo_v| <= w1[v] * 127 sum_b e_b
// with w1[v] the row's largest |d_vb| sum_j |c_vbj| (computed at load). With hi_v the one-part
// logit and B_v = 1.02 times that (the 2% covers both sums' float rounding: 20 terms of
// relative error 1.2e-6, of magnitude <= 254 B_v), the two-part maximum is >= L = max_v (hi_v -
// B_v), and only rows with hi_v + B_v >= L can reach it. Their 16-row groups are computed in
// full by the same pass as q8_x16_matmul, so the winner and its value are that kernel's, the
// first index among equals as argmax_rows. A row with a NaN anywhere is computed in full.
// On the default model 4-10 groups of 3072 a row are computed in full. (A bound from the
// largest e_b times each row's whole sum left about 400: its hidden states have a few outlier
// features. Per-block sums, exact, left 4, but their extra 1.1 kB a group to read made the
// kernel slower than the logits' up to 8 rows.)

#ifdef Q4_VNNI
// One-part logits of a 16-row group for R activation rows, reduced to two bounds per row:
// lo[i] = max_j (hi_j - B_j) and up[i] = max_j (hi_j + B_j), B_j = w1[j] * ab[i] (NaN when a
// hi is NaN).
#define Q8X_HI_PASS(R)                                                                         \
    static void q8x_hi_pass_##R(const int8_t *codes, const float *scales, const float *w1,     \
                                int nb, const int8_t *q1, const float *e1,                    \
                                const int32_t *corr1, const float *ab, int K, float *lo,      \
                                float *up, int64_t ld) {                                      \
        __m512 sum[R];                                                                         \
        for (int i = 0; i < R; i++) sum[i] = _mm512_setzero_ps();                              \
        for (int b = 0; b < nb; b++) {                                                         \
            __m512i c[8];                                                                      \
            q8x_load_codes(codes + (int64_t)b * 512, c);                                       \
            const __m512 d = _mm512_loadu_ps(scales + b * Q8X_ROWS);                           \
            for (int i = 0; i < R; i++) {                                                      \
                const int32_t *qa = (const int32_t *)(q1 + (int64_t)i * K + b * Q8X_QK);       \
                __m512i a1 = _mm512_setzero_si512();                                           \
                for (int t = 0; t < 8; t++)                                                    \
                    a1 = _mm512_dpbusd_epi32(a1, c[t], _mm512_set1_epi32(qa[t]));              \
                const int nbk = i * nb + b;                                                    \
                const __m512i a = _mm512_sub_epi32(a1, _mm512_set1_epi32(corr1[nbk]));         \
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a),                                \
                                         _mm512_mul_ps(d, _mm512_set1_ps(e1[nbk])), sum[i]);   \
            }                                                                                  \
        }                                                                                      \
        const __m512 w = _mm512_loadu_ps(w1);                                                  \
        for (int i = 0; i < R; i++) {                                                          \
            const __m512 bnd_i = _mm512_mul_ps(w, _mm512_set1_ps(ab[i]));                      \
            if (_mm512_cmp_ps_mask(sum[i], sum[i], _CMP_UNORD_Q)) {                            \
                lo[i * ld] = up[i * ld] = NAN;                                                 \
                continue;                                                                      \
            }                                                                                  \
            lo[i * ld] = _mm512_reduce_max_ps(_mm512_sub_ps(sum[i], bnd_i));                   \
            up[i * ld] = _mm512_reduce_max_ps(_mm512_add_ps(sum[i], bnd_i));                   \
        }                                                                                      \
    }

Q8X_HI_PASS(1)
Q8X_HI_PASS(2)
Q8X_HI_PASS(3)
Q8X_HI_PASS(4)
Q8X_HI_PASS(5)
Q8X_HI_PASS(6)
Q8X_HI_PASS(7)
Q8X_HI_PASS(8)

typedef void (*q8x_hi_fn)(const int8_t *, const float *, const float *, int, const int8_t *,
                          const float *, const int32_t *, const float *, int, float *, float *,
                          int64_t);
static const q8x_hi_fn Q8X_HI_PASSES[Q8X_MAX_ACT + 1] = {
    0, q8x_hi_pass_1, q8x_hi_pass_2, q8x_hi_pass_3, q8x_hi_pass_4,
    q8x_hi_pass_5, q8x_hi_pass_6, q8x_hi_pass_7, q8x_hi_pass_8,
};

// row r's argmax over its full logits: every group computed, NaN counted as the maximum
static int64_t q8x_argmax_full(const int8_t *codes, const float *scales, int nb, int64_t groups,
                               const int8_t *q1, const int8_t *q2, const float *e,
                               const int32_t *corr, int K) {
    float y[Q8X_ROWS], best = -INFINITY;
    int64_t at = 0;
    for (int64_t g = 0; g < groups; g++) {
        q8x_pass_1(codes + g * nb * 512, scales + g * nb * Q8X_ROWS, nb, q1, q2, e, corr, K, y,
                   Q8X_ROWS);
        for (int j = 0; j < Q8X_ROWS; j++) {
            if (isnan(y[j])) return g * Q8X_ROWS + j;
            if (y[j] > best || (g == 0 && j == 0)) {
                best = y[j];
                at = g * Q8X_ROWS + j;
            }
        }
    }
    return at;
}
#endif

// amx_q8x16.c's q8_x16_amx_hi_pass, lent by the AMX library once it loads (built apart, with
// flags this build must not assume), and the row count from which it runs the first pass:
// the same bounds as the vector pass, so the same result.
typedef int (*q8x_hi_tiles_fn)(const int8_t *, const float *, const float *, int64_t, int64_t,
                               const int8_t *, const float *, const float *, int64_t, int64_t,
                               int64_t, float *, float *, int64_t);
static q8x_hi_tiles_fn q8x_hi_tiles;
static int64_t q8x_hi_tiles_min_rows;

void q8x_set_tiles(void *fn, int64_t min_rows) {
#ifdef Q4_VNNI
    q8x_hi_tiles = (q8x_hi_tiles_fn)fn;
    q8x_hi_tiles_min_rows = min_rows;
#else
    (void)fn;
    (void)min_rows;
#endif
}

// ids [M] = the argmax of each row of x [M, K] @ W.T as q8_x16_matmul computes it (the first
// index among equal maxima, a NaN counted as the maximum), w1 [N] as above; *exact_groups
// (if not NULL) gets how many 16-row groups were computed with both parts. Returns 0; -1 for
// a bad shape or failed scratch; -2 where the build has no such kernel (AVX2).
int q8_x16_argmax(const int8_t *codes, const float *scales, const float *w1, int64_t N,
                  int64_t K, const float *x, int64_t ldx, int64_t M, int64_t *ids,
                  int64_t *exact_groups) {
#ifndef Q4_VNNI
    (void)codes; (void)scales; (void)w1; (void)N; (void)K; (void)x; (void)ldx; (void)M;
    (void)ids; (void)exact_groups;
    return -2;
#else
    if (K % Q8X_QK != 0 || N % Q8X_ROWS != 0 || M <= 0 || N <= 0) return -1;
    const int nb = (int)(K / Q8X_QK);
    const int64_t groups = N / Q8X_ROWS;
    int8_t *q1 = (int8_t *)malloc((size_t)(M * K)), *q2 = (int8_t *)malloc((size_t)(M * K));
    float *e = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *e1 = (float *)malloc(sizeof(float) * (size_t)(M * nb));
    float *ab = (float *)malloc(sizeof(float) * (size_t)M);
    int32_t *corr = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * nb));
    int32_t *corr1 = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * nb));
    float *lo = (float *)malloc(sizeof(float) * (size_t)(2 * M * groups));
    if (!q1 || !q2 || !e || !e1 || !ab || !corr || !corr1 || !lo) {
        free(q1); free(q2); free(e); free(e1); free(ab); free(corr); free(corr1); free(lo);
        return -1;
    }
    float *up = lo + M * groups;  // lo, up [M, groups]
    for (int64_t r = 0; r < M; r++) {
        quantize_row_2x8(x + r * ldx, (int)K, q1 + r * K, q2 + r * K, e + r * nb, corr + r * nb);
        float esum = 0.0f;
        for (int b = 0; b < nb; b++) {
            int32_t s1 = 0;
            for (int j = 0; j < Q8X_QK; j++) s1 += q1[r * K + b * Q8X_QK + j];
            corr1[r * nb + b] = 128 * s1;
            e1[r * nb + b] = e[r * nb + b] * 254.0f;
            esum += e[r * nb + b];
        }
        ab[r] = 1.02f * 127.0f * esum;
    }
    int64_t exact = 0;
    const int tiles = q8x_hi_tiles && M >= q8x_hi_tiles_min_rows;
#pragma omp parallel
    {
        // the first pass: each thread a static share of the groups (tiles: one call for it)
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
        if (!tiles || q8x_hi_tiles(codes, scales, w1, nb, K, q1, e1, ab, M, g0, g1, lo, up,
                                   groups) != 0) {
            for (int64_t g = g0; g < g1; g++) {
                for (int64_t r = 0; r < M; r += Q8X_MAX_ACT) {
                    const int rows = (int)(M - r < Q8X_MAX_ACT ? M - r : Q8X_MAX_ACT);
                    Q8X_HI_PASSES[rows](codes + g * nb * 512, scales + g * nb * Q8X_ROWS,
                                        w1 + g * Q8X_ROWS, nb, q1 + r * K, e1 + r * nb,
                                        corr1 + r * nb, ab + r, (int)K, lo + r * groups + g,
                                        up + r * groups + g, groups);
                }
            }
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1) reduction(+ : exact)
        for (int64_t r = 0; r < M; r++) {
            const float *rlo = lo + r * groups, *rup = up + r * groups;
            const int8_t *rq1 = q1 + r * K, *rq2 = q2 + r * K;
            const float *re = e + r * nb;
            const int32_t *rc = corr + r * nb;
            float L = -INFINITY;
            int nan = 0;
            for (int64_t g = 0; g < groups; g++) {
                nan |= isnan(rlo[g]);
                L = fmaxf(L, rlo[g]);
            }
            if (nan || !isfinite(L)) {
                ids[r] = q8x_argmax_full(codes, scales, nb, groups, rq1, rq2, re, rc, (int)K);
                exact += groups;
                continue;
            }
            float best = -INFINITY, y[Q8X_ROWS];
            int64_t at = -1;
            for (int64_t g = 0; g < groups; g++) {
                if (!(rup[g] >= L)) continue;
                q8x_pass_1(codes + g * nb * 512, scales + g * nb * Q8X_ROWS, nb, rq1, rq2, re, rc,
                           (int)K, y, Q8X_ROWS);
                exact++;
                for (int j = 0; j < Q8X_ROWS; j++) {
                    if (isnan(y[j])) {  // cannot be after the checks above; kept exact anyway
                        best = NAN;
                        at = g * Q8X_ROWS + j;
                        break;
                    }
                    if (at < 0 || y[j] > best) {
                        best = y[j];
                        at = g * Q8X_ROWS + j;
                    }
                }
                if (isnan(best)) break;
            }
            ids[r] = at;
        }
    }
    if (exact_groups) *exact_groups = exact;
    free(q1); free(q2); free(e); free(e1); free(ab); free(corr); free(corr1); free(lo);
    return 0;
#endif
}
