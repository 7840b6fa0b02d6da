// Decode attention over the slot-addressed KV pool (fp32, bf16, or 8-bit codes with a float32
// scale per slot and kv head: int8, fp8 e4m3, fp8 e5m2; ops.h's KV_*): RoPE on q/k of a fused
// qkv row, k/v stored into the pool, then each query row attends to the first seq_len slots of
// its row of a key table (a request's own row for a decode; one row per query for a
// speculative verify, see native_decode.masked_rows). What the model families add: q/k norms
// before RoPE, no RoPE, a sliding window (a row reads only the last `window` of its seq_len
// slots: its key index is its position, or its rank among the query's visible keys for a
// verify row, the same rule), scores soft-capped before the softmax.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "simd.h"

static inline int64_t kv_elem_bytes(int kind) {
    return kind == KV_F32 ? 4 : (kind == KV_BF16 ? 2 : 1);
}

// 8 lanes of a pool row at element offset `off`: fp32, bf16 widened, or 8-bit codes as floats
// (not yet times their row's scale). fp8 codes are widened by moving their exponent and
// mantissa bits into a float's place and multiplying by 2^(127 - bias): exact for every code,
// subnormals included (no flush-to-zero here), in 4 integer ops and a multiply; kind is a
// constant at every call, so each kernel below is compiled for one kind.
static inline __m256 load8(const void *base, int kind, int64_t off) {
    if (kind == KV_F32) return _mm256_loadu_ps((const float *)base + off);
    if (kind == KV_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + off));
    if (kind == KV_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256i u = _mm256_cvtepu8_epi32(b);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
    const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7F));
    if (kind == KV_E4M3)
        return _mm256_mul_ps(
            _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(mag, 20), sign)),
            _mm256_set1_ps(0x1p120f));
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(mag, 21), sign)),
                         _mm256_set1_ps(0x1p112f));
}

// float -> fp8, rounded to nearest even as torch's casts are: e4m3fn saturates at 448 (no
// infinities; NaN 0x7F), e5m2 overflows to infinity. The stored values are within the range
// (scaled by the row's maximum), so the edges never meet a real row.
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return 0x7F;
    if (u > 0x43E00000u) return sign | 0x7E;  // above 448: torch saturates
    if (u < 0x3C800000u) {                     // below 2^-6: a multiple of 2^-9
        float a;
        memcpy(&a, &u, 4);
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    }
    u += 0x7FFFFu + ((u >> 20) & 1u);  // keep 3 mantissa bits, ties to even
    return sign | (uint8_t)((u >> 20) - (120u << 3));
}

static inline uint8_t f32_to_e5m2(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return 0x7F;
    if (u >= 0x47800000u) return sign | 0x7C;  // 2^16 and up: infinity
    if (u < 0x38800000u) {                     // below 2^-14: a multiple of 2^-16
        float a;
        memcpy(&a, &u, 4);
        return sign | (uint8_t)nearbyintf(a * 65536.0f);
    }
    u += 0xFFFFFu + ((u >> 21) & 1u);  // keep 2 mantissa bits, ties to even
    return sign | (uint8_t)((u >> 21) - (112u << 2));
}

// Whether channel j's sign is flipped before the rotation: kv_quant._sign_flipped's hash.
static inline int kv_sign_flipped(int64_t j) {
    uint32_t h = (uint32_t)j * 0x9E3779B1u + 0x7F4A7C15u;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    return (int)(h >> 31);
}

// Runs per stored row, per query head and per output head of every token: the hash of 8
// channels at a time, its top bit xored into their sign bits (no branch on a random bit).
static void kv_flip_signs(float *x, int64_t D) {
    int64_t j = 0;
    const __m256i top = _mm256_set1_epi32((int)0x80000000u);
    for (__m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); j + 8 <= D;
         j += 8, idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8))) {
        __m256i h = _mm256_add_epi32(_mm256_mullo_epi32(idx, _mm256_set1_epi32((int)0x9E3779B1u)),
                                     _mm256_set1_epi32(0x7F4A7C15));
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
        h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x2C1B3C6D));
        const __m256 flip = _mm256_castsi256_ps(_mm256_and_si256(h, top));
        _mm256_storeu_ps(x + j, _mm256_xor_ps(_mm256_loadu_ps(x + j), flip));
    }
    for (; j < D; j++)
        if (kv_sign_flipped(j)) x[j] = -x[j];
}

// The unnormalized Walsh-Hadamard transform W of each block of D & -D values, in place, by
// butterflies of span 1, 2, 4, ... in kv_quant's order (each value's sums and differences the
// same float ops, so both give the same bits). W W is B times the identity.
static void kv_hadamard(float *x, int64_t D) {
    const int64_t b = D & -D;
    if (D % 8 == 0) {  // spans 1, 2, 4 inside each 8 lanes, then whole vectors: the same ops
        for (int64_t i = 0; i < D; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i), w = _mm256_permute_ps(v, 0xB1);
            v = _mm256_blend_ps(_mm256_add_ps(v, w), _mm256_sub_ps(w, v), 0xAA);
            w = _mm256_permute_ps(v, 0x4E);
            v = _mm256_blend_ps(_mm256_add_ps(v, w), _mm256_sub_ps(w, v), 0xCC);
            w = _mm256_permute2f128_ps(v, v, 1);
            v = _mm256_blend_ps(_mm256_add_ps(v, w), _mm256_sub_ps(w, v), 0xF0);
            _mm256_storeu_ps(x + i, v);
        }
        for (int64_t h = 8; h < b; h *= 2)
            for (int64_t i = 0; i < D; i += 2 * h)
                for (int64_t j = i; j < i + h; j += 8) {
                    const __m256 a = _mm256_loadu_ps(x + j), c = _mm256_loadu_ps(x + j + h);
                    _mm256_storeu_ps(x + j, _mm256_add_ps(a, c));
                    _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, c));
                }
        return;
    }
    for (int64_t h = 1; h < b; h *= 2)
        for (int64_t i = 0; i < D; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], c = x[j + h];
                x[j] = a + c;
                x[j + h] = a - c;
            }
}

// A quantized pool holds rotated rows W S x (kv_quant.rotate, which says why): the signs of
// a fixed half of the channels flipped, then W. Queries take the same (W S q, then / B).
static void kv_rotate(float *x, int64_t D) {
    kv_flip_signs(x, D);
    kv_hadamard(x, D);
}

// Codes and scale of one rotated row r [D], as kv_quant.quantize_rotated makes them (scale =
// max|r| / QMAX, codes = r / scale rounded to nearest even), the same bits: float32 division
// in both.
static void quantize_kv_row(uint8_t *dst, float *scale_out, int kind, int64_t D, const float *r) {
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) amax = fabsf(r[d]) > amax ? fabsf(r[d]) : amax;
    const float scale = amax / (kind == KV_I8 ? 127.0f : (kind == KV_E4M3 ? 448.0f : 57344.0f));
    *scale_out = scale;
    const float div = scale > 0.0f ? scale : 1.0f;
    int64_t d0 = 0;
    if (kind == KV_I8) {  // 8 at a time: the same division and rounding (to nearest even)
        const __m256 dv = _mm256_set1_ps(div), hi = _mm256_set1_ps(127.0f);
        for (; d0 + 8 <= D; d0 += 8) {
            __m256 y = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(r + d0), dv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            y = _mm256_max_ps(_mm256_min_ps(y, hi), _mm256_sub_ps(_mm256_setzero_ps(), hi));
            const __m256i i = _mm256_cvtps_epi32(y);
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i),
                                              _mm256_extracti128_si256(i, 1));
            _mm_storel_epi64((__m128i *)(dst + d0), _mm_packs_epi16(w, w));
        }
    }
    for (int64_t d = d0; d < D; d++) {
        const float y = r[d] / div;
        if (kind == KV_I8) {
            float q = nearbyintf(y);
            q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
            dst[d] = (uint8_t)(int8_t)q;
        } else {
            dst[d] = kind == KV_E4M3 ? f32_to_e4m3(y) : f32_to_e5m2(y);
        }
    }
}

// One kv head's row x [D] into the pool at row `row` (slot * Hkv + head): fp32 / bf16 as it
// is, or rotated, then codes and scale (kv_quant.quantize's bits). rot: D floats of scratch.
static inline void store_kv_row(void *pool, float *scales, int kind, int64_t row, int64_t D,
                                const float *x, float *rot) {
    if (kind == KV_F32 || kind == KV_BF16) {
        store_row(pool, kind, row * D, (int)D, x);
        return;
    }
    memcpy(rot, x, sizeof(float) * (size_t)D);
    kv_rotate(rot, D);
    quantize_kv_row((uint8_t *)pool + row * D, scales + row, kind, D, rot);
}

// n rows x [n, D] -> codes [n, D] and scales [n] of a pool of `kind` (KV_I8 and up), rotated
// first unless `rotated` says they are (kv_quant.quantize / quantize_rotated): the native
// quantizer alone, which the tests hold to torch's on the formats' rounding edges.
int kv_quantize_rows(const float *x, int64_t n, int64_t D, int kind, int rotated, void *codes,
                     float *scales) {
    if (kind < KV_I8 || kind >= KV_KINDS || D <= 0) return -2;
    float *rot = (float *)malloc(sizeof(float) * (size_t)D);
    if (!rot) return -1;
    for (int64_t i = 0; i < n; i++) {
        memcpy(rot, x + i * D, sizeof(float) * (size_t)D);
        if (!rotated) kv_rotate(rot, D);
        quantize_kv_row((uint8_t *)codes + i * D, scales + i, kind, D, rot);
    }
    free(rot);
    return 0;
}

