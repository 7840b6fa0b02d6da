// GGUF's other block types (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0, IQ4_NL / IQ4_XS) kept in
// their own codes, repacked 16 output rows at a time like q4_rows.c's x16 layout, times
// int8 activations: the decode step's and the speculative verify's matmul for those types.
//
// Every type comes down to one of six "kinds": codes of 4, 5, 6 or 8 bits per weight and,
// per row and block of 32 columns, either a scale and a min (w = d * code + m) or a scale and
// a fixed offset (w = d * (code - off)), the offset kinds with a scale per 16 columns for
// Q6_K. The K types' super-block scales are folded into the sub-block's (d * sc, -dmin * m),
// rounded to fp16 (a relative 2^-11 on the block's scale, far inside the 4-6 bit code's
// step); every code is the file's. IQ4's codes index a table of 16 values, looked up with a
// byte shuffle.
//
// Layout, per group of 16 rows and block of 32 columns (one record, group-major):
//   bits 4/5/6: 4 x 64 bytes of nibbles as q4_rows.c (vector t, 4 bytes per row r: byte j
//               holds code[r][4t + j] & 15 low and code[r][4(t + 4) + j] & 15 high), then
//               for bit 4 (and bit 5) of the codes one 64-byte plane each: byte j of row r
//               holds in its bit t that bit of code[r][4t + j]
//   bits 8:     8 x 64 bytes: vector t, byte j of row r = code[r][4t + j]
//   then fp16 [16] d and fp16 [16] m (min kinds), fp16 [16] d (off32), or fp16 [16] d of
//   columns 0..15 and fp16 [16] d of columns 16..31 (off16)
// Activations: int8 per row and block of 32 (q4_1_quantize_row_q8: codes q, scale e,
// S = e * sum(q)), plus the integer sums of q per 16 columns for the offset kinds, so a block
// adds d * e * (dot(code, q) - off * sum(q)) (all integer until the scale), or
// d * e * dot(code, q) + m * S (min kinds, as q4_rows.c).
//
// A row's sums run in the same order whatever M is, so its result is the same bits alone,
// in a batch or as a node of a speculative verify.

#define _GNU_SOURCE  // sysconf(_SC_LEVEL2_CACHE_SIZE)

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kquants.h"
#include "ops.h"

#define KQ_PREFETCH_RECORDS 4

int kq_record_bytes(int kind) { return kq_record_size(kind); }

// activation rows: q4_1_quantize_row_q8's q, e, S plus qs [M, K/16] int32 (sums of q)
typedef struct {
    int8_t *q;
    float *e, *S;
    int32_t *qs;
} kq_act;

// q [K] int8 -> qs [K/16]: the sums the offset kinds take off
void kq_row_sums16(const int8_t *q, int64_t K, int32_t *qs) { kq_sums16(q, K, qs); }

static void *kq_quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, kq_act *a) {
    const int64_t nb = K / XQK;
    char *block = (char *)malloc(sizeof(float) * (size_t)(2 * M * nb) +
                                 sizeof(int32_t) * (size_t)(M * 2 * nb) + (size_t)(M * K));
    if (!block) return NULL;
    a->e = (float *)block;
    a->S = a->e + M * nb;
    a->qs = (int32_t *)(a->S + M * nb);
    a->q = (int8_t *)(a->qs + M * 2 * nb);
    for (int64_t r = 0; r < M; r++) {
        int8_t *q = a->q + r * K;
        q4_1_quantize_row_q8(x + r * ldx, (int)K, q, a->e + r * nb, a->S + r * nb);
        kq_row_sums16(q, K, a->qs + r * 2 * nb);
    }
    return block;
}

#ifdef Q4_VNNI
#define KQ_MAX_ACT 8

