// The small ops of a decode step, fused so that a layer is a few calls instead of sixty:
//   add_rmsnorm           x_out = x + delta; out = rmsnorm(x_out) * w          (fp32 math)
//   residual_norm         the same with a sub-layer output norm and a residual scale:
//                         x_out = x + scale * rmsnorm(delta) * w_sub; out = rmsnorm(x_out) * w
//                         (each part optional: the norm layouts of layers/decoder.py)
//   silu_mul              out = silu(gate) * up over a fused [T, 2I] gate_up
//   act_mul               the same for any of the gated activations (silu, gelu's tanh form)
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

// One row of residual_norm (below), `row` a scratch of H floats. When delta is given:
// sub = delta_row, normed (rmsnorm(sub) * w_sub) when w_sub is given (a "sandwich" / "post"
// layer's output norm), times `scale` when it is not 1 (Granite); x_out_row = x_row + sub.
// Then out_row = rmsnorm(x_out_row) * w, or x_out_row itself where w is NULL (a "post" layer's
// sub-layer reads the residual unnormed); out may be NULL (the last layer's add). The fused
// decode step (decode_step.c) calls it too, so both paths give the same bits.
void residual_norm_row(const float *xr, const void *delta, int delta_bf16, int64_t t,
                       const float *w_sub, float sub_eps, float scale, float *x_out,
                       const float *w, int64_t H, float eps, void *out, int out_bf16,
                       float *row) {
    if (delta) {
        load_row(delta, delta_bf16, t * H, (int)H, row);
        if (w_sub) rmsnorm_inplace(row, H, w_sub, sub_eps);
        if (scale != 1.0f)
            for (int64_t i = 0; i < H; i++) row[i] *= scale;
        for (int64_t i = 0; i < H; i++) row[i] += xr[i];
    } else {
        memcpy(row, xr, sizeof(float) * (size_t)H);
    }
    if (delta && x_out) memcpy(x_out + t * H, row, sizeof(float) * (size_t)H);
    if (w) rmsnorm_inplace(row, H, w, eps);
    if (out) store_row(out, out_bf16, t * H, (int)H, row);
}

// One row of add_rmsnorm (below): x_out_row = x_row + delta_row (when delta is given),
// out_row = rmsnorm(x_out_row) * w; residual_norm_row's Llama case.
void add_rmsnorm_row(const float *xr, const void *delta, int delta_bf16, int64_t t,
                     float *x_out, const float *w, int64_t H, float eps, void *out,
                     int out_bf16, float *row) {
    residual_norm_row(xr, delta, delta_bf16, t, NULL, 0.0f, 1.0f, x_out, w, H, eps, out,
                      out_bf16, row);
}

// x, x_out fp32 [T, H]; delta [T, H] fp32 or bf16 or NULL; w_sub (eps sub_eps), w: fp32 [H]
// or NULL; out [T, H] in bf16 or fp32, or NULL. See residual_norm_row.
void residual_norm(const float *x, const void *delta, int delta_bf16, const float *w_sub,
                   float sub_eps, float scale, float *x_out, const float *w, int64_t T,
                   int64_t H, float eps, void *out, int out_bf16) {
#pragma omp parallel for schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) {
        float *row = (float *)malloc(sizeof(float) * (size_t)H);
        residual_norm_row(x + t * H, delta, delta_bf16, t, w_sub, sub_eps, scale, x_out, w, H,
                          eps, out, out_bf16, row);
        free(row);
    }
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

// in place over a fused row [2I]: row[i] = gelu(row[i]) * row[I + i], gelu in its tanh form
// as torch's gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
void gelu_tanh_mul_row(float *row, int64_t I) {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const __m256 beta = _mm256_set1_ps(0.7978845608028654f), kappa = _mm256_set1_ps(0.044715f);
    int64_t i = 0;
    for (;; i += 8) {
        // the tail through the same lanes (padded), so a value's result is where-independent
        float gate[8] = {0}, up[8] = {0};
        const int64_t n = I - i < 8 ? I - i : 8;
        if (n <= 0) break;
        const float *g_src = row + i, *u_src = row + I + i;
        if (n < 8) {
            memcpy(gate, g_src, sizeof(float) * (size_t)n);
            memcpy(up, u_src, sizeof(float) * (size_t)n);
            g_src = gate;
            u_src = up;
        }
        const __m256 g = _mm256_loadu_ps(g_src);
        const __m256 inner = _mm256_mul_ps(beta, _mm256_add_ps(g, _mm256_mul_ps(kappa,
                                                   _mm256_mul_ps(g, _mm256_mul_ps(g, g)))));
        const __m256 act = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, tanh256(inner)));
        const __m256 y = _mm256_mul_ps(act, _mm256_loadu_ps(u_src));
        if (n == 8) {
            _mm256_storeu_ps(row + i, y);
        } else {
            float res[8];
            _mm256_storeu_ps(res, y);
            memcpy(row + i, res, sizeof(float) * (size_t)n);
        }
    }
}

void act_mul_row(int act, float *row, int64_t I) {
    if (act == ACT_GELU_TANH)
        gelu_tanh_mul_row(row, I);
    else
        silu_mul_row(row, I);
}

// gate_up [T, 2I] (gate then up), out [T, I]; act: ACT_SILU or ACT_GELU_TANH (ops.h)
void act_mul(const void *gate_up, int in_bf16, int64_t T, int64_t I, int act, void *out,
             int out_bf16) {
#pragma omp parallel for schedule(static) if (T * I >= 16384)
    for (int64_t t = 0; t < T; t++) {
        float *row = (float *)malloc(sizeof(float) * (size_t)(2 * I));
        load_row(gate_up, in_bf16, t * 2 * I, (int)(2 * I), row);
        act_mul_row(act, row, I);
        store_row(out, out_bf16, t * I, (int)I, row);
        free(row);
    }
}

void silu_mul(const void *gate_up, int in_bf16, int64_t T, int64_t I, void *out, int out_bf16) {
    act_mul(gate_up, in_bf16, T, I, ACT_SILU, out, out_bf16);
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
