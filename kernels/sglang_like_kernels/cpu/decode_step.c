// A decode (or verify) step of a Llama-family model, every layer, in one call and one OpenMP
// team: the per-op path (native_decode.py) makes eight calls a layer (240 a step of the
// default model), each a Python -> ctypes crossing, tensor allocations and an OpenMP
// fork/join; at one row those cost about as much as the matmuls. Here a layer is phases of
// one parallel region separated by the team's barriers:
//
//   norm + quantize rows | qkv | RoPE + k/v store | attention + merge | quantize rows | o |
//   add + norm + quantize | gate_up | silu * up + quantize | down | add (+ next norm)
//
// Every phase is the per-op path's own code (ops.h), so the two paths give the same bits.
// Linears are x16-packed int4 (q4_rows.c) without bias; activations and the residual stream
// float32; the KV pool float32 or bfloat16.

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

#define XQK 32

// per-layer addresses, [L][DS_PTRS] int64
enum { P_QKV, P_O, P_GATE_UP, P_DOWN, P_NORM_IN, P_NORM_POST, P_K, P_V, DS_PTRS };

typedef struct {
    int8_t *q;  // [T, Kmax]
    float *e;   // [T, Kmax / 32]
    float *S;
} act_rows;

// row t of a [T, K] activation (q4_x16_matmul_team's layout: q row stride K, e/S K / 32)
static inline void quantize_row(const act_rows *a, const float *x, int64_t K, int64_t t) {
    q4_1_quantize_row_q8(x, (int)K, a->q + t * K, a->e + t * (K / XQK), a->S + t * (K / XQK));
}

// x [T, H] float32, the embedded rows in, the residual stream after the last layer out.
// ptrs [L, DS_PTRS]: x16 weights of qkv [(Hq + 2 Hkv) D, H], o [H, Hq D], gate_up [2I, H],
// down [H, I]; fp32 norm weights [H]; k/v pools [S, Hkv, D]. Attention: query row t reads
// the first seq_lens[t] slots of table[rows[t]] (ld_table int32 per row); its new k/v go to
// out_slots[t] at positions[t]. aux_slot [L]: -1, or where the residual entering the layer
// goes in features [T, n_aux * H] (EAGLE-3's capture). Returns 0; -1 when scratch memory
// could not be allocated; -2 for shapes the kernels do not take.
int decode_step_x16(int64_t L, int64_t T, int64_t H, int64_t Hq, int64_t Hkv, int64_t D,
                    int64_t I, float *x, const int64_t *ptrs, float eps, int pool_bf16,
                    const float *cos_tab, const float *sin_tab, const int64_t *positions,
                    const int64_t *out_slots, const int32_t *table, int64_t ld_table,
                    const int64_t *rows, const int64_t *seq_lens, float sm_scale,
                    const int64_t *aux_slot, int64_t n_aux, float *features) {
    const int64_t nqkv = (Hq + 2 * Hkv) * D, hqd = Hq * D;
    if (T <= 0 || L <= 0 || H % XQK || hqd % XQK || I % XQK || nqkv % 16 || H % 16 ||
        (2 * I) % 16 || Hkv <= 0 || Hq % Hkv || D % 8)
        return -2;
    attn_plan plan;
    if (attn_plan_init(&plan, T, Hq, Hkv, D, table, ld_table, rows, seq_lens) != 0) return -1;
    int64_t kmax = H > hqd ? H : hqd;
    kmax = kmax > I ? kmax : I;
    const int threads = omp_get_max_threads();
    size_t per_thread = attn_thread_floats(&plan);
    per_thread = per_thread > (size_t)H ? per_thread : (size_t)H;
    // h [T, H] | qkv [T, nqkv] | att [T, hqd] | proj [T, H] | gu [T, 2I] | e, S [T, kmax/32]
    // | per-thread scratch
    const size_t shared = (size_t)(T * (2 * H + nqkv + hqd + 2 * I + 2 * (kmax / XQK)));
    float *fl = (float *)malloc(sizeof(float) * (shared + per_thread * (size_t)threads));
    int8_t *q = (int8_t *)malloc((size_t)(T * kmax));
    if (!fl || !q) {
        free(fl); free(q);
        attn_plan_free(&plan);
        return -1;
    }
    float *h = fl, *qkv = h + T * H, *att = qkv + T * nqkv, *proj = att + T * hqd;
    float *gu = proj + T * H;
    act_rows a = {q, gu + T * 2 * I, gu + T * 2 * I + T * (kmax / XQK)};
    float *thread_base = a.S + T * (kmax / XQK);

#pragma omp parallel num_threads(threads)
    {
        float *tmp = thread_base + per_thread * (size_t)omp_get_thread_num();
        for (int64_t l = 0; l < L; l++) {
            const int64_t *p = ptrs + l * DS_PTRS;
            const uint8_t *w_qkv = (const uint8_t *)p[P_QKV], *w_o = (const uint8_t *)p[P_O];
            const uint8_t *w_gu = (const uint8_t *)p[P_GATE_UP];
            const uint8_t *w_down = (const uint8_t *)p[P_DOWN];
            void *k_pool = (void *)p[P_K], *v_pool = (void *)p[P_V];
            if (aux_slot[l] >= 0) {  // read-only on x, which no phase before the next barrier writes
#pragma omp for schedule(static) nowait
                for (int64_t t = 0; t < T; t++)
                    memcpy(features + (t * n_aux + aux_slot[l]) * H, x + t * H,
                           sizeof(float) * (size_t)H);
            }
            if (l == 0) {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++) {
                    add_rmsnorm_row(x + t * H, NULL, 0, t, NULL, (const float *)p[P_NORM_IN], H,
                                    eps, h, 0, tmp);
                    quantize_row(&a, h + t * H, H, t);
                }
            }
            q4_x16_matmul_team(w_qkv, nqkv, H, a.q, a.e, a.S, T, qkv, nqkv);
            attn_rope_store_team(&plan, qkv, 0, cos_tab, sin_tab, positions, k_pool, v_pool,
                                 pool_bf16, out_slots, tmp);
            attn_attend_team(&plan, k_pool, v_pool, pool_bf16, table, ld_table, rows, seq_lens,
                             sm_scale, att, 0, tmp);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) quantize_row(&a, att + t * hqd, hqd, t);
            q4_x16_matmul_team(w_o, H, hqd, a.q, a.e, a.S, T, proj, H);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                add_rmsnorm_row(x + t * H, proj, 0, t, x, (const float *)p[P_NORM_POST], H, eps,
                                h, 0, tmp);
                quantize_row(&a, h + t * H, H, t);
            }
            q4_x16_matmul_team(w_gu, 2 * I, H, a.q, a.e, a.S, T, gu, 2 * I);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                silu_mul_row(gu + t * 2 * I, I);
                quantize_row(&a, gu + t * 2 * I, I, t);
            }
            q4_x16_matmul_team(w_down, H, I, a.q, a.e, a.S, T, proj, H);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                if (l + 1 < L) {
                    add_rmsnorm_row(x + t * H, proj, 0, t, x,
                                    (const float *)ptrs[(l + 1) * DS_PTRS + P_NORM_IN], H, eps, h,
                                    0, tmp);
                    quantize_row(&a, h + t * H, H, t);
                } else {
                    float *xr = x + t * H;
                    const float *dr = proj + t * H;
                    for (int64_t i = 0; i < H; i++) xr[i] = xr[i] + dr[i];
                }
            }
        }
    }
    free(fl);
    free(q);
    attn_plan_free(&plan);
    return 0;
}