static inline __attribute__((always_inline)) void kq_pass(int kind, int R, const uint8_t *grp,
                                                          int nb, const kq_act *a, int64_t r0,
                                                          int K, float *y, int64_t ldy) {
    const int rs = kq_record_size(kind), mode = KQ_MODE[kind], off = KQ_OFF[kind];
    const int cb = code_bytes(KQ_BITS[kind]);
    __m512 sum[KQ_MAX_ACT];
    for (int i = 0; i < R; i++) sum[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = grp + (int64_t)b * rs;
        for (int l = 0; l < rs; l += 64)
            _mm_prefetch((const char *)rec + KQ_PREFETCH_RECORDS * rs + l, _MM_HINT_T0);
        __m512i c[8];
        kq_expand16(rec, kind, c);
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb)));
        const __m512 d1 = mode == MODE_OFF32
                              ? d0
                              : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + cb + 32)));
        for (int i = 0; i < R; i++) {
            const int64_t row = r0 + i, nbk = row * nb + b;
            const int32_t *qb = (const int32_t *)(a->q + row * K + b * XQK);
            const int32_t *qs = a->qs + 2 * nbk;
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++) {
                lo = _mm512_dpbusd_epi32(lo, c[t], _mm512_set1_epi32(qb[t]));
                hi = _mm512_dpbusd_epi32(hi, c[t + 4], _mm512_set1_epi32(qb[t + 4]));
            }
            const __m512 e = _mm512_set1_ps(a->e[nbk]);
            if (mode == MODE_OFF16) {
                lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(off * qs[0]));
                hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(off * qs[1]));
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(d0, e), sum[i]);
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(d1, e), sum[i]);
            } else if (mode == MODE_OFF32) {
                __m512i acc = _mm512_add_epi32(lo, hi);
                acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(off * (qs[0] + qs[1])));
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d0, e), sum[i]);
            } else {
                const __m512i acc = _mm512_add_epi32(lo, hi);
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d0, e), sum[i]);
                sum[i] = _mm512_fmadd_ps(d1, _mm512_set1_ps(a->S[nbk]), sum[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(y + i * ldy, sum[i]);
}
#else
// activation rows a pass over the weights serves: 8 measured 1.2-1.3x faster than 4 at 8 and 32
// rows on a Zen 3 (one code expansion a record for twice the rows; 6, 12 and 16 were slower)
#define KQ_MAX_ACT 8

// lo, hi = the int32 dots of codes c[0..3], c[4..7] (unsigned, `bits` wide) with the
// activations' 4-byte groups qb[0..3], qb[4..7], one lane a row. maddubs's int16 pair sums
// are added in int16 while they cannot overflow (|q| <= 127: a pair is at most
// 2 * 127 * (2^bits - 1); eight 4-bit, four 5-bit or two 6-bit ones fit) before one widening
// madd: the same integers as widening each, with fewer instructions.
static inline __attribute__((always_inline)) void kq_dot_unsigned(const __m256i c[8],
                                                                  const int32_t *qb, int bits,
                                                                  __m256i *lo, __m256i *hi) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[8];
    for (int t = 0; t < 8; t++) p[t] = _mm256_maddubs_epi16(c[t], _mm256_set1_epi32(qb[t]));
    if (bits == 4) {  // the caller adds lo and hi: one sum of eight
        const __m256i a = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
        const __m256i b = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
        *lo = _mm256_madd_epi16(_mm256_add_epi16(a, b), ones);
        *hi = _mm256_setzero_si256();
    } else if (bits == 5) {
        *lo = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones);
        *hi = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7])), ones);
    } else {
        *lo = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),
                               _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
        *hi = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[4], p[5]), ones),
                               _mm256_madd_epi16(_mm256_add_epi16(p[6], p[7]), ones));
    }
}
static inline __m256i kq_dot8_signed(__m256i w, __m256i qv) {  // |w| <= 128: no saturation
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(qv, w)),
                             _mm256_set1_epi16(1));
}

// v shifted left by n bits (right by -n) in 16-bit lanes; n a constant once unrolled
static inline __attribute__((always_inline)) __m256i kq_shift8(__m256i v, int n) {
    return n >= 0 ? _mm256_slli_epi16(v, n) : _mm256_srli_epi16(v, -n);
}