// Keys are gathered by slot: a request's slots are scattered over the pool once requests come
// and go, so the hardware prefetchers do not see them coming. Each key's K and V rows (one kv
// head's D values) are prefetched this many keys ahead of its dot product (docs/cpu-kernels.md
// has what it saved).
#define KV_PREFETCH 8

static inline void prefetch_row(const void *base, int kind, int64_t off, int64_t D) {
    const int64_t eb = kv_elem_bytes(kind);
    const char *p = (const char *)base + off * eb;
    for (int64_t b = 0; b < D * eb; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

static inline void prefetch_row_l2(const void *base, int kind, int64_t off, int64_t n) {
    const int64_t eb = kv_elem_bytes(kind);
    const char *p = (const char *)base + off * eb;
    for (int64_t b = 0; b < n * eb; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// the four lane sums of a, b, c, d
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

#define KV_CHUNK 256  // keys per work item: a long context is split across the threads

// the largest of v[0, n) (-inf for none), 8 lanes at a time
static inline float max_row(const float *v, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(v + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    for (; i < n; i++) mx = v[i] > mx ? v[i] : mx;
    return mx;
}

// Attention of the G query heads that read kv head g (GQA) over keys [t0, t1): for each head,
// its chunk's max score, sum of exp(score - max) and acc [D] = sum exp(score - max) * v, with
// each key and value row loaded (and widened to float) once for the G heads. Every head's
// sums run in the same order whatever G is. q: the G heads' queries [G, D]; scores
// [G, KV_CHUNK]; part: head j's (max, sum, acc) at part + j * part_stride. D a multiple of 8.
// softcap > 0: each score becomes softcap * tanh(score / softcap) before the max.
// One function per G and pool kind (KIND a constant). A quantized pool's dots run on the
// codes as floats, then one multiply per key brings in its scale: k_scale into the score
// (with sm_scale), v_scale into the weight of its value row; ksc / vsc [S, Hkv] (unused for
// fp32 and bf16, whose code is what it was before quantized pools).
#define ATTEND_GROUP(G, KIND, NAME)                                                             \
    static void attend_group_##G##_##NAME(                                                      \
        const float *q, const int32_t *slots, int64_t t0, int64_t t1, const void *k_pool,       \
        const void *v_pool, const float *ksc, const float *vsc, int64_t Hkv, int64_t g,         \
        int64_t D, float sm_scale, float softcap, float *scores, float *part,                   \
        int64_t part_stride, int pf_all) {                                                      \
        const int kind = KIND, quant = KIND >= KV_I8;                                           \
        const int64_t n = t1 - t0;                                                              \
        int64_t t = 0;                                                                          \
        for (; t + 4 <= n; t += 4) {                                                            \
            for (int64_t u = t + KV_PREFETCH; u < t + KV_PREFETCH + 4 && u < n; u++) {          \
                const int64_t ru = (int64_t)slots[t0 + u] * Hkv + g, ou = ru * D;               \
                prefetch_row(k_pool, kind, ou, D);                                              \
                prefetch_row(v_pool, kind, ou, D);                                              \
                if (quant) {                                                                    \
                    _mm_prefetch((const char *)(ksc + ru), _MM_HINT_T0);                        \
                    _mm_prefetch((const char *)(vsc + ru), _MM_HINT_T0);                        \
                }                                                                               \
                if (pf_all) {                                                                   \
                    const int64_t row0 = (int64_t)slots[t0 + u] * Hkv * D;                      \
                    prefetch_row_l2(k_pool, kind, row0, Hkv * D);                               \
                    prefetch_row_l2(v_pool, kind, row0, Hkv * D);                               \
                }                                                                               \
            }                                                                                   \
            const int64_t r0 = (int64_t)slots[t0 + t] * Hkv + g, o0 = r0 * D;                   \
            const int64_t r1 = (int64_t)slots[t0 + t + 1] * Hkv + g, o1 = r1 * D;               \
            const int64_t r2 = (int64_t)slots[t0 + t + 2] * Hkv + g, o2 = r2 * D;               \
            const int64_t r3 = (int64_t)slots[t0 + t + 3] * Hkv + g, o3 = r3 * D;               \
            __m256 a[G][4];                                                                     \
            for (int j = 0; j < G; j++)                                                         \
                a[j][0] = a[j][1] = a[j][2] = a[j][3] = _mm256_setzero_ps();                    \
            for (int64_t d = 0; d < D; d += 8) {                                                \
                const __m256 k0 = load8(k_pool, kind, o0 + d), k1 = load8(k_pool, kind, o1 + d); \
                const __m256 k2 = load8(k_pool, kind, o2 + d), k3 = load8(k_pool, kind, o3 + d); \
                for (int j = 0; j < G; j++) {                                                   \
                    const __m256 qv = _mm256_loadu_ps(q + j * D + d);                           \
                    a[j][0] = _mm256_fmadd_ps(qv, k0, a[j][0]);                                 \
                    a[j][1] = _mm256_fmadd_ps(qv, k1, a[j][1]);                                 \
                    a[j][2] = _mm256_fmadd_ps(qv, k2, a[j][2]);                                 \
                    a[j][3] = _mm256_fmadd_ps(qv, k3, a[j][3]);                                 \
                }                                                                               \
            }                                                                                   \
            __m128 mul = _mm_set1_ps(sm_scale);                                                 \
            if (quant)                                                                          \
                mul = _mm_mul_ps(mul, _mm_set_ps(ksc[r3], ksc[r2], ksc[r1],                     \
                                                 ksc[r0]));                                     \
            for (int j = 0; j < G; j++)                                                         \
                _mm_storeu_ps(scores + j * KV_CHUNK + t,                                        \
                              _mm_mul_ps(hsum4(a[j][0], a[j][1], a[j][2], a[j][3]), mul));      \
        }                                                                                       \
        for (; t < n; t++) {                                                                    \
            const int64_t r = (int64_t)slots[t0 + t] * Hkv + g, o = r * D;                      \
            __m256 a[G];                                                                        \
            for (int j = 0; j < G; j++) a[j] = _mm256_setzero_ps();                             \
            for (int64_t d = 0; d < D; d += 8) {                                                \
                const __m256 kv = load8(k_pool, kind, o + d);                                   \
                for (int j = 0; j < G; j++)                                                     \
                    a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * D + d), kv, a[j]);           \
            }                                                                                   \
            const float mul = quant ? sm_scale * ksc[r] : sm_scale;                             \
            for (int j = 0; j < G; j++)                                                         \
                scores[j * KV_CHUNK + t] = _mm_cvtss_f32(hsum4(a[j], a[j], a[j], a[j])) * mul;  \
        }                                                                                       \
        for (int j = 0; j < G; j++) {                                                           \
            float *sc = scores + j * KV_CHUNK;                                                  \
            if (softcap > 0.0f) softcap_row(sc, n, softcap);                                    \
            const float mx = max_row(sc, n);                                                    \
            part[j * part_stride] = mx;                                                         \
            part[j * part_stride + 1] = exp_shift_sum(sc, n, mx);                               \
        }                                                                                       \
        int64_t d0 = 0;                                                                         \
        for (; d0 + 32 <= D; d0 += 32) {                                                        \
            __m256 acc[G][4];                                                                   \
            for (int j = 0; j < G; j++)                                                         \
                acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = _mm256_setzero_ps();            \
            for (t = 0; t < n; t++) {                                                           \
                const int64_t r = (int64_t)slots[t0 + t] * Hkv + g, o = r * D + d0;             \
                const __m256 v0 = load8(v_pool, kind, o), v1 = load8(v_pool, kind, o + 8);      \
                const __m256 v2 = load8(v_pool, kind, o + 16), v3 = load8(v_pool, kind, o + 24); \
                const float vs = quant ? vsc[r] : 1.0f;                                         \
                for (int j = 0; j < G; j++) {                                                   \
                    const float w = scores[j * KV_CHUNK + t];                                   \
                    const __m256 p = _mm256_set1_ps(quant ? w * vs : w);                        \
                    acc[j][0] = _mm256_fmadd_ps(p, v0, acc[j][0]);                              \
                    acc[j][1] = _mm256_fmadd_ps(p, v1, acc[j][1]);                              \
                    acc[j][2] = _mm256_fmadd_ps(p, v2, acc[j][2]);                              \
                    acc[j][3] = _mm256_fmadd_ps(p, v3, acc[j][3]);                              \
                }                                                                               \
            }                                                                                   \
            for (int j = 0; j < G; j++)                                                         \
                for (int i = 0; i < 4; i++)                                                     \
                    _mm256_storeu_ps(part + j * part_stride + 2 + d0 + 8 * i, acc[j][i]);       \
        }                                                                                       \
        for (; d0 < D; d0 += 8) { /* a head size not a multiple of 32 */                        \
            __m256 acc[G];                                                                      \
            for (int j = 0; j < G; j++) acc[j] = _mm256_setzero_ps();                           \
            for (t = 0; t < n; t++) {                                                           \
                const int64_t r = (int64_t)slots[t0 + t] * Hkv + g, o = r * D + d0;             \
                const __m256 v = load8(v_pool, kind, o);                                        \
                const float vs = quant ? vsc[r] : 1.0f;                                         \
                for (int j = 0; j < G; j++) {                                                   \
                    const float w = scores[j * KV_CHUNK + t];                                   \
                    acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(quant ? w * vs : w), v, acc[j]);    \
                }                                                                               \
            }                                                                                   \
            for (int j = 0; j < G; j++) _mm256_storeu_ps(part + j * part_stride + 2 + d0, acc[j]); \
        }                                                                                       \
    }

#define ATTEND_KINDS(G)                                                                         \
    ATTEND_GROUP(G, KV_F32, f32)                                                                \
    ATTEND_GROUP(G, KV_BF16, bf16)                                                              \
    ATTEND_GROUP(G, KV_I8, i8)                                                                  \
    ATTEND_GROUP(G, KV_E4M3, e4m3)                                                              \
    ATTEND_GROUP(G, KV_E5M2, e5m2)
ATTEND_KINDS(1)
ATTEND_KINDS(2)
ATTEND_KINDS(3)
ATTEND_KINDS(4)

// The int8 pool's own kernel: integer dot products for the scores. Each query head's (rotated)
// row is rounded to int16 with its own scale, qs = max|q| / 32767 (about 5 significant
// digits, far finer than the keys' 8 bits; attn_rope_store_team does it once a row), and a
// key row's codes are widened to int16 once for the G heads; each head's dot is pairs of
// products summed in int32, exactly (|sum| <= D * 32767 * 127 < 2^31 for D <= 256), by
// vpmaddwd + vpaddd (AVX2) or vpdpwssd (AVX-512 VNNI), and eight keys' lane sums are
// reduced together before one float multiply brings in qs * sm_scale and each key's scale.
// The float path widened every code to float and spent an FMA per code and head: at long
// contexts on 2 cores the attention is compute-bound there, so this is what turns the pool's
// halved bytes into speed. Values: the weighted sum of V rows in float, as the generic kernel
// (the weights times their V scales first, then 16 columns at a time so the G heads'
// accumulators stay in registers). D a multiple of 16, at most 256.
#define I8_MAX_D 256
static inline int i8_kernel_fits(int64_t D) { return D % 16 == 0 && D <= I8_MAX_D; }

static inline __m256i dot16_i8(__m256i acc, __m256i q, __m256i k) {
#ifdef Q4_VNNI
    return _mm256_dpwssd_epi32(acc, q, k);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(q, k));
#endif
}

