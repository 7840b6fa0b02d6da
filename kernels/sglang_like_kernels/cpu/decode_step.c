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
// Linears are x16-packed int4 (q4_rows.c), or (with `runs`) GGUF types packed for kquants.c,
// a linear being up to DS_RUNS runs of output rows of one kind each; no bias; activations and
// the residual stream float32; the KV pool float32 or bfloat16.

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

#define XQK 32

// per-layer addresses, [L][DS_PTRS] int64
enum { P_QKV, P_O, P_GATE_UP, P_DOWN, P_NORM_IN, P_NORM_POST, P_K, P_V, DS_PTRS };

// runs [L][4 linears][DS_RUNS][3]: (kind, weight address, output rows); kind -1 is x16 Q4_1,
// rows 0 ends a linear's runs
#define DS_RUNS 4

typedef struct {
    int8_t *q;    // [T, Kmax]
    float *e;     // [T, Kmax / 32]
    float *S;
    int32_t *qs;  // [T, Kmax / 16], NULL when every linear is x16
} act_rows;

// row t of a [T, K] activation (q4_x16_matmul_team's layout: q row stride K, e/S K / 32;
// kq_matmul_team's qs K / 16)
static inline void quantize_row(const act_rows *a, const float *x, int64_t K, int64_t t) {
    q4_1_quantize_row_q8(x, (int)K, a->q + t * K, a->e + t * (K / XQK), a->S + t * (K / XQK));
    if (a->qs) kq_row_sums16(a->q + t * K, K, a->qs + t * (K / 16));
}

// y [T, N] = quantized rows @ W.T for linear `which` of a layer: its x16 weight, or its runs
static void linear_team(const int64_t *runs, const uint8_t *x16, int64_t N, int64_t K,
                        const act_rows *a, int64_t T, float *y) {
    if (!runs) {
        q4_x16_matmul_team(x16, N, K, a->q, a->e, a->S, T, y, N);
        return;
    }
    int64_t col = 0;
    for (int r = 0; r < DS_RUNS && runs[3 * r + 2] > 0; r++) {
        const int64_t kind = runs[3 * r], rows = runs[3 * r + 2];
        const uint8_t *w = (const uint8_t *)runs[3 * r + 1];
        if (kind < 0)
            q4_x16_matmul_team(w, rows, K, a->q, a->e, a->S, T, y + col, N);
        else
            kq_matmul_team((int)kind, w, rows, K, a->q, a->e, a->S, a->qs, T, y + col, N);
        col += rows;
    }
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
                    const int64_t *aux_slot, int64_t n_aux, float *features,
                    const int64_t *runs) {
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
    int32_t *qs = runs ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(T * (kmax / 16))) : NULL;
    if (!fl || !q || (runs && !qs)) {
        free(fl); free(q); free(qs);
        attn_plan_free(&plan);
        return -1;
    }
    float *h = fl, *qkv = h + T * H, *att = qkv + T * nqkv, *proj = att + T * hqd;
    float *gu = proj + T * H;
    act_rows a = {q, gu + T * 2 * I, gu + T * 2 * I + T * (kmax / XQK), qs};
    float *thread_base = a.S + T * (kmax / XQK);

#pragma omp parallel num_threads(threads)
    {
        float *tmp = thread_base + per_thread * (size_t)omp_get_thread_num();
        for (int64_t l = 0; l < L; l++) {
            const int64_t *p = ptrs + l * DS_PTRS;
            const int64_t *lr = runs ? runs + l * 4 * DS_RUNS * 3 : NULL;
#define LINEAR_RUNS(i) (lr ? lr + (i) * DS_RUNS * 3 : NULL)
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
            linear_team(LINEAR_RUNS(0), w_qkv, nqkv, H, &a, T, qkv);
            attn_rope_store_team(&plan, qkv, 0, cos_tab, sin_tab, positions, k_pool, v_pool,
                                 pool_bf16, out_slots, tmp);
            attn_attend_team(&plan, k_pool, v_pool, pool_bf16, table, ld_table, rows, seq_lens,
                             sm_scale, att, 0, tmp);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) quantize_row(&a, att + t * hqd, hqd, t);
            linear_team(LINEAR_RUNS(1), w_o, H, hqd, &a, T, proj);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                add_rmsnorm_row(x + t * H, proj, 0, t, x, (const float *)p[P_NORM_POST], H, eps,
                                h, 0, tmp);
                quantize_row(&a, h + t * H, H, t);
            }
            linear_team(LINEAR_RUNS(2), w_gu, 2 * I, H, &a, T, gu);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                silu_mul_row(gu + t * 2 * I, I);
                quantize_row(&a, gu + t * 2 * I, I, t);
            }
            linear_team(LINEAR_RUNS(3), w_down, H, I, &a, T, proj);
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
#undef LINEAR_RUNS
    free(fl);
    free(q);
    free(qs);
    attn_plan_free(&plan);
    return 0;
}
