// Small SIMD helpers shared by the CPU kernels' sources (static inline: each source gets its
// own copy). bf16 rounding is round-to-nearest-even, as torch's `.to(bfloat16)`.
#ifndef SGLANG_LIKE_CPU_SIMD_H
#define SGLANG_LIKE_CPU_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// e^x for 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error under 2e-7 over the float range), 2^n put into the exponent bits
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2, high part
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);      // and the rest
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// tanh of 8 lanes as sign(x) (1 - 2 / (e^2|x| + 1)): exact to about 1e-7 absolute (what the
// soft-caps and gelu's tanh need: a float's rounding at the result's scale), +-1 where
// e^2|x| saturates (exp256 clamps, so no inf / inf)
static inline __m256 tanh256(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 e = exp256(_mm256_add_ps(ax, ax));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_or_ps(t, _mm256_and_ps(x, sign));
}

// in place: v[i] = cap * tanh(v[i] / cap) (attention scores' soft-cap); the tail through the
// same 8-lane code, so a value's result does not depend on where it sits in v
static inline void softcap_row(float *v, int64_t n, float cap) {
    const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.0f / cap);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(v + i, _mm256_mul_ps(c, tanh256(_mm256_mul_ps(_mm256_loadu_ps(v + i), inv))));
    if (i < n) {
        float tail[8] = {0};
        memcpy(tail, v + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(tail, _mm256_mul_ps(c, tanh256(_mm256_mul_ps(_mm256_loadu_ps(tail), inv))));
        memcpy(v + i, tail, sizeof(float) * (size_t)(n - i));
    }
}

// in place: x [n] = rmsnorm(x) * w, the float steps of add_rmsnorm_row (ops.c)
static inline void rmsnorm_inplace(float *x, int64_t n, const float *w, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float inv = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) x[i] = (x[i] * inv) * w[i];
}

// in place: v[i] = exp(v[i] - shift); returns the sum
static inline float exp_shift_sum(float *v, int64_t n, float shift) {
    const __m256 sh = _mm256_set1_ps(shift);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(v + i), sh));
        _mm256_storeu_ps(v + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float tail[8] = {0};
    float rest[8];
    const int64_t left = n - i;
    for (int64_t j = 0; j < 8; j++) rest[j] = j < left ? v[i + j] - shift : -INFINITY;
    const __m256 e = exp256(_mm256_loadu_ps(rest));
    _mm256_storeu_ps(tail, e);
    float sum = 0.0f;
    for (int64_t j = 0; j < left; j++) {
        v[i + j] = tail[j];
        sum += tail[j];
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s) + sum;
}

static inline void load_row(const void *src, int bf16, int64_t off, int n, float *dst) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + off;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, (const float *)src + off, sizeof(float) * (size_t)n);
    }
}

static inline void store_row(void *dst, int bf16, int64_t off, int n, const float *src) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst + off;
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)dst + off, src, sizeof(float) * (size_t)n);
    }
}

// One activation row [K] -> two int8 parts q1, q2 [K] per block of 32 (x ~ e * (254 q1 + q2),
// e the second part's scale; about 15 bits) and, where corr is not NULL,
// corr = 128 * (254 sum(q1) + sum(q2)) per block: the LM head's activations (q8_rows.c, and
// amx_q8x16.c, whose tiles must see the same bytes)
static inline void quantize_row_2x8(const float *x, int K, int8_t *q1, int8_t *q2, float *e,
                                    int32_t *corr) {
    for (int b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float e1 = amax / 127.0f, inv1 = e1 > 0.0f ? 1.0f / e1 : 0.0f;
        const float inv2 = inv1 * 254.0f;
        int32_t s1 = 0, s2 = 0;
        for (int j = 0; j < 32; j++) {
            const float a = nearbyintf(xb[j] * inv1);
            float r = nearbyintf((xb[j] - a * e1) * inv2);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            q1[b * 32 + j] = (int8_t)a;
            q2[b * 32 + j] = (int8_t)r;
            s1 += (int32_t)a;
            s2 += (int32_t)r;
        }
        e[b] = e1 / 254.0f;
        if (corr) corr[b] = 128 * (254 * s1 + s2);
    }
}

#endif