// the lane sums of b[0..7] (8 lanes each), in order
static inline __m256i hsum8_i32(const __m256i *b) {
    const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(b[0], b[1]),
                                         _mm256_hadd_epi32(b[2], b[3]));
    const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(b[4], b[5]),
                                         _mm256_hadd_epi32(b[6], b[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20),
                            _mm256_permute2x128_si256(s0, s1, 0x31));
}

static inline int32_t hsum1_i32(__m256i a) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}


// one query row's G heads as int16 (q [G, D] float) -> q16 [G, D], qs [G]
static void quantize_q16(const float *q, int64_t G, int64_t D, int16_t *q16, float *qs) {
    for (int64_t j = 0; j < G; j++) {
        float amax = 0.0f;
        for (int64_t d = 0; d < D; d++)
            amax = fabsf(q[j * D + d]) > amax ? fabsf(q[j * D + d]) : amax;
        const float s = amax / 32767.0f, div = s > 0.0f ? s : 1.0f;
        for (int64_t d = 0; d < D; d++) q16[j * D + d] = (int16_t)nearbyintf(q[j * D + d] / div);
        qs[j] = s;
    }
}

// The pieces both int8 kernels below are made of (G <= 4 query heads of one kv head;
// always inlined, so each kernel's G is a constant in them).
#define I8_INLINE static inline __attribute__((always_inline))

// the G heads' int32 dots of q16 [G, D] with the codes of keys k0 and k1, as lane vectors:
// buf[j][p] and buf[j][p + 1] (eight keys' are reduced together by i8_scores8)
I8_INLINE void i8_dot_pair(int G, const int16_t *q16, int64_t D, const int8_t *k0,
                           const int8_t *k1, __m256i (*buf)[8], int p) {
    __m256i a[4][2];
    for (int j = 0; j < G; j++) a[j][0] = a[j][1] = _mm256_setzero_si256();
    for (int64_t d = 0; d < D; d += 16) {
        const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k0 + d)));
        const __m256i x1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k1 + d)));
        for (int j = 0; j < G; j++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(q16 + j * D + d));
            a[j][0] = dot16_i8(a[j][0], qv, x0);
            a[j][1] = dot16_i8(a[j][1], qv, x1);
        }
    }
    for (int j = 0; j < G; j++) {
        buf[j][p] = a[j][0];
        buf[j][p + 1] = a[j][1];
    }
}

// eight keys' scores of each head from buf: the dot, times mul[j] (the query's scale and
// sm_scale), times each key's scale ks, at scores[j * KV_CHUNK + t ...]
I8_INLINE void i8_scores8(int G, __m256i (*buf)[8], const float *mul, __m256 ks, float *scores,
                          int64_t t) {
    for (int j = 0; j < G; j++)
        _mm256_storeu_ps(scores + j * KV_CHUNK + t,
                         _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hsum8_i32(buf[j])),
                                                     _mm256_set1_ps(mul[j])), ks));
}

// one key's scores (the keys past the last multiple of 8), in the same arithmetic
I8_INLINE void i8_scores1(int G, const int16_t *q16, int64_t D, const int8_t *k0,
                          const float *mul, float ks, float *scores, int64_t t) {
    __m256i a[4];
    for (int j = 0; j < G; j++) a[j] = _mm256_setzero_si256();
    for (int64_t d = 0; d < D; d += 16) {
        const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k0 + d)));
        for (int j = 0; j < G; j++)
            a[j] = dot16_i8(a[j], _mm256_loadu_si256((const __m256i *)(q16 + j * D + d)), x0);
    }
    for (int j = 0; j < G; j++) scores[j * KV_CHUNK + t] = ((float)hsum1_i32(a[j]) * mul[j]) * ks;
}

// each head's softmax over its n scores (max and sum to its part), its weights times the V
// scales vs [n], then the weighted sum of the V rows vp + rows[t] * D into part + 2 (16
// columns at a time, so the G heads' accumulators stay in registers)
I8_INLINE void i8_values(int G, float *scores, int64_t n, const float *vs, const int8_t *vp,
                         const int64_t *rows, int64_t D, float softcap, float *part,
                         int64_t part_stride) {
    for (int j = 0; j < G; j++) {
        float *sc = scores + j * KV_CHUNK;
        if (softcap > 0.0f) softcap_row(sc, n, softcap);
        const float mx = max_row(sc, n);
        part[j * part_stride] = mx;
        part[j * part_stride + 1] = exp_shift_sum(sc, n, mx);
        for (int64_t t = 0; t < n; t++) sc[t] *= vs[t];
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m256 acc[4][2];
        for (int j = 0; j < G; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const int64_t o = rows[t] * D + d0;
            const __m256 v0 = load8(vp, KV_I8, o), v1 = load8(vp, KV_I8, o + 8);
            for (int j = 0; j < G; j++) {
                const __m256 w = _mm256_broadcast_ss(scores + j * KV_CHUNK + t);
                acc[j][0] = _mm256_fmadd_ps(w, v0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(w, v1, acc[j][1]);
            }
        }
        for (int j = 0; j < G; j++) {
            _mm256_storeu_ps(part + j * part_stride + 2 + d0, acc[j][0]);
            _mm256_storeu_ps(part + j * part_stride + 2 + d0 + 8, acc[j][1]);
        }
    }
}

// G query heads of kv head g over keys [t0, t1) of `slots`
#define ATTEND_I8(G)                                                                            \
    static void attend_i8_##G(                                                                  \
        const int16_t *q16, const float *qs, const int32_t *slots, int64_t t0, int64_t t1,      \
        const int8_t *kp, const int8_t *vp, const float *ksc, const float *vsc, int64_t Hkv,    \
        int64_t g, int64_t D, float sm_scale, float softcap, float *scores, float *part,        \
        int64_t part_stride, int pf_all) {                                                      \
        const int64_t n = t1 - t0;                                                              \
        int64_t rows[KV_CHUNK];                                                                 \
        float kss[KV_CHUNK];                                                                    \
        __m256i buf[G][8];                                                                      \
        float mul[G];                                                                           \
        for (int j = 0; j < G; j++) mul[j] = qs[j] * sm_scale;                                  \
        for (int64_t t = 0; t < n; t++) { /* the scales' lines start coming now */              \
            rows[t] = (int64_t)slots[t0 + t] * Hkv + g;                                         \
            _mm_prefetch((const char *)(ksc + rows[t]), _MM_HINT_T0);                           \
            _mm_prefetch((const char *)(vsc + rows[t]), _MM_HINT_T0);                           \
        }                                                                                       \
        int64_t t = 0;                                                                          \
        for (; t + 8 <= n; t += 8) {                                                            \
            for (int p = 0; p < 8; p += 2) {                                                    \
                for (int64_t u = t + p + KV_PREFETCH; u < t + p + KV_PREFETCH + 2 && u < n; u++) { \
                    prefetch_row(kp, KV_I8, rows[u] * D, D);                                    \
                    prefetch_row(vp, KV_I8, rows[u] * D, D);                                    \
                    if (pf_all) {                                                               \
                        const int64_t row0 = (int64_t)slots[t0 + u] * Hkv * D;                  \
                        prefetch_row_l2(kp, KV_I8, row0, Hkv * D);                              \
                        prefetch_row_l2(vp, KV_I8, row0, Hkv * D);                              \
                    }                                                                           \
                }                                                                               \
                i8_dot_pair(G, q16, D, kp + rows[t + p] * D, kp + rows[t + p + 1] * D, buf, p); \
            }                                                                                   \
            for (int i = 0; i < 8; i++) kss[t + i] = ksc[rows[t + i]];                          \
            i8_scores8(G, buf, mul, _mm256_loadu_ps(kss + t), scores, t);                       \
        }                                                                                       \
        for (; t < n; t++)                                                                      \
            i8_scores1(G, q16, D, kp + rows[t] * D, mul, ksc[rows[t]], scores, t);              \
        for (t = 0; t < n; t++) kss[t] = vsc[rows[t]]; /* now the V scales */                   \
        i8_values(G, scores, n, kss, vp, rows, D, softcap, part, part_stride);                  \
    }