// rows 8h .. 8h + 7 of a record: unsigned codes, or (Q8, IQ4) the signed values, whose
// maddubs products would overflow int16 as unsigned; those kinds then take no offset
static inline __attribute__((always_inline)) void kq_expand(const uint8_t *rec, int kind,
                                                            int h, __m256i c[8]) {
    const int bits = KQ_BITS[kind];
    if (bits == 8) {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int t = 0; t < 8; t++)
            c[t] = _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(rec + 64 * t + 32 * h)), flip);
        return;
    }
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * t + 32 * h));
        c[t] = _mm256_and_si256(v, low);
        c[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    if (kind == KQ_IQ4) {
        const __m256i table =
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
        for (int t = 0; t < 8; t++) c[t] = _mm256_shuffle_epi8(table, c[t]);
    }
    // bit t of a plane's byte is bit 4 (+ p) of code t: moved there by a 16-bit shift and a
    // mask (3 instructions a vector; the compare-and-add it replaced took 4, per plane). A
    // shift by at most 4 reaches within the byte the mask keeps.
    if (bits == 5) {
        const __m256i plane = _mm256_loadu_si256((const __m256i *)(rec + 256 + 32 * h));
        const __m256i m = _mm256_set1_epi8(0x10);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++)
            c[t] = _mm256_or_si256(c[t], _mm256_and_si256(kq_shift8(plane, 4 - t), m));
    } else if (bits == 6) {
        // the two planes interleaved first: bits t, t + 1 of `pairs[t % 2]` hold bits 4, 5 of
        // code t (t even), bits t - 1, t (t odd); then one shift and mask a vector
        const __m256i p0 = _mm256_loadu_si256((const __m256i *)(rec + 256 + 32 * h));
        const __m256i p1 = _mm256_loadu_si256((const __m256i *)(rec + 320 + 32 * h));
        const __m256i even = _mm256_set1_epi8(0x55), odd = _mm256_set1_epi8((char)0xAA);
        const __m256i pairs[2] = {
            _mm256_or_si256(_mm256_and_si256(p0, even),
                            _mm256_slli_epi16(_mm256_and_si256(p1, even), 1)),
            _mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(p0, odd), 1),
                            _mm256_and_si256(p1, odd))};
        const __m256i m = _mm256_set1_epi8(0x30);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++)
            c[t] = _mm256_or_si256(c[t], _mm256_and_si256(kq_shift8(pairs[t % 2], 4 - (t & ~1)), m));
    }
}

static inline __attribute__((always_inline)) void kq_pass(int kind, int R, const uint8_t *grp,
                                                          int nb, const kq_act *a, int64_t r0,
                                                          int K, float *y, int64_t ldy) {
    const int rs = kq_record_size(kind), mode = KQ_MODE[kind], cb = code_bytes(KQ_BITS[kind]);
    const int is_signed = kind == KQ_Q8 || kind == KQ_IQ4;
    const int off = is_signed ? 0 : KQ_OFF[kind];
    __m256 sum[KQ_MAX_ACT][2];
    for (int i = 0; i < R; i++) sum[i][0] = sum[i][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = grp + (int64_t)b * rs;
        for (int l = 0; l < rs; l += 64)
            _mm_prefetch((const char *)rec + KQ_PREFETCH_RECORDS * rs + l, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i c[8];
            kq_expand(rec, kind, h, c);
            const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + cb + 16 * h)));
            const __m256 d1 = mode == MODE_OFF32
                                  ? d0
                                  : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + cb + 32 + 16 * h)));
            for (int i = 0; i < R; i++) {
                const int64_t row = r0 + i, nbk = row * nb + b;
                const int32_t *qb = (const int32_t *)(a->q + row * K + b * XQK);
                const int32_t *qs = a->qs + 2 * nbk;
                __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
                if (is_signed) {
                    for (int t = 0; t < 4; t++) {
                        lo = _mm256_add_epi32(lo, kq_dot8_signed(c[t], _mm256_set1_epi32(qb[t])));
                        hi = _mm256_add_epi32(hi, kq_dot8_signed(c[t + 4], _mm256_set1_epi32(qb[t + 4])));
                    }
                } else {
                    kq_dot_unsigned(c, qb, KQ_BITS[kind], &lo, &hi);
                }
                const __m256 e = _mm256_set1_ps(a->e[nbk]);
                if (mode == MODE_OFF16) {
                    lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(off * qs[0]));
                    hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(off * qs[1]));
                    sum[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(d0, e), sum[i][h]);
                    sum[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(d1, e), sum[i][h]);
                } else if (mode == MODE_OFF32) {
                    __m256i acc = _mm256_add_epi32(lo, hi);
                    acc = _mm256_sub_epi32(acc, _mm256_set1_epi32(off * (qs[0] + qs[1])));
                    sum[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(d0, e), sum[i][h]);
                } else {
                    const __m256i acc = _mm256_add_epi32(lo, hi);
                    sum[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(d0, e), sum[i][h]);
                    sum[i][h] = _mm256_fmadd_ps(d1, _mm256_set1_ps(a->S[nbk]), sum[i][h]);
                }
            }
        }
    }
    for (int i = 0; i < R; i++) {
        _mm256_storeu_ps(y + i * ldy, sum[i][0]);
        _mm256_storeu_ps(y + i * ldy + 8, sum[i][1]);
    }
}
#endif

