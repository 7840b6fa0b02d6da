// Q4_1 weights x Q8 activations on x86 (AVX2, or AVX-512 VNNI): the decode-step matmul.
//
// A weight row is K/32 blocks of 20 bytes, GGUF's Q4_1 layout verbatim:
//   fp16 d | fp16 m | 16 bytes: byte j holds code j (low nibble) and code j + 16 (high)
//   w[i] = d * code[i] + m
// An activation row is quantized here, per block of 32, to int8 codes q with one float scale
// e (q = round(x / e), |q| <= 127), and its sum S = e * sum(q). Then one block contributes
//   sum_i w[i] * x[i] ~= d * e * sum_i code[i] * q[i]  +  m * S
// where the integer dot is u8 x s8: AVX2 `vpmaddubsw` + `vpmaddwd`, or one `vpdpbusd` with
// VNNI (15 * 127 * 2 fits int16, so maddubs never saturates).
//
// Threads: OpenMP over output rows, in the caller's team (torch's libgomp is already loaded
// under the same soname, so this library joins its thread pool rather than making one).
// Built twice, -mavx2 -mfma -mf16c and with -mavx512{f,bw,vl,vnni} -DQ4_VNNI; the loader
// picks by the CPU it runs on.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
#define BLOCK_BYTES 20
#define ROW_TILE 4  // activation rows dotted against one weight block while it is in registers

static inline float fp16_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 16 nibble bytes -> 32 unsigned codes in element order (low halves, then high halves)
static inline __m256i expand_codes(const uint8_t *p) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(b, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return _mm256_set_m128i(hi, lo);
}

// 8 int32 partial sums of code[i] * q[i] over one block
static inline __m256i dot_u8s8(__m256i codes, __m256i q) {
#ifdef Q4_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, q);
#else
    __m256i p16 = _mm256_maddubs_epi16(codes, q);
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
#endif
}

// One activation row [K] -> q int8 [K], e, S float [K/32] (q4_rows.c's kernel too).
void q4_1_quantize_row_q8(const float *x, int K, int8_t *q, float *e, float *S) {
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float max_abs = _mm_cvtss_f32(m4);
        const float scale = max_abs / 127.0f;
        const __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
        __m256i i32[4];
        for (int j = 0; j < 4; j++) {
            i32[j] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT |
                                                          _MM_FROUND_NO_EXC));
        }
        // int32 x 32 -> int8 x 32; packs work per 128-bit lane, the permute restores order
        __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]);
        __m256i i16b = _mm256_packs_epi32(i32[2], i32[3]);
        __m256i i8 = _mm256_packs_epi16(i16a, i16b);
        i8 = _mm256_permutevar8x32_epi32(i8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QK), i8);
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]),
                                     _mm256_add_epi32(i32[2], i32[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        e[b] = scale;
        S[b] = scale * (float)_mm_cvtsi128_si32(s4);
    }
}

// M activation rows (row stride ldx) quantized as above into one allocation: q [M, K], e and
// S [M, K/32]. Returns the block to free, NULL when it could not be allocated.
void *q4_1_quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t **q,
                         float **e, float **S) {
    const int64_t nb = K / QK;
    float *block = (float *)malloc(sizeof(float) * (size_t)(2 * M * nb) + (size_t)(M * K));
    if (!block) return NULL;
    *e = block;
    *S = block + M * nb;
    *q = (int8_t *)(block + 2 * M * nb);
    for (int64_t r = 0; r < M; r++)
        q4_1_quantize_row_q8(x + r * ldx, (int)K, *q + r * K, *e + r * nb, *S + r * nb);
    return block;
}