ATTEND_I8(1)
ATTEND_I8(2)
ATTEND_I8(3)
ATTEND_I8(4)

// Every kv head of one query row over a chunk of a long context, in one pass over the chunk's
// slot rows (the by-chunk plan's items; each head's arithmetic is attend_i8_G's, so the same
// bits): the rows' slots, the scale lookups and the prefetches are done once a key for all the
// heads instead of once a key and head, and a slot's K codes of every head (Hkv * D contiguous
// bytes) are read together. At 4,096 keys on a Zen 3 core those per-head repeats (and the
// prefetch instructions) took about half of attend_i8_3's time (docs/cpu-kernels.md).
// q16 / qs: the row's Hq = Hkv * G heads; scores [Hq, KV_CHUNK]; head h's partial at
// part + h * part_stride.
#define ATTEND_I8_ALL(G)                                                                        \
    static void attend_i8_all_##G(                                                              \
        const int16_t *q16, const float *qs, const int32_t *slots, int64_t t0, int64_t t1,      \
        const int8_t *kp, const int8_t *vp, const float *ksc, const float *vsc, int64_t Hkv,    \
        int64_t D, float sm_scale, float softcap, float *scores, float *part,                   \
        int64_t part_stride, int pf) {                                                          \
        const int64_t n = t1 - t0, row = Hkv * D;                                               \
        int64_t base[KV_CHUNK], rows[KV_CHUNK]; /* slot * Hkv; head g's row is base + g */      \
        float kss[KV_CHUNK];                                                                    \
        __m256i buf[G][8];                                                                      \
        for (int64_t t = 0; t < n; t++) {                                                       \
            base[t] = (int64_t)slots[t0 + t] * Hkv;                                             \
            _mm_prefetch((const char *)(ksc + base[t]), _MM_HINT_T0);                           \
            _mm_prefetch((const char *)(vsc + base[t]), _MM_HINT_T0);                           \
        }                                                                                       \
        int64_t t = 0;                                                                          \
        for (; t + 8 <= n; t += 8) {                                                            \
            if (pf) /* K for this pass, V (read after the chunk's scores) into L2 */            \
                for (int64_t u = t + KV_PREFETCH; u < t + KV_PREFETCH + 8 && u < n; u++) {      \
                    prefetch_row(kp, KV_I8, base[u] * D, row);                                  \
                    prefetch_row_l2(vp, KV_I8, base[u] * D, row);                               \
                }                                                                               \
            for (int64_t g = 0; g < Hkv; g++) {                                                 \
                float mul[G], ks8[8];                                                           \
                for (int j = 0; j < G; j++) mul[j] = qs[g * G + j] * sm_scale;                  \
                for (int p = 0; p < 8; p += 2)                                                  \
                    i8_dot_pair(G, q16 + g * G * D, D, kp + (base[t + p] + g) * D,              \
                                kp + (base[t + p + 1] + g) * D, buf, p);                        \
                for (int i = 0; i < 8; i++) ks8[i] = ksc[base[t + i] + g];                      \
                i8_scores8(G, buf, mul, _mm256_loadu_ps(ks8), scores + g * G * KV_CHUNK, t);    \
            }                                                                                   \
        }                                                                                       \
        for (; t < n; t++)                                                                      \
            for (int64_t g = 0; g < Hkv; g++) {                                                 \
                float mul[G];                                                                   \
                for (int j = 0; j < G; j++) mul[j] = qs[g * G + j] * sm_scale;                  \
                i8_scores1(G, q16 + g * G * D, D, kp + (base[t] + g) * D, mul,                  \
                           ksc[base[t] + g], scores + g * G * KV_CHUNK, t);                     \
            }                                                                                   \
        for (int64_t g = 0; g < Hkv; g++) {                                                     \
            for (t = 0; t < n; t++) {                                                           \
                rows[t] = base[t] + g;                                                          \
                kss[t] = vsc[rows[t]];                                                          \
            }                                                                                   \
            i8_values(G, scores + g * G * KV_CHUNK, n, kss, vp, rows, D, softcap,               \
                      part + g * G * part_stride, part_stride);                                 \
        }                                                                                       \
    }
ATTEND_I8_ALL(1)
ATTEND_I8_ALL(2)
ATTEND_I8_ALL(3)
ATTEND_I8_ALL(4)

typedef void (*attend_i8_all_fn)(const int16_t *, const float *, const int32_t *, int64_t,
                                 int64_t, const int8_t *, const int8_t *, const float *,
                                 const float *, int64_t, int64_t, float, float, float *, float *,
                                 int64_t, int);
static const attend_i8_all_fn I8_ALL_FNS[4] = {attend_i8_all_1, attend_i8_all_2,
                                               attend_i8_all_3, attend_i8_all_4};

typedef void (*attend_i8_fn)(const int16_t *, const float *, const int32_t *, int64_t, int64_t,
                             const int8_t *, const int8_t *, const float *, const float *,
                             int64_t, int64_t, int64_t, float, float, float *, float *, int64_t,
                             int);
static const attend_i8_fn I8_FNS[4] = {attend_i8_1, attend_i8_2, attend_i8_3, attend_i8_4};

typedef void (*attend_fn)(const float *, const int32_t *, int64_t, int64_t, const void *,
                          const void *, const float *, const float *, int64_t, int64_t, int64_t,
                          float, float, float *, float *, int64_t, int);
#define ATTEND_ROW(G)                                                                           \
    {attend_group_##G##_f32, attend_group_##G##_bf16, attend_group_##G##_i8,                    \
     attend_group_##G##_e4m3, attend_group_##G##_e5m2}
static const attend_fn ATTEND_FNS[4][KV_KINDS] = {ATTEND_ROW(1), ATTEND_ROW(2), ATTEND_ROW(3),
                                                  ATTEND_ROW(4)};

// heads [h0, h0 + G) of kv head g, G <= 4, over a pool of `kind` (see ATTEND_GROUP); an int8
// pool's through attend_i8_* with the heads' int16 queries q16 [G, D] and their scales qs
static void attend_group(int G, const float *q, const int16_t *q16, const float *qs,
                         const int32_t *slots, int64_t t0, int64_t t1, const void *k_pool,
                         const void *v_pool, int kind, const float *ksc, const float *vsc,
                         int64_t Hkv, int64_t g, int64_t D, float sm_scale, float softcap,
                         float *scores, float *part, int64_t part_stride, int pf_all) {
    const int fn = (G < 4 ? G : 4) - 1;
    if (kind == KV_I8 && i8_kernel_fits(D))
        I8_FNS[fn](q16, qs, slots, t0, t1, (const int8_t *)k_pool, (const int8_t *)v_pool, ksc,
                   vsc, Hkv, g, D, sm_scale, softcap, scores, part, part_stride, pf_all);
    else
        ATTEND_FNS[fn][kind](q, slots, t0, t1, k_pool, v_pool, ksc, vsc, Hkv, g, D, sm_scale,
                             softcap, scores, part, part_stride, pf_all);
}

// rotate-half RoPE of one head: out[i] = x[i] * cos[i] + x[(i + D/2) % D] * sin_signed[i],
// with the model's tables ([cos, cos] and [-sin, sin] rows)
static inline void rope_head(const float *x, const float *cos_row, const float *sin_row, int D,
                             float *out) {
    const int half = D / 2;
    for (int i = 0; i < D; i++) {
        const float rolled = x[i < half ? i + half : i - half];
        out[i] = x[i] * cos_row[i] + rolled * sin_row[i];
    }
}

// Cascade: decode rows whose key rows begin with the same slots (requests on one cached
// prefix: a shared system prompt, n > 1 samples of a prompt) read those shared keys once,
// together. Per kv head and chunk of shared keys, the chunk's K rows are widened to float
// once (times their scales for a quantized pool) and transposed, and every query head of
// every row of the group (its rows x G) takes its scores from them in one register-blocked
// product; likewise the V rows for the weighted sums. A row alone widens each key for its own
// G heads and sums each dot across lanes: at 32 rows on a 900-key prefix that was half of a
// decode step (perf, AMX Xeon). The result is one (max, sum, acc) partial per row, head and
// shared chunk, merged with the row's own chunks as any others: other float sums than the
// row alone (the dot's order), so attn_plan_init's caller turns it off where a row's bits
// must not depend on its batch (deterministic mode, verifies).
#define SHARED_QB 6   // query heads a register block of the products serves
#define SHARED_KB 32  // keys a score block (the AVX-512 build's two vectors; AVX2 takes two
                      // blocks of 16): the keys are padded to it

// 8 rows of 8 floats -> their 8 columns
static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// keys [t0, t0 + n) of kv head g -> kt [D, nk] (key-minor; nk = n rounded up to
// SHARED_KB, zeros past n) and vf [n, D], as floats times their scales
static inline __attribute__((always_inline)) void shared_widen(
    int kind, const int32_t *slots, int64_t t0, int64_t n, int64_t nk, const void *k_pool,
    const void *v_pool, const float *ksc, const float *vsc, int64_t Hkv, int64_t g, int64_t D,
    float *kt, float *vf) {
    const int quant = kind >= KV_I8;
    for (int64_t t = 0; t < nk; t += 8) {
        // the next 8 keys' rows, gathered by slot: no hardware prefetcher sees them coming
        for (int64_t u = t + 8; u < t + 16 && u < n; u++) {
            const int64_t ru = (int64_t)slots[t0 + u] * Hkv + g;
            prefetch_row(k_pool, kind, ru * D, D);
            prefetch_row(v_pool, kind, ru * D, D);
        }
        int64_t off[8];
        __m256 s = _mm256_set1_ps(1.0f);
        float sv[8];
        for (int i = 0; i < 8; i++) {
            const int64_t r = t + i < n ? (int64_t)slots[t0 + t + i] * Hkv + g : -1;
            off[i] = r < 0 ? -1 : r * D;
            sv[i] = quant && r >= 0 ? ksc[r] : 1.0f;
        }
        if (quant) s = _mm256_loadu_ps(sv);
        for (int64_t d = 0; d < D; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = off[i] < 0 ? _mm256_setzero_ps() : load8(k_pool, kind, off[i] + d);
            transpose8(r);
            for (int i = 0; i < 8; i++)  // column d + i holds the 8 keys: times their scales
                _mm256_storeu_ps(kt + (d + i) * nk + t, quant ? _mm256_mul_ps(r[i], s) : r[i]);
        }
        for (int i = 0; i < 8 && t + i < n; i++) {
            const int64_t r = (int64_t)slots[t0 + t + i] * Hkv + g;
            const __m256 vs = _mm256_set1_ps(quant ? vsc[r] : 1.0f);
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 v = load8(v_pool, kind, r * D + d);
                _mm256_storeu_ps(vf + (t + i) * D + d, quant ? _mm256_mul_ps(v, vs) : v);
            }
        }
    }
}