// one function per kind, the row count a loop bound the compiler sees per call site
#define KQ_KIND_FN(KIND)                                                                     \
    static void kq_group_##KIND(const uint8_t *grp, int nb, const kq_act *a, int64_t M,     \
                                int K, float *y, int64_t ldy) {                               \
        for (int64_t r = 0; r < M; r += KQ_MAX_ACT) {                                         \
            const int rows = (int)(M - r < KQ_MAX_ACT ? M - r : KQ_MAX_ACT);                  \
            switch (rows) {                                                                   \
            case 1: kq_pass(KIND, 1, grp, nb, a, r, K, y + r * ldy, ldy); break;              \
            case 2: kq_pass(KIND, 2, grp, nb, a, r, K, y + r * ldy, ldy); break;              \
            case 3: kq_pass(KIND, 3, grp, nb, a, r, K, y + r * ldy, ldy); break;              \
            case KQ_MAX_ACT: kq_pass(KIND, KQ_MAX_ACT, grp, nb, a, r, K, y + r * ldy, ldy); break; \
            default: kq_pass(KIND, rows, grp, nb, a, r, K, y + r * ldy, ldy); break;          \
            }                                                                                 \
        }                                                                                     \
    }
KQ_KIND_FN(KQ_Q4M)
KQ_KIND_FN(KQ_IQ4)
KQ_KIND_FN(KQ_Q5O)
KQ_KIND_FN(KQ_Q5M)
KQ_KIND_FN(KQ_Q6)
KQ_KIND_FN(KQ_Q8)

typedef void (*kq_group_fn)(const uint8_t *, int, const kq_act *, int64_t, int, float *,
                            int64_t);
static const kq_group_fn KQ_GROUP[KQ_KINDS] = {kq_group_KQ_Q4M, kq_group_KQ_IQ4, kq_group_KQ_Q5O,
                                               kq_group_KQ_Q5M, kq_group_KQ_Q6, kq_group_KQ_Q8};

// y [M, N] (row stride ldy) = activation rows already quantized (q [M, K], e/S [M, K/32],
// qs [M, K/16]) @ W.T, W packed as `kind`: the groups of 16 output rows split over the team
// (ops.h)
void kq_matmul_team(int kind, const uint8_t *w, int64_t N, int64_t K, const int8_t *q,
                    const float *e, const float *S, const int32_t *qs, int64_t M, float *y,
                    int64_t ldy) {
    const kq_act a = {(int8_t *)q, (float *)e, (float *)S, (int32_t *)qs};
    const int nb = (int)(K / XQK);
    const int64_t group_bytes = (int64_t)nb * kq_record_bytes(kind);
    const kq_group_fn fn = KQ_GROUP[kind];
#pragma omp for schedule(static)
    for (int64_t g = 0; g < N / KQ_ROWS; g++)
        fn(w + g * group_bytes, nb, &a, M, (int)K, y + g * KQ_ROWS, ldy);
}

// kq_matmul_team's work for output group g (rows [16 g, 16 g + 16)) alone, on the calling
// thread: y points at the group's first column
void kq_matmul_group(int kind, const uint8_t *w, int64_t g, int64_t K, const int8_t *q,
                     const float *e, const float *S, const int32_t *qs, int64_t M, float *y,
                     int64_t ldy) {
    const kq_act a = {(int8_t *)q, (float *)e, (float *)S, (int32_t *)qs};
    const int nb = (int)(K / XQK);
    KQ_GROUP[kind](w + g * (int64_t)nb * kq_record_bytes(kind), nb, &a, M, (int)K, y, ldy);
}