// y[r, n] for rows r in [0, mt) of the tile and one weight row n.
static inline void row_tile(const uint8_t *w, int nb, const int8_t *q, const float *e,
                            const float *S, int K, int mt, float *y, int64_t ldy) {
    __m256 acc[ROW_TILE];
    float mins[ROW_TILE];
    for (int r = 0; r < mt; r++) {
        acc[r] = _mm256_setzero_ps();
        mins[r] = 0.0f;
    }
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (int64_t)b * BLOCK_BYTES;
        const float d = fp16_to_float(*(const uint16_t *)blk);
        const float m = fp16_to_float(*(const uint16_t *)(blk + 2));
        const __m256i codes = expand_codes(blk + 4);
        for (int r = 0; r < mt; r++) {
            const int8_t *qb = q + (int64_t)r * K + b * QK;
            const __m256i qv = _mm256_loadu_si256((const __m256i *)qb);
            const __m256 dots = _mm256_cvtepi32_ps(dot_u8s8(codes, qv));
            const int nbk = r * (K / QK) + b;
            acc[r] = _mm256_fmadd_ps(dots, _mm256_set1_ps(d * e[nbk]), acc[r]);
            mins[r] += m * S[nbk];
        }
    }
    for (int r = 0; r < mt; r++) y[r * ldy] = hsum256(acc[r]) + mins[r];
}

// One activation row and one weight row, two accumulators (breaks the FMA chain)
static inline float row_dot1(const uint8_t *w, int nb, const int8_t *q, const float *e,
                             const float *S) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float mins = 0.0f;
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *b0 = w + (int64_t)b * BLOCK_BYTES, *b1 = b0 + BLOCK_BYTES;
        const __m256 t0 = _mm256_cvtepi32_ps(
            dot_u8s8(expand_codes(b0 + 4), _mm256_loadu_si256((const __m256i *)(q + b * QK))));
        const __m256 t1 = _mm256_cvtepi32_ps(dot_u8s8(
            expand_codes(b1 + 4), _mm256_loadu_si256((const __m256i *)(q + (b + 1) * QK))));
        acc0 = _mm256_fmadd_ps(t0, _mm256_set1_ps(fp16_to_float(*(const uint16_t *)b0) * e[b]),
                               acc0);
        acc1 = _mm256_fmadd_ps(
            t1, _mm256_set1_ps(fp16_to_float(*(const uint16_t *)b1) * e[b + 1]), acc1);
        mins += fp16_to_float(*(const uint16_t *)(b0 + 2)) * S[b] +
                fp16_to_float(*(const uint16_t *)(b1 + 2)) * S[b + 1];
    }
    for (; b < nb; b++) {
        const uint8_t *b0 = w + (int64_t)b * BLOCK_BYTES;
        const __m256 t0 = _mm256_cvtepi32_ps(
            dot_u8s8(expand_codes(b0 + 4), _mm256_loadu_si256((const __m256i *)(q + b * QK))));
        acc0 = _mm256_fmadd_ps(t0, _mm256_set1_ps(fp16_to_float(*(const uint16_t *)b0) * e[b]),
                               acc0);
        mins += fp16_to_float(*(const uint16_t *)(b0 + 2)) * S[b];
    }
    return hsum256(_mm256_add_ps(acc0, acc1)) + mins;
}

// y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W.T, W [N, K] in Q4_1 blocks.
// `invariant`: one row too goes through row_tile (its sums, one accumulator: about 20% slower
// than row_dot1's two here), so a row's result is the same bits alone as in any batch.
// Returns 0, or -1 when K is not a multiple of 32 or scratch could not be allocated.
int q4_1_matmul(const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t ldx,
                int64_t M, float *y, int64_t ldy, int invariant) {
    if (K % QK != 0 || M <= 0 || N <= 0) return -1;
    const int nb = (int)(K / QK);
    int8_t *q;
    float *e, *S;
    void *scratch = q4_1_quantize_rows(x, ldx, M, K, &q, &e, &S);
    if (!scratch) return -1;
    const int64_t row_bytes = (int64_t)nb * BLOCK_BYTES;
    if (M == 1 && !invariant) {
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            y[n] = row_dot1(w + n * row_bytes, nb, q, e, S);
        }
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *wr = w + n * row_bytes;
            for (int64_t r0 = 0; r0 < M; r0 += ROW_TILE) {
                const int mt = (int)(M - r0 < ROW_TILE ? M - r0 : ROW_TILE);
                row_tile(wr, nb, q + r0 * K, e + r0 * nb, S + r0 * nb, (int)K, mt,
                         y + r0 * ldy + n, ldy);
            }
        }
    }
    free(scratch);
    return 0;
}