// scores [nq, nk] (row stride nk) = sm_scale * q_j . k_t for the nq query rows qp[j] [D].
// Each score is one FMA chain over d in order, in either build: the same bits at any width.
static void shared_scores(const float *const *qp, int64_t nq, const float *kt, int64_t nk,
                          int64_t D, float sm_scale, float *scores) {
    static const float zero[256] = {0};
    for (int64_t j0 = 0; j0 < nq; j0 += SHARED_QB) {
        const float *q[SHARED_QB];
        for (int j = 0; j < SHARED_QB; j++) q[j] = j0 + j < nq ? qp[j0 + j] : zero;
        const int m = nq - j0 < SHARED_QB ? (int)(nq - j0) : SHARED_QB;
#ifdef __AVX512F__
        const __m512 mul = _mm512_set1_ps(sm_scale);
        for (int64_t t = 0; t < nk; t += 32) {
            __m512 a[SHARED_QB][2];
            for (int j = 0; j < SHARED_QB; j++) a[j][0] = a[j][1] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                const __m512 k0 = _mm512_loadu_ps(kt + d * nk + t);
                const __m512 k1 = _mm512_loadu_ps(kt + d * nk + t + 16);
                for (int j = 0; j < SHARED_QB; j++) {
                    const __m512 qv = _mm512_set1_ps(q[j][d]);
                    a[j][0] = _mm512_fmadd_ps(qv, k0, a[j][0]);
                    a[j][1] = _mm512_fmadd_ps(qv, k1, a[j][1]);
                }
            }
            for (int j = 0; j < m; j++) {
                _mm512_storeu_ps(scores + (j0 + j) * nk + t, _mm512_mul_ps(a[j][0], mul));
                _mm512_storeu_ps(scores + (j0 + j) * nk + t + 16, _mm512_mul_ps(a[j][1], mul));
            }
        }
#else
        const __m256 mul = _mm256_set1_ps(sm_scale);
        for (int64_t t = 0; t < nk; t += 16) {
            __m256 a[SHARED_QB][2];
            for (int j = 0; j < SHARED_QB; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                const __m256 k0 = _mm256_loadu_ps(kt + d * nk + t);
                const __m256 k1 = _mm256_loadu_ps(kt + d * nk + t + 8);
                for (int j = 0; j < SHARED_QB; j++) {
                    const __m256 qv = _mm256_broadcast_ss(q[j] + d);
                    a[j][0] = _mm256_fmadd_ps(qv, k0, a[j][0]);
                    a[j][1] = _mm256_fmadd_ps(qv, k1, a[j][1]);
                }
            }
            for (int j = 0; j < m; j++) {
                _mm256_storeu_ps(scores + (j0 + j) * nk + t, _mm256_mul_ps(a[j][0], mul));
                _mm256_storeu_ps(scores + (j0 + j) * nk + t + 8, _mm256_mul_ps(a[j][1], mul));
            }
        }
#endif
    }
}

// out_j [16, or on AVX-512 32, columns from d] (at parts[j] + 2 + d) = sum_t w[j, t] *
// vf[t, d ..] for M (a constant once inlined) query rows of weights w [*, nk]: one FMA chain
// over t in order for each output, in either build
static inline __attribute__((always_inline)) void shared_values_block(
    int M, const float *w, int64_t nk, int64_t n, const float *vf, int64_t D, int64_t d,
    float *const *parts) {
#ifdef __AVX512F__
    if (d + 32 <= D) {  // 32 columns: twice the independent chains, one weight load for both
        __m512 a[SHARED_QB][2];
        for (int j = 0; j < M; j++) a[j][0] = a[j][1] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m512 v0 = _mm512_loadu_ps(vf + t * D + d);
            const __m512 v1 = _mm512_loadu_ps(vf + t * D + d + 16);
            for (int j = 0; j < M; j++) {
                const __m512 p = _mm512_set1_ps(w[j * nk + t]);
                a[j][0] = _mm512_fmadd_ps(p, v0, a[j][0]);
                a[j][1] = _mm512_fmadd_ps(p, v1, a[j][1]);
            }
        }
        for (int j = 0; j < M; j++) {
            _mm512_storeu_ps(parts[j] + 2 + d, a[j][0]);
            _mm512_storeu_ps(parts[j] + 2 + d + 16, a[j][1]);
        }
        return;
    }
    __m512 a[SHARED_QB];
    for (int j = 0; j < M; j++) a[j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const __m512 v = _mm512_loadu_ps(vf + t * D + d);
        for (int j = 0; j < M; j++) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[j * nk + t]), v, a[j]);
    }
    for (int j = 0; j < M; j++) _mm512_storeu_ps(parts[j] + 2 + d, a[j]);
#else
    __m256 a[SHARED_QB][2];
    for (int j = 0; j < M; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        const __m256 v0 = _mm256_loadu_ps(vf + t * D + d);
        const __m256 v1 = _mm256_loadu_ps(vf + t * D + d + 8);
        for (int j = 0; j < M; j++) {
            const __m256 p = _mm256_broadcast_ss(w + j * nk + t);
            a[j][0] = _mm256_fmadd_ps(p, v0, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(p, v1, a[j][1]);
        }
    }
    for (int j = 0; j < M; j++) {
        _mm256_storeu_ps(parts[j] + 2 + d, a[j][0]);
        _mm256_storeu_ps(parts[j] + 2 + d + 8, a[j][1]);
    }
#endif
}