// x's rows quantized, then one team runs kq_matmul_team, or (any) kq_any_team: kind -1 allowed
static int quantized_matmul(int any, int kind, const uint8_t *w, int64_t N, int64_t K,
                            const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy) {
    if (kind < -1 || kind >= KQ_KINDS || K % XQK || N % KQ_ROWS || M <= 0 || N <= 0) return -1;
    kq_act a;
    void *scratch = kq_quantize_rows(x, ldx, M, K, &a);
    if (!scratch) return -1;
#pragma omp parallel
    {
        if (any)
            kq_any_team(kind, w, N, K, a.q, a.e, a.S, a.qs, M, y, ldy);
        else
            kq_matmul_team(kind, w, N, K, a.q, a.e, a.S, a.qs, M, y, ldy);
    }
    free(scratch);
    return 0;
}

// y [M, N] (row stride ldy) = x [M, K] float32 (row stride ldx) @ W.T, W [N, K] packed as
// `kind`. Returns 0, or -1 for a bad kind or shape, or when scratch could not be allocated.
int kq_matmul(int kind, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t ldx,
              int64_t M, float *y, int64_t ldy) {
    if (kind < 0) return -1;
    return quantized_matmul(0, kind, w, N, K, x, ldx, M, y, ldy);
}

// row r (of the record's 16) of one record -> 32 floats
static void kq_record_row(int kind, const uint8_t *rec, int r, float *o) {
    const int bits = KQ_BITS[kind], mode = KQ_MODE[kind], off = KQ_OFF[kind];
    const int cb = code_bytes(bits);
    const float d0 = _cvtsh_ss(*(const uint16_t *)(rec + cb + 2 * r));
    const float d1 = mode == MODE_OFF32 ? d0 : _cvtsh_ss(*(const uint16_t *)(rec + cb + 32 + 2 * r));
    for (int i = 0; i < XQK; i++) {
        const int t = i / 4, j = i % 4;
        int code;
        if (bits == 8) {
            code = rec[64 * t + 4 * r + j];
        } else {
            const uint8_t byte = rec[64 * (t % 4) + 4 * r + j];
            code = t < 4 ? byte & 0x0F : byte >> 4;
            if (kind == KQ_IQ4) code = IQ4_VALUES[code] + 128;
            for (int p = 0; p < bits - 4; p++)
                code += ((rec[256 + 64 * p + 4 * r + j] >> t) & 1) << (4 + p);
        }
        if (mode == MODE_MIN32)
            o[i] = fmaf((float)code, d0, d1);
        else
            o[i] = (float)(code - off) * (mode == MODE_OFF16 && i >= 16 ? d1 : d0);
    }
}

// the packed matrix -> float32 [N, K] (the prefill path's dense weight; tests)
int kq_dequantize(int kind, const uint8_t *w, int64_t N, int64_t K, float *out) {
    if (kind < 0 || kind >= KQ_KINDS || K % XQK || N % KQ_ROWS) return -1;
    const int rs = kq_record_size(kind);
    const int64_t nb = K / XQK;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < N / KQ_ROWS; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < KQ_ROWS; r++)
                kq_record_row(kind, w + (g * nb + b) * rs, r, out + (g * KQ_ROWS + r) * K + b * XQK);
    return 0;
}

// rows ids[0..T) of the packed matrix -> float32 [T, K] (an embedding kept in the file's
// codes gathers its tokens' rows); -2 for an id outside [0, N)
int kq_rows(int kind, const uint8_t *w, int64_t N, int64_t K, const int64_t *ids, int64_t T,
            float *out) {
    if (kind < 0 || kind >= KQ_KINDS || K % XQK || N % KQ_ROWS) return -1;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -2;
    const int rs = kq_record_size(kind);
    const int64_t nb = K / XQK;
#pragma omp parallel for schedule(static) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        const int64_t g = ids[t] / KQ_ROWS;
        for (int64_t b = 0; b < nb; b++)
            kq_record_row(kind, w + (g * nb + b) * rs, (int)(ids[t] % KQ_ROWS), out + t * K + b * XQK);
    }
    return 0;
}