// out [N, K] float32 = the Q4_1 matrix (the prefill path's GEMM weight)
void q4_1_dequantize(const uint8_t *w, int64_t N, int64_t K, float *out) {
    const int nb = (int)(K / QK);
    const int64_t row_bytes = (int64_t)nb * BLOCK_BYTES;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = w + n * row_bytes;
        float *o = out + n * K;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = wr + (int64_t)b * BLOCK_BYTES;
            const __m256 d = _mm256_set1_ps(fp16_to_float(*(const uint16_t *)blk));
            const __m256 m = _mm256_set1_ps(fp16_to_float(*(const uint16_t *)(blk + 2)));
            const __m256i codes = expand_codes(blk + 4);
            const __m128i c_lo = _mm256_castsi256_si128(codes);
            const __m128i c_hi = _mm256_extracti128_si256(codes, 1);
            const __m128i parts[4] = {c_lo, _mm_srli_si128(c_lo, 8), c_hi,
                                      _mm_srli_si128(c_hi, 8)};
            for (int j = 0; j < 4; j++) {
                const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
                _mm256_storeu_ps(o + b * QK + 8 * j, _mm256_fmadd_ps(c, d, m));
            }
        }
    }
}

// Which instruction set this build uses (the loader checks it matches what it asked for).
const char *q4_1_isa(void) {
#ifdef Q4_VNNI
    return "avx512_vnni";
#else
    return "avx2";
#endif
}

// A weight row (nb blocks of 32 int8 codes, a float scale each) against R activation rows:
// each block is widened to float and scaled once for all R rows, then FMAs into per-row
// accumulators (AVX-512: two weight rows per call, one accumulator per pair of rows; AVX2:
// one weight row, two accumulators per activation row). Every row's sums run in the same
// order whatever R is, so a row's result does not depend on the rows beside it.
#ifdef Q4_VNNI
#define Q8_MAX_ROWS 8
#define Q8_WEIGHT_ROWS 2
// two weight rows at a time (their blocks widened once, each activation load feeding both):
// 2 * R accumulators, one per (weight row, activation row)
#define Q8_DOT_ROWS(R)                                                                         \
    static inline void q8_dot_##R(const int8_t *wr, const float *sr, int nb, const float *x,   \
                                  int64_t ldx, float *y, int64_t ldy, int two) {              \
        __m512 acc0[R], acc1[R];                                                               \
        for (int i = 0; i < R; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();                   \
        const int8_t *wr1 = wr + (two ? nb * QK : 0);                                          \
        const float *sr1 = sr + (two ? nb : 0);                                                \
        for (int b = 0; b < nb; b++) {                                                         \
            const int8_t *wb = wr + b * QK, *wb1 = wr1 + b * QK;                               \
            const __m512 s = _mm512_set1_ps(sr[b]), s1 = _mm512_set1_ps(sr1[b]);               \
            const __m512 w0 = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(        \
                _mm_loadu_si128((const __m128i *)wb))));                                       \
            const __m512 w1 = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(        \
                _mm_loadu_si128((const __m128i *)(wb + 16)))));                                \
            const __m512 v0 = _mm512_mul_ps(s1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(       \
                _mm_loadu_si128((const __m128i *)wb1))));                                      \
            const __m512 v1 = _mm512_mul_ps(s1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(       \
                _mm_loadu_si128((const __m128i *)(wb1 + 16)))));                               \
            for (int i = 0; i < R; i++) {                                                      \
                const float *xb = x + i * ldx + b * QK;                                        \
                const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);          \
                acc0[i] = _mm512_fmadd_ps(w1, x1, _mm512_fmadd_ps(w0, x0, acc0[i]));           \
                acc1[i] = _mm512_fmadd_ps(v1, x1, _mm512_fmadd_ps(v0, x0, acc1[i]));           \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < R; i++) {                                                          \
            y[i * ldy] = _mm512_reduce_add_ps(acc0[i]);                                        \
            if (two) y[i * ldy + 1] = _mm512_reduce_add_ps(acc1[i]);                           \
        }                                                                                      \
    }