// the weighted V sums of the nq rows of weights w [nq, nk] (keys [0, n)) into their partials
static void shared_values(const float *w, int64_t nq, int64_t nk, int64_t n, const float *vf,
                          int64_t D, float *const *parts) {
    for (int64_t j0 = 0; j0 < nq; j0 += SHARED_QB) {
        const float *wj = w + j0 * nk;
#ifdef __AVX512F__
        for (int64_t d = 0; d < D; d += d + 32 <= D ? 32 : 16) {
#else
        for (int64_t d = 0; d < D; d += 16) {
#endif
            switch (nq - j0 < SHARED_QB ? nq - j0 : SHARED_QB) {
            case 1: shared_values_block(1, wj, nk, n, vf, D, d, parts + j0); break;
            case 2: shared_values_block(2, wj, nk, n, vf, D, d, parts + j0); break;
            case 3: shared_values_block(3, wj, nk, n, vf, D, d, parts + j0); break;
            case 4: shared_values_block(4, wj, nk, n, vf, D, d, parts + j0); break;
            case 5: shared_values_block(5, wj, nk, n, vf, D, d, parts + j0); break;
            default: shared_values_block(SHARED_QB, wj, nk, n, vf, D, d, parts + j0); break;
            }
        }
    }
}

// Floats of thread scratch one shared item takes (kt, vf and the scores)
static inline size_t shared_floats(int64_t D, int64_t nq) {
    const int64_t nk = (KV_CHUNK + SHARED_KB - 1) / SHARED_KB * SHARED_KB;
    return (size_t)(2 * D * nk + nq * nk);
}

// amx_attn.c's cascade over a bf16 pool on AMX tiles, lent by the AMX library once it loads
// (it is built apart, with flags this build must not assume); NULL: the vector products
// here. Its sums are in the tiles' order: other bits than these, as the cascade's already
// are other bits than a row alone.
typedef int (*amx_shared_fn)(const float *const *, int64_t, const uint16_t *, const uint16_t *,
                             const int32_t *, int64_t, int64_t, int64_t, int64_t, float, float,
                             float *const *);
static amx_shared_fn amx_shared;

void attn_set_tiles(void *fn) {
#ifdef __AVX512F__
    amx_shared = (amx_shared_fn)fn;
#else  // the AVX2 build stays what an AVX2 machine runs
    (void)fn;
#endif
}

// Shared group s's chunk c of its shared keys, kv head g: every row's G heads' partials
static void attend_shared(const attn_plan *p, int64_t s, int64_t g, int64_t c,
                          const int32_t *table, int64_t ld_table, const int64_t *rows,
                          const void *k_pool, const void *v_pool, int kind, const float *ksc,
                          const float *vsc, float sm_scale, float softcap, float *buf) {
    const int64_t D = p->D, Hq = p->Hq, G = p->group;
    const int64_t r0 = p->shared_start[s], nr = p->shared_start[s + 1] - r0;
    const int64_t t0 = c * KV_CHUNK, len = p->shared_len[s];
    const int64_t n = len - t0 < KV_CHUNK ? len - t0 : KV_CHUNK;
    const int64_t nk = (n + SHARED_KB - 1) / SHARED_KB * SHARED_KB, nq = nr * G;
    float *kt = buf, *vf = kt + D * nk, *scores = vf + D * nk;
    const float *qp[nq];  // each row's G heads: query, partial
    float *parts[nq];
    for (int64_t i = 0; i < nr; i++) {
        const int64_t b = p->shared_rows[r0 + i], nch = p->num_chunks[b];
        for (int64_t j = 0; j < G; j++) {
            const int64_t h = g * G + j;
            qp[i * G + j] = p->q_all + (b * Hq + h) * D;
            parts[i * G + j] = p->partials + (p->item_start[b] + h * nch + c) * (D + 2);
        }
    }
    const int32_t *slots = table + rows[p->shared_rows[r0]] * ld_table;
    if (kind == KV_BF16 && amx_shared && D % 32 == 0 &&
        amx_shared(qp, nq, (const uint16_t *)k_pool, (const uint16_t *)v_pool, slots + t0, n,
                   p->Hkv, g, D, sm_scale, softcap, parts) == 0)
        return;
#define WIDEN(KIND) \
    shared_widen(KIND, slots, t0, n, nk, k_pool, v_pool, ksc, vsc, p->Hkv, g, D, kt, vf)
    switch (kind) {  // the widening compiled once per kind
    case KV_F32: WIDEN(KV_F32); break;
    case KV_BF16: WIDEN(KV_BF16); break;
    case KV_I8: WIDEN(KV_I8); break;
    case KV_E4M3: WIDEN(KV_E4M3); break;
    default: WIDEN(KV_E5M2); break;
    }
#undef WIDEN
    shared_scores(qp, nq, kt, nk, D, sm_scale, scores);
    for (int64_t j = 0; j < nq; j++) {
        float *sc = scores + j * nk;
        if (softcap > 0.0f) softcap_row(sc, n, softcap);
        const float mx = max_row(sc, n);
        parts[j][0] = mx;
        parts[j][1] = exp_shift_sum(sc, n, mx);
    }
    shared_values(scores, nq, nk, n, vf, D, parts);
}

// By chunk (below), query rows that read the same keys are grouped: a verify's rows of one
// request (its prefix, then a few tree nodes), or requests sharing a cached prefix. A work item
// is then (group, chunk) and runs every row of its group, so the keys its rows share come from
// memory once: the first row's pass prefetches them, the others find them in L2. A group is a
// run of consecutive rows whose key rows start with the same slot, at most `cap` rows (a
// verify of one request still splits across the threads).
static int64_t group_rows(const int32_t *table, int64_t ld_table, const int64_t *rows,
                          const int64_t *seq_lens, const int64_t *lo, int64_t B, int64_t cap,
                          int64_t *group_start) {
    int64_t n = 0, size = 0;
    for (int64_t b = 0; b < B; b++) {
        const int join = b > 0 && size < cap && seq_lens[b] > 0 && seq_lens[b - 1] > 0 &&
                         table[rows[b] * ld_table + lo[b]] ==
                             table[rows[b - 1] * ld_table + lo[b - 1]];
        if (!join) {
            group_start[n++] = b;
            size = 0;
        }
        size++;
    }
    group_start[n] = B;
    return n;
}

// A causal run of one prompt's rows (a cold prompt's prefill, a long chunk) shares only the
// keys before its first row: the greedy grouping below gives its 800 rows one group of
// shared_min keys, and each row then reads the rest alone (800 rows x 400 keys, one row at a
// time). So a group is cut by how far each member's keys agree with its longest member's,
// by block of CAUSAL_BLOCK keys. Where the group holds a causal run (two rows of one
// request), each bucket shares exactly its block boundary: the boundaries are positions, not
// the batch's, so a prompt's row shares the same keys whether the prompt came cold or partly
// from the cache, and sums alike. A group of decode rows (one a request) keeps the length it
// was found with, cut only where members agree a block or more further (a bucket then shares
// what its least agreeing member does): requests on one cached prefix stay one group sharing
// all of it. Members agreeing with the longest up to a point agree with each other up to it,
// so each bucket's keys are truly shared; a bucket of one joins the one below. Returns the
// number of groups now.
#define CAUSAL_BLOCK 64
static int64_t split_causal(attn_plan *p, const int32_t *table, int64_t ld_table,
                            const int64_t *rows, const int64_t *seq_lens, int64_t used,
                            int64_t members, int64_t len, int64_t n) {
    int64_t *m = p->shared_rows + used, ref = m[0];
    int run = 0;  // members come in batch order: a run's rows are neighbours
    for (int64_t i = 1; i < members; i++) {
        ref = seq_lens[m[i]] > seq_lens[ref] ? m[i] : ref;
        run |= rows[m[i]] == rows[m[i - 1]];
    }
    const int32_t *rr = table + rows[ref] * ld_table;
    int64_t *agree = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)members);
    if (!agree) {  // one group, as found (correct too, only slower)
        p->shared_len[n] = len;
        p->shared_start[n + 1] = used + members;
        return n + 1;
    }
    int64_t *bucket = agree + members;
    for (int64_t i = 0; i < members; i++) {
        const int32_t *row = table + rows[m[i]] * ld_table;
        const int64_t lo = seq_lens[m[i]] < seq_lens[ref] ? seq_lens[m[i]] : seq_lens[ref];
        // every member holds the first len slots of every other; one request's rows hold
        // the same slots throughout (a 2,048-row chunk would otherwise compare 2M slots)
        int64_t same = rows[m[i]] == rows[ref] ? lo - 1 : len;
        while (same < lo - 1 && row[same] == rr[same]) same++;
        const int64_t block = same < CAUSAL_BLOCK ? same : same / CAUSAL_BLOCK * CAUSAL_BLOCK;
        agree[i] = run ? block : same;
        bucket[i] = run || block >= len + CAUSAL_BLOCK ? block : len;
    }
    for (int64_t i = 1; i < members; i++) {  // by bucket (insertion: rows come in order)
        const int64_t bk = bucket[i], ag = agree[i], r = m[i];
        int64_t j = i;
        for (; j > 0 && bucket[j - 1] > bk; j--) {
            bucket[j] = bucket[j - 1];
            agree[j] = agree[j - 1];
            m[j] = m[j - 1];
        }
        bucket[j] = bk;
        agree[j] = ag;
        m[j] = r;
    }
    const int64_t first = n;
    for (int64_t i = 0; i < members;) {
        int64_t e = i + 1, least = agree[i];
        for (; e < members && bucket[e] == bucket[i]; e++)
            least = agree[e] < least ? agree[e] : least;
        if (e - i == 1 && n > first) {
            p->shared_start[n] = used + e;  // a bucket of one joins the group below
        } else {
            p->shared_len[n] = least;
            p->shared_start[++n] = used + e;
        }
        i = e;
    }
    free(agree);
    return n;
}

// The shape of one step's attention (ops.h): groups, work items and partials. The same for
// every layer of a step, so the fused step (decode_step.c) builds it once.
// Shared groups (the cascade above): rows whose key rows hold the same slot at index
// shared_min - 1 (in the radix cache, the same slot means the same path up to it), with at
// least two rows; their shared length is the longest run of equal slots from 0 that every
// row of the group holds, short of each row's last key. Returns -1 out of memory.
static int find_shared(attn_plan *p, const int32_t *table, int64_t ld_table,
                       const int64_t *rows, const int64_t *seq_lens, int64_t shared_min) {
    const int64_t B = p->B;
    p->shared_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));
    p->shared_rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B > 0 ? B : 1));
    p->shared_len = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B > 0 ? B : 1));
    p->shared_item_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));
    char *taken = (char *)calloc((size_t)(B > 0 ? B : 1), 1);
    if (!p->shared_start || !p->shared_rows || !p->shared_len || !p->shared_item_start ||
        !taken) {
        free(taken);
        return -1;
    }
    int64_t n = 0, used = 0;
    p->shared_start[0] = 0;
    for (int64_t b = 0; b < B && shared_min > 0; b++) {
        if (taken[b] || seq_lens[b] <= shared_min) continue;
        const int32_t *first = table + rows[b] * ld_table;
        int64_t len = seq_lens[b] - 1, members = 1;
        p->shared_rows[used] = b;
        for (int64_t o = b + 1; o < B; o++) {
            if (taken[o] || seq_lens[o] <= shared_min) continue;
            const int32_t *row = table + rows[o] * ld_table;
            if (row[shared_min - 1] != first[shared_min - 1]) continue;
            int64_t same = 0;
            const int64_t most = len < seq_lens[o] - 1 ? len : seq_lens[o] - 1;
            while (same < most && row[same] == first[same]) same++;
            if (same < shared_min) continue;
            len = same;
            taken[o] = 1;
            p->shared_rows[used + members++] = o;
        }
        if (members < 2) continue;
        taken[b] = 1;
        n = split_causal(p, table, ld_table, rows, seq_lens, used, members, len, n);
        used += members;
    }
    free(taken);
    p->num_shared = n;
    return 0;
}