// amx_kq.c's kq_amx_group, lent by the AMX library once it is loaded (it is built apart, with
// flags this build must not assume), and the row count from which its tiles beat the vector
// kernel here. Only the VNNI build takes it: its bits are the VNNI kernel's, not AVX2's.
typedef int (*kq_tile_group_fn)(int, const uint8_t *, int64_t, int64_t, const int8_t *,
                                const float *, const float *, const int32_t *, int64_t, float *,
                                int64_t);
static kq_tile_group_fn kq_tiles;
static int64_t kq_tiles_min_rows;

void kq_set_tiles(void *fn, int64_t min_rows) {
#ifdef Q4_VNNI
    kq_tiles = (kq_tile_group_fn)fn;
    kq_tiles_min_rows = min_rows;
#else
    (void)fn;
    (void)min_rows;
#endif
}

static void vector_group(int kind, const uint8_t *w, int64_t g, int64_t K, const int8_t *q,
                         const float *e, const float *S, const int32_t *qs, int64_t M, float *y,
                         int64_t ldy) {
    if (kind < 0)
        q4_x16_matmul_group(w, g, K, q, e, S, M, y, ldy);
    else
        kq_matmul_group(kind, w, g, K, q, e, S, qs, M, y, ldy);
}

// Q6_K's halves of 16 columns take two tile products a block: the tiles pay from twice the rows
static inline int tiles_take(int kind, int64_t M) {
    return kq_tiles && M >= (kind == KQ_Q6 ? 2 : 1) * kq_tiles_min_rows;
}

void kq_any_group(int kind, const uint8_t *w, int64_t g, int64_t K, const int8_t *q,
                  const float *e, const float *S, const int32_t *qs, int64_t M, float *y,
                  int64_t ldy) {
    if (tiles_take(kind, M) && kq_tiles(kind, w, g, K, q, e, S, qs, M, y, ldy) == 0) return;
    vector_group(kind, w, g, K, q, e, S, qs, M, y, ldy);
}

// Rows per pass of a team's matmul over many rows (kq_any_team, the decode step's linears):
// a pass's activation rows (rows x K bytes, a quarter of L2) stay in L2 while a thread walks
// its groups of 16 outputs. One pass over all M rows would stream a long prompt's rows from
// memory once per group (a 1,024-row chunk of a 5,632-wide down projection: 5.8 MB, 128
// times a layer); the price is reading the weights once per pass, and on tiles expanding
// their codes once per pass. At 1,024 rows on the AMX Xeon: 1.10-1.15x for Q4_K and Q6_K
// matrices of a 1B model (a quarter of its 2 MB L2; half of it read the same).
static int64_t pass_budget = 512 << 10;

// set once as the library loads, before any team reads it
__attribute__((constructor)) static void set_pass_budget(void) {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    const int64_t b = l2 > 0 ? l2 / 4 : 512 << 10;
    pass_budget = b < (256 << 10) ? 256 << 10 : b > (1 << 20) ? 1 << 20 : b;
}

int64_t kq_pass_rows(int64_t K) {
    const int64_t rows = pass_budget / K / 16 * 16;
    return rows < 32 ? 32 : rows;
}

// the groups of 16 output rows split over the team, pass by pass (kq_pass_rows); a row's
// sums are the same whatever pass or kernel holds it
void kq_any_team(int kind, const uint8_t *w, int64_t N, int64_t K, const int8_t *q,
                 const float *e, const float *S, const int32_t *qs, int64_t M, float *y,
                 int64_t ldy) {
    const int64_t pass = kq_pass_rows(K), nb = K / XQK;
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
        const int64_t n = M - m0 < pass ? M - m0 : pass;
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < N / KQ_ROWS; g++)
            kq_any_group(kind, w, g, K, q + m0 * K, e + m0 * nb, S + m0 * nb,
                         qs ? qs + m0 * (K / 16) : NULL, n, y + m0 * ldy + g * KQ_ROWS, ldy);
    }
#pragma omp barrier
}

// y [M, N] = x [M, K] @ W.T through kq_any_team (kind -1: x16 Q4_1): what the decode step and
// the MoE layers run, tiles included where lent (tests/kernels/test_gguf_kernels.py)
int kq_any_matmul(int kind, const uint8_t *w, int64_t N, int64_t K, const float *x,
                  int64_t ldx, int64_t M, float *y, int64_t ldy) {
    return quantized_matmul(1, kind, w, N, K, x, ldx, M, y, ldy);
}