#else
#define Q8_MAX_ROWS 4
#define Q8_WEIGHT_ROWS 1
#define Q8_DOT_ROWS(R)                                                                         \
    static inline void q8_dot_##R(const int8_t *wr, const float *sr, int nb, const float *x,   \
                                  int64_t ldx, float *y, int64_t ldy, int two) {              \
        (void)two;                                                                             \
        __m256 acc0[R], acc1[R];                                                               \
        for (int i = 0; i < R; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();                   \
        for (int b = 0; b < nb; b++) {                                                         \
            const int8_t *wb = wr + b * QK;                                                    \
            const __m256 s = _mm256_set1_ps(sr[b]);                                            \
            __m256 w[4];                                                                       \
            for (int j = 0; j < 4; j++)                                                        \
                w[j] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(               \
                    _mm_loadl_epi64((const __m128i *)(wb + 8 * j)))));                         \
            for (int i = 0; i < R; i++) {                                                      \
                const float *xb = x + i * ldx + b * QK;                                        \
                acc0[i] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc0[i]);                 \
                acc1[i] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc1[i]);             \
                acc0[i] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc0[i]);            \
                acc1[i] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc1[i]);            \
            }                                                                                  \
        }                                                                                      \
        for (int i = 0; i < R; i++) y[i * ldy] = hsum256(_mm256_add_ps(acc0[i], acc1[i]));     \
    }
#endif
Q8_DOT_ROWS(1)
Q8_DOT_ROWS(2)
Q8_DOT_ROWS(3)
Q8_DOT_ROWS(4)
#if Q8_MAX_ROWS == 8
Q8_DOT_ROWS(5)
Q8_DOT_ROWS(6)
Q8_DOT_ROWS(7)
Q8_DOT_ROWS(8)
#endif

#define Q8_TILE_N 64  // weight rows (36 KB at K = 576) that meet each chunk of activation rows

static inline void q8_dot_rows(int rows, const int8_t *wr, const float *sr, int nb,
                               const float *x, int64_t ldx, float *y, int64_t ldy, int two) {
    switch (rows) {
        case 1: q8_dot_1(wr, sr, nb, x, ldx, y, ldy, two); break;
        case 2: q8_dot_2(wr, sr, nb, x, ldx, y, ldy, two); break;
        case 3: q8_dot_3(wr, sr, nb, x, ldx, y, ldy, two); break;
#if Q8_MAX_ROWS == 8
        case 4: q8_dot_4(wr, sr, nb, x, ldx, y, ldy, two); break;
        case 5: q8_dot_5(wr, sr, nb, x, ldx, y, ldy, two); break;
        case 6: q8_dot_6(wr, sr, nb, x, ldx, y, ldy, two); break;
        case 7: q8_dot_7(wr, sr, nb, x, ldx, y, ldy, two); break;
        default: q8_dot_8(wr, sr, nb, x, ldx, y, ldy, two); break;
#else
        default: q8_dot_4(wr, sr, nb, x, ldx, y, ldy, two); break;
#endif
    }
}

// y [M, N] = x [M, K] float32 @ W.T, W [N, K] as int8 codes with one float scale per 32
// columns (GGUF Q8_0's values, exactly): the LM head of a quantized model, whose logits stay
// float32 from float32 activations (no activation quantization here). Up to Q8_MAX_ROWS
// activation rows go through each weight row while it is in registers; with more rows, a
// tile of Q8_TILE_N weight rows stays in cache while every chunk of rows passes over it, so
// the matrix is read from memory once whatever M is.
int q8_0_matmul_f32(const int8_t *codes, const float *scales, int64_t N, int64_t K,
                    const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy) {
    if (K % QK != 0 || M <= 0 || N <= 0) return -1;
    const int nb = (int)(K / QK);
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += Q8_TILE_N) {
        const int64_t n1 = n0 + Q8_TILE_N < N ? n0 + Q8_TILE_N : N;
        for (int64_t r = 0; r < M; r += Q8_MAX_ROWS) {
            const int rows = (int)(M - r < Q8_MAX_ROWS ? M - r : Q8_MAX_ROWS);
            for (int64_t n = n0; n < n1; n += Q8_WEIGHT_ROWS)
                q8_dot_rows(rows, codes + n * K, scales + n * nb, nb, x + r * ldx, ldx,
                            y + r * ldy + n, ldy, Q8_WEIGHT_ROWS == 2 && n + 1 < n1);
        }
    }
    return 0;
}