// The cascade's groups find_shared forms for these rows, for tests and benchmarks: group_of[b]
// (-1: the row reads every key alone) and len_of[g] (B entries). Returns the number of
// groups, -1 out of memory.
int attn_shared_groups(const int32_t *table, int64_t ld_table, const int64_t *rows,
                       const int64_t *seq_lens, int64_t B, int64_t shared_min, int64_t *group_of,
                       int64_t *len_of) {
    attn_plan p;
    memset(&p, 0, sizeof(p));
    p.B = B;
    if (find_shared(&p, table, ld_table, rows, seq_lens, shared_min) != 0) {
        attn_plan_free(&p);
        return -1;
    }
    for (int64_t b = 0; b < B; b++) group_of[b] = -1;
    for (int64_t g = 0; g < p.num_shared; g++) {
        len_of[g] = p.shared_len[g];
        for (int64_t i = p.shared_start[g]; i < p.shared_start[g + 1]; i++)
            group_of[p.shared_rows[i]] = g;
    }
    const int n = (int)p.num_shared;
    attn_plan_free(&p);
    return n;
}

int attn_plan_init(attn_plan *p, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                   const int32_t *table, int64_t ld_table, const int64_t *rows,
                   const int64_t *seq_lens, int64_t window, int64_t shared_min) {
    memset(p, 0, sizeof(*p));
    p->B = B; p->Hq = Hq; p->Hkv = Hkv; p->D = D;
    p->group = Hq / Hkv;
    p->sub = p->group < 4 ? p->group : 4;
    p->subs = (p->group + p->sub - 1) / p->sub;
    const int64_t sets = Hkv * p->subs;  // per row
    const int64_t threads = omp_get_max_threads();
    // Long contexts are read by chunk: a work item runs every head of its chunk, and its first
    // head's pass prefetches the whole slot rows (all kv heads: 3 x 128 contiguous bytes of K
    // and of V a slot for the default model) into L2 for the others. Item per (head, chunk), a
    // thread read 128 of every 384 bytes and the other heads' items came back for the rest
    // later. Where no row is that long (a decode batch or a verify of short contexts) an item
    // per head stays: with a chunk or two per row, whole chunks balance worse across the
    // threads. Measured with `python -m benchmarks.bench_decode_attention`; docs/cpu-kernels.md.
    p->lo = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B > 0 ? B : 1));
    p->own_from = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B > 0 ? B : 1));
    p->chunk0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B > 0 ? B : 1));
    // a window starts rows at different keys; the products need D a multiple of 16
    const int cascade = shared_min > 0 && window == 0 && D % 16 == 0 && D <= 256;
    if (!p->lo || !p->own_from || !p->chunk0 ||
        find_shared(p, table, ld_table, rows, seq_lens, cascade ? shared_min : 0) != 0) {
        attn_plan_free(p);
        return -1;
    }
    for (int64_t b = 0; b < B; b++) {
        p->lo[b] = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
        p->own_from[b] = p->lo[b];
        p->chunk0[b] = 0;
    }
    p->shared_item_start[0] = 0;
    for (int64_t s = 0; s < p->num_shared; s++) {
        const int64_t nr = p->shared_start[s + 1] - p->shared_start[s];
        const int64_t chunks = (p->shared_len[s] + KV_CHUNK - 1) / KV_CHUNK;
        p->most_shared = nr > p->most_shared ? nr : p->most_shared;
        p->shared_item_start[s + 1] = p->shared_item_start[s] + Hkv * chunks;
        for (int64_t i = p->shared_start[s]; i < p->shared_start[s + 1]; i++) {
            p->own_from[p->shared_rows[i]] = p->shared_len[s];
            p->chunk0[p->shared_rows[i]] = chunks;
        }
    }
    int64_t longest = 0;  // of the keys a row reads by itself
    for (int64_t b = 0; b < B; b++) {
        const int64_t keys = seq_lens[b] - p->own_from[b];
        longest = keys > longest ? keys : longest;
    }
    p->by_chunk = longest >= 2 * threads * KV_CHUNK;
    p->q_all = (float *)malloc(sizeof(float) * (size_t)(B * Hq * D));
    p->q16 = (int16_t *)malloc(sizeof(int16_t) * (size_t)(B * Hq * D));
    p->q16_scale = (float *)malloc(sizeof(float) * (size_t)(B * Hq));
    p->num_chunks = (int64_t *)malloc(sizeof(int64_t) * (size_t)B);
    p->item_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));
    p->group_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));
    p->group_chunks = (int64_t *)malloc(sizeof(int64_t) * (size_t)B);
    p->kv_item_start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!p->q_all || !p->q16 || !p->q16_scale || !p->num_chunks || !p->item_start ||
        !p->group_start || !p->group_chunks ||
        !p->kv_item_start) {
        attn_plan_free(p);
        return -1;
    }
    int64_t total_items = 0;
    for (int64_t b = 0; b < B; b++) {  // a row's partials: its shared chunks, then its own
        const int64_t keys = seq_lens[b] - p->own_from[b];
        const int64_t own = keys > 0 ? (keys + KV_CHUNK - 1) / KV_CHUNK : p->chunk0[b] ? 0 : 1;
        p->num_chunks[b] = p->chunk0[b] + own;
        p->item_start[b] = total_items;  // partials: (row, query head, chunk)
        total_items += Hq * p->num_chunks[b];
    }
    p->item_start[B] = total_items;
    const int64_t cap = p->by_chunk ? (B + threads - 1) / threads : 1;  // rows a group
    p->num_groups = group_rows(table, ld_table, rows, seq_lens, p->own_from, B, cap,
                               p->group_start);
    for (int64_t gi = 0; gi < p->num_groups; gi++) {
        int64_t most = 0;  // of the rows' own chunks
        for (int64_t b = p->group_start[gi]; b < p->group_start[gi + 1]; b++) {
            const int64_t own = p->num_chunks[b] - p->chunk0[b];
            most = own > most ? own : most;
        }
        p->group_chunks[gi] = most;
        // work: by chunk (group, chunk), else (row, head set, chunk)
        p->kv_item_start[gi] = p->total_kv_items;
        p->total_kv_items += (p->by_chunk ? 1 : sets) * most;
    }
    p->kv_item_start[p->num_groups] = p->total_kv_items;
    p->partials = (float *)malloc(sizeof(float) * (size_t)(total_items * (D + 2) + 1));
    if (!p->partials) {
        attn_plan_free(p);
        return -1;
    }
    return 0;
}

void attn_plan_free(attn_plan *p) {
    free(p->q_all); free(p->q16); free(p->q16_scale); free(p->num_chunks); free(p->item_start);
    free(p->group_start);
    free(p->group_chunks); free(p->kv_item_start); free(p->partials); free(p->lo);
    free(p->own_from); free(p->chunk0); free(p->shared_start); free(p->shared_rows);
    free(p->shared_len); free(p->shared_item_start);
    memset(p, 0, sizeof(*p));
}

size_t attn_thread_floats(const attn_plan *p) {
    const int64_t row = (p->Hq + 2 * p->Hkv) * p->D;
    size_t scores = (size_t)KV_CHUNK * (size_t)p->Hq;  // all heads
    if (p->num_shared) {
        const size_t shared = shared_floats(p->D, p->most_shared * p->group);
        scores = shared > scores ? shared : scores;
    }
    return (size_t)(row + 2 * p->D) + scores;
}

// RoPE on each row's q and k heads, k/v stored at its slot (`omp for`; ends at its barrier,
// so every new k/v is in the pool before any query reads it); q and k first normed as `qk`
// says, and not rotated where it has no table. tmp: attn_thread_floats.
void attn_rope_store_team(const attn_plan *p, const void *qkv, int qkv_bf16, const attn_qk *qk,
                          const int64_t *positions, void *k_pool, void *v_pool, int pool_kind,
                          float *k_scale, float *v_scale, const int64_t *out_slots, float *tmp) {
    const int64_t Hq = p->Hq, Hkv = p->Hkv, D = p->D, row = (Hq + 2 * Hkv) * D;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p->B; b++) {
        float *buf = tmp;
        load_row(qkv, qkv_bf16, b * row, (int)row, buf);
        if (qk->qk_norm == QK_NORM_FULL) {  // every q row at once, every k row at once
            rmsnorm_inplace(buf, Hq * D, qk->q_norm, qk->eps);
            rmsnorm_inplace(buf + Hq * D, Hkv * D, qk->k_norm, qk->eps);
        } else if (qk->qk_norm == QK_NORM_HEAD) {
            for (int64_t h = 0; h < Hq; h++) rmsnorm_inplace(buf + h * D, D, qk->q_norm, qk->eps);
            for (int64_t h = 0; h < Hkv; h++)
                rmsnorm_inplace(buf + (Hq + h) * D, D, qk->k_norm, qk->eps);
        }
        const int64_t slot = out_slots[b];
        float *q = p->q_all + b * Hq * D, *rot = buf + row, *scratch = rot + D;
        if (!qk->cos) {  // no RoPE: q as it is, k stored as it is
            memcpy(q, buf, sizeof(float) * (size_t)(Hq * D));
            for (int64_t h = 0; h < Hkv; h++) {
                store_kv_row(k_pool, k_scale, pool_kind, slot * Hkv + h, D, buf + (Hq + h) * D,
                             scratch);
                store_kv_row(v_pool, v_scale, pool_kind, slot * Hkv + h, D,
                             buf + (Hq + Hkv + h) * D, scratch);
            }
        } else {
            const float *c = qk->cos + positions[b] * D, *s = qk->sin + positions[b] * D;
            for (int64_t h = 0; h < Hq; h++) rope_head(buf + h * D, c, s, (int)D, q + h * D);
            for (int64_t h = 0; h < Hkv; h++) {
                rope_head(buf + (Hq + h) * D, c, s, (int)D, rot);
                store_kv_row(k_pool, k_scale, pool_kind, slot * Hkv + h, D, rot, scratch);
                store_kv_row(v_pool, v_scale, pool_kind, slot * Hkv + h, D,
                             buf + (Hq + Hkv + h) * D, scratch);
            }
        }
        if (pool_kind >= KV_I8) {  // the keys are rotated: so is the query, W S q / B
            const float inv = 1.0f / (float)(D & -D);
            for (int64_t h = 0; h < Hq; h++) {
                kv_rotate(q + h * D, D);
                for (int64_t d = 0; d < D; d++) q[h * D + d] *= inv;
            }
            if (pool_kind == KV_I8 && i8_kernel_fits(D))
                quantize_q16(q, Hq, D, p->q16 + b * Hq * D, p->q16_scale + b * Hq);
        }
    }
}

