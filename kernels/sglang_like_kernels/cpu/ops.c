// The small ops of a decode step, fused so that a layer is a few calls instead of sixty:
//   add_rmsnorm           x_out = x + delta; out = rmsnorm(x_out) * w          (fp32 math)
//   silu_mul              out = silu(gate) * up over a fused [T, 2I] gate_up
// (decode attention: attention.c). Activations come and go as fp32 or bf16 (the int kernels'
// dtype), chosen per call.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "simd.h"

// One row of add_rmsnorm (below), `row` a scratch of H floats: x_out_row = x_row + delta_row
// (when delta is given), out_row = rmsnorm(x_out_row) * w. The fused decode step
// (decode_step.c) calls it too, so both paths give the same bits.
void add_rmsnorm_row(const float *xr, const void *delta, int delta_bf16, int64_t t,
                     float *x_out, const float *w, int64_t H, float eps, void *out,
                     int out_bf16, float *row) {
    if (delta) {
        load_row(delta, delta_bf16, t * H, (int)H, row);
        for (int64_t i = 0; i < H; i++) row[i] += xr[i];
    } else {
        memcpy(row, xr, sizeof(float) * (size_t)H);
    }
    double ss = 0.0;
    for (int64_t i = 0; i < H; i++) ss += (double)row[i] * row[i];
    if (delta && x_out) memcpy(x_out + t * H, row, sizeof(float) * (size_t)H);
    const float inv = 1.0f / sqrtf((float)(ss / (double)H) + eps);
    for (int64_t i = 0; i < H; i++) row[i] = (row[i] * inv) * w[i];
    store_row(out, out_bf16, t * H, (int)H, row);
}

// x, x_out fp32 [T, H], delta [T, H] fp32 or bf16 (`delta_bf16`: a bf16 matmul's output as it
// comes); delta and x_out may be NULL: no add, norm of x. w fp32 [H]; out [T, H] in bf16 or
// fp32. Same formula as the model's RMSNorm: x * rsqrt(mean(x^2) + eps) * w.
void add_rmsnorm(const float *x, const void *delta, int delta_bf16, float *x_out,
                 const float *w, int64_t T, int64_t H, float eps, void *out, int out_bf16) {
#pragma omp parallel for schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) {
        float *row = (float *)malloc(sizeof(float) * (size_t)H);
        add_rmsnorm_row(x + t * H, delta, delta_bf16, t, x_out, w, H, eps, out, out_bf16, row);
        free(row);
    }
}

// in place over a fused row [2I]: row[i] = silu(row[i]) * row[I + i] for i < I
void silu_mul_row(float *row, int64_t I) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(row + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, g))));
        _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(row + I + i)));
    }
    for (; i < I; i++) {
        const float g = row[i];
        row[i] = g / (1.0f + expf(-g)) * row[I + i];
    }
}

// gate_up [T, 2I] (gate then up), out [T, I]
void silu_mul(const void *gate_up, int in_bf16, int64_t T, int64_t I, void *out, int out_bf16) {
#pragma omp parallel for schedule(static) if (T * I >= 16384)
    for (int64_t t = 0; t < T; t++) {
        float *row = (float *)malloc(sizeof(float) * (size_t)(2 * I));
        load_row(gate_up, in_bf16, t * 2 * I, (int)(2 * I), row);
        silu_mul_row(row, I);
        store_row(out, out_bf16, t * I, (int)I, row);
        free(row);
    }
}

// The index of the first maximum of a float row, as torch.argmax: a NaN counts as the
// maximum (the first NaN's index), equal values (-0.0 and 0.0 too) keep the first. Two passes
// (the maximum, then its first index), the second out of cache.
static int64_t argmax_row(const float *x, int64_t n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vmax = _mm256_max_ps(vmax, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    float best = lanes[0];
    for (int j = 1; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
    int has_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t j = i; j < n; j++) {
        if (isnan(x[j])) has_nan = 1;
        else if (x[j] > best) best = x[j];
    }
    if (has_nan) {
        for (int64_t j = 0; j < n; j++)
            if (isnan(x[j])) return j;
    }
    const __m256 b = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
        if (m) return i + __builtin_ctz((unsigned)m);
    }
    for (; i < n; i++)
        if (x[i] == best) return i;
    return 0;  // n == 0
}

// out[r] = argmax of row r of x [R, N] (row stride ldx floats), rows split over the team
void argmax_rows(const float *x, int64_t ldx, int64_t R, int64_t N, int64_t *out) {
#pragma omp parallel for schedule(static) if (R >= 4)
    for (int64_t r = 0; r < R; r++) out[r] = argmax_row(x + r * ldx, N);
}