// Each query head over its row's keys [lo, seq_len) of table[rows[b]] (lo: the plan's window),
// in chunks of KV_CHUNK keys from lo (`omp for` items: request, kv head, set of up to 4 of its
// query heads, chunk), then each head's chunks merged into out [B, Hq * D].
void attn_attend_team(const attn_plan *p, const void *k_pool, const void *v_pool,
                      int pool_kind, const float *k_scale, const float *v_scale,
                      const int32_t *table, int64_t ld_table,
                      const int64_t *rows, const int64_t *seq_lens, float sm_scale,
                      float softcap, void *out, int out_bf16, float *tmp) {
    const int64_t Hq = p->Hq, Hkv = p->Hkv, D = p->D, row = (Hq + 2 * Hkv) * D;
    const int64_t group = p->group, sub = p->sub, subs = p->subs, sets = Hkv * subs;
    float *scores = tmp + row + 2 * D;
    // the shared items first: the largest
    const int64_t first_own = p->shared_item_start[p->num_shared];
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < first_own + p->total_kv_items; it++) {
        if (it < first_own) {  // (shared group, shared chunk, kv head)
            int64_t s = 0;
            while (it >= p->shared_item_start[s + 1]) s++;
            const int64_t within = it - p->shared_item_start[s];
            attend_shared(p, s, within % Hkv, within / Hkv, table, ld_table, rows, k_pool,
                          v_pool, pool_kind, k_scale, v_scale, sm_scale, softcap, scores);
            continue;
        }
        const int64_t item = it - first_own;
        int64_t gi = 0;
        while (item >= p->kv_item_start[gi + 1]) gi++;
        const int64_t within = item - p->kv_item_start[gi], nch = p->group_chunks[gi];
        // by chunk: every row and head set of the group's chunk `within`; else (a group is
        // one row) head set within / nch of chunk within % nch
        const int64_t c = p->by_chunk ? within : within % nch;
        const int64_t gs0 = p->by_chunk ? 0 : within / nch, gs1 = p->by_chunk ? sets : gs0 + 1;
        int32_t fetched = -1;  // the first slot of the chunk the last prefetch was for
        for (int64_t b = p->group_start[gi]; b < p->group_start[gi + 1]; b++) {
            const int64_t nchb = p->num_chunks[b], len = seq_lens[b], c0 = p->chunk0[b];
            if (c >= nchb - c0) continue;
            const int64_t t0 = p->own_from[b] + c * KV_CHUNK, cc = c0 + c;
            const int64_t t1 = t0 + KV_CHUNK < len ? t0 + KV_CHUNK : len;
            const int32_t *slots = table + rows[b] * ld_table;
            // the whole slot rows, unless the row before read this chunk's keys (prefetched)
            int prefetch = p->by_chunk && t1 > t0 && slots[t0] != fetched;
            if (prefetch) fetched = slots[t0];
            if (p->by_chunk && pool_kind == KV_I8 && i8_kernel_fits(D) && subs == 1) {
                I8_ALL_FNS[group - 1](p->q16 + b * Hq * D, p->q16_scale + b * Hq, slots, t0, t1,
                                      (const int8_t *)k_pool, (const int8_t *)v_pool, k_scale,
                                      v_scale, Hkv, D, sm_scale, softcap, scores,
                                      p->partials + (p->item_start[b] + cc) * (D + 2),
                                      nchb * (D + 2), prefetch);
                continue;
            }
            for (int64_t gs = gs0; gs < gs1; gs++) {
                const int64_t g = gs / subs, h0 = g * group + (gs % subs) * sub;
                const int64_t nh = h0 + sub <= (g + 1) * group ? sub : (g + 1) * group - h0;
                float *part = p->partials + (p->item_start[b] + h0 * nchb + cc) * (D + 2);
                const float *q = p->q_all + (b * Hq + h0) * D;
                attend_group((int)nh, q, p->q16 + (b * Hq + h0) * D, p->q16_scale + b * Hq + h0,
                             slots, t0, t1, k_pool, v_pool, pool_kind, k_scale, v_scale, Hkv, g,
                             D, sm_scale, softcap, scores, part, nchb * (D + 2), prefetch);
                prefetch = 0;
            }
        }
    }
    // merge each head's chunks
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < p->B * Hq; bh++) {
        const int64_t b = bh / Hq, h = bh % Hq, nch = p->num_chunks[b];
        const float *first = p->partials + (p->item_start[b] + h * nch) * (D + 2);
        float mx = -INFINITY;
        for (int64_t c = 0; c < nch; c++) mx = first[c * (D + 2)] > mx ? first[c * (D + 2)] : mx;
        float *merged = tmp;  // [D]
        memset(merged, 0, sizeof(float) * (size_t)D);
        float denom = 0.0f;
        for (int64_t c = 0; c < nch; c++) {
            const float *part = first + c * (D + 2);
            const float w = expf(part[0] - mx);
            denom += w * part[1];
            for (int64_t d = 0; d < D; d++) merged[d] += w * part[2 + d];
        }
        float inv = 1.0f / denom;
        if (pool_kind >= KV_I8) {  // sum p_i W S v_i = W S o: o = S W (W S o) / B
            kv_hadamard(merged, D);
            kv_flip_signs(merged, D);
            inv /= (float)(D & -D);
        }
        for (int64_t d = 0; d < D; d++) merged[d] *= inv;
        store_row(out, out_bf16, (b * Hq + h) * D, (int)D, merged);
    }
}

// qkv [B, (Hq + 2 Hkv) * D] (q heads, k heads, v heads); cos/sin fp32 [P, D] (NULL: no
// rotation); positions [B]; k_pool/v_pool [S, Hkv, D]; req_to_token int32 [R, ld_r2t];
// req_pool_indices, seq_lens, out_slots int64 [B]. Stores request b's k/v at slot
// out_slots[b], then its query heads attend to slots req_to_token[r, lo .. seq_lens[b]) (the
// new one included; lo = seq_len - window with a window shorter, else 0), scores soft-capped
// when softcap > 0. qk_norm (QK_NORM_*) with weights q_norm / k_norm, eps qk_eps: q and k
// normed before RoPE. out [B, Hq * D]. Returns 0, or -1 when scratch memory could not be
// allocated.
int decode_attention_rope(const void *qkv, int qkv_bf16, int64_t B, int64_t Hq, int64_t Hkv,
                          int64_t D, const float *cos_tab, const float *sin_tab,
                          const int64_t *positions, void *k_pool, void *v_pool, int pool_kind,
                          const int64_t *out_slots, const int32_t *req_to_token, int64_t ld_r2t,
                          const int64_t *req_pool_indices, const int64_t *seq_lens,
                          float sm_scale, void *out, int out_bf16, int64_t window,
                          float softcap, int qk_norm, const float *q_norm, const float *k_norm,
                          float qk_eps, float *k_scale, float *v_scale, int64_t shared_min) {
    if (pool_kind < 0 || pool_kind >= KV_KINDS || (pool_kind >= KV_I8 && (!k_scale || !v_scale)))
        return -2;
    attn_plan plan;
    if (attn_plan_init(&plan, B, Hq, Hkv, D, req_to_token, ld_r2t, req_pool_indices, seq_lens,
                       window, shared_min) != 0)
        return -1;
    const attn_qk qk = {cos_tab, sin_tab, qk_norm, q_norm, k_norm, qk_eps};
    const int threads = omp_get_max_threads();
    const size_t per_thread = attn_thread_floats(&plan);
    float *tmp = (float *)malloc(sizeof(float) * per_thread * (size_t)threads);
    if (!tmp) {
        attn_plan_free(&plan);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        float *mine = tmp + per_thread * (size_t)omp_get_thread_num();
        attn_rope_store_team(&plan, qkv, qkv_bf16, &qk, positions, k_pool, v_pool, pool_kind,
                             k_scale, v_scale, out_slots, mine);
        attn_attend_team(&plan, k_pool, v_pool, pool_kind, k_scale, v_scale, req_to_token, ld_r2t,
                         req_pool_indices, seq_lens, sm_scale, softcap, out, out_bf16, mine);
    }
    free(tmp);
    attn_plan_free(&plan);
    return 0;
}
