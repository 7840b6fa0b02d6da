// A decode (or verify) step of a Llama-family model, every layer, in one call and one OpenMP
// team: the per-op path (native_decode.py) makes eight calls a layer (240 a step of the
// default model), each a Python -> ctypes crossing, tensor allocations and an OpenMP
// fork/join; at one row those cost about as much as the matmuls. Here a layer is phases of
// one parallel region separated by the team's barriers:
//
//   norm + quantize rows | qkv | (q/k norm +) RoPE + k/v store | attention + merge |
//   quantize rows | o | (out norm +) add + norm + quantize | gate_up | act * up + quantize |
//   down | (out norm +) add (+ next norm)
//
// Each layer as its description says (layers/decoder.py): the norms present in its layout
// (an address 0 where the layout has none), its RoPE table (global, local or none), q/k
// norm, sliding window, score soft-cap, residual scale, activation, scale of the scores.
// Every phase is the per-op path's own code (ops.h), so the two paths give the same bits.
// Linears are x16-packed int4 (q4_rows.c), or (with `runs`) GGUF types packed for kquants.c,
// a linear being up to DS_RUNS runs of output rows of one kind each; no bias; activations and
// the residual stream float32; the KV pool float32, bfloat16 or 8-bit codes with scales
// (ops.h's KV_* kinds; kv_scales [L][2] their addresses).

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

#define XQK 32

// per-layer addresses, [L][DS_PTRS] int64: P_NORM_IN / P_NORM_POST are the norms before
// attention and before the MLP (0 for "post"), P_ATTN_OUT / P_MLP_OUT those on their outputs
// (0 for "pre"), P_Q_NORM / P_K_NORM the q/k norms (0 without), P_QKV_BIAS / P_O_BIAS float32
// biases of qkv and o (0 without: Qwen2 biases q/k/v, Llama's attention_bias o too)
enum { P_QKV, P_O, P_GATE_UP, P_DOWN, P_NORM_IN, P_NORM_POST, P_K, P_V, P_ATTN_OUT, P_MLP_OUT,
       P_Q_NORM, P_K_NORM, P_QKV_BIAS, P_O_BIAS, DS_PTRS };

// LoRA deltas (layers/lora.py's math): for each row t on an adapter s (lora_rows[t] >= 0) whose
// entry for this layer's linear `which` is (A [R, K], Bt [R, N], R, cols [R][2]) (lora_tab
// [S][L][4][4]; A 0: the adapter leaves the linear alone), y_t += B @ (A @ x_t), float32, in
// two phases: u = A x per row, then y over blocks of 16 output columns, each
// column summing its ranks in order. Bt is B transposed, so a rank's 16 columns are one
// vector; cols[r] = [c0, c1) holds rank r's nonzero columns (a fused q/k/v or gate/up B is
// block diagonal: most of it is zeros, skipped, which adds nothing). Each sum runs in a fixed
// order whatever the batch: a row's delta does not depend on the rows beside it.
typedef struct {
    const int64_t *rows;  // [T]: adapter index or -1
    const int64_t *tab;   // [S][L][4][4]
    int64_t L, rmax;
    float *u;  // [T, rmax] scratch
} lora_rows_t;

#define LORA_FIELDS 4
#define LORA_COLS 16
#define KQ_GROUP_ROWS 16  // output columns of one linear work item (x16, kquants groups)

// phase 1 for row t (x_t [K], K a multiple of 16): u[t, r] = A[r] . x_t, four ranks at a time
// (each 16 columns of x_t loaded once for the four), each rank's 16 lane sums then added in
// lane order. Each loop that produces a linear's input row calls it for that row, so the
// phase costs no barrier of its own.
static void lora_u_row(const lora_rows_t *lo, int64_t l, int which, const float *xt, int64_t K,
                       int64_t t) {
    const int64_t s = lo->rows[t];
    if (s < 0) return;
    const int64_t *e = lo->tab + ((s * lo->L + l) * 4 + which) * LORA_FIELDS;
    if (!e[0]) return;
    const int64_t R = e[2];
    const float *A = (const float *)e[0];
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
        const int nr = (int)(R - r0 < 4 ? R - r0 : 4);
        float acc[4][16] = {{0}};
        for (int64_t k0 = 0; k0 < K; k0 += 16)
            for (int i = 0; i < nr; i++) {
                const float *a = A + (r0 + i) * K + k0;
#pragma omp simd
                for (int j = 0; j < 16; j++) acc[i][j] += a[j] * xt[k0 + j];
            }
        for (int i = 0; i < nr; i++) {
            float u = 0.0f;
            for (int j = 0; j < 16; j++) u += acc[i][j];
            lo->u[t * lo->rmax + r0 + i] = u;
        }
    }
}

// phase 2 for output columns [n0, n0 + 16) (N a multiple of 16): y_t += B u_t there, for
// every row on an adapter (u from lora_u_row, a barrier before); called by the work item that
// made those columns
static void lora_cols(const lora_rows_t *lo, int64_t l, int which, float *y, int64_t N,
                      int64_t T, int64_t n0) {
    const int64_t rmax = lo->rmax;
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = lo->rows[t];
        if (s < 0) continue;
        const int64_t *e = lo->tab + ((s * lo->L + l) * 4 + which) * LORA_FIELDS;
        if (!e[0]) continue;
        const int64_t R = e[2], *cols = (const int64_t *)e[3];
        const float *bt = (const float *)e[1], *ut = lo->u + t * rmax;
        float acc[LORA_COLS] = {0};
        for (int64_t r = 0; r < R; r++) {
            if (cols[2 * r] >= n0 + LORA_COLS || cols[2 * r + 1] <= n0) continue;
            const float ur = ut[r], *b = bt + r * N + n0;
#pragma omp simd
            for (int j = 0; j < LORA_COLS; j++) acc[j] += b[j] * ur;
        }
        float *yt = y + t * N + n0;
#pragma omp simd
        for (int j = 0; j < LORA_COLS; j++) yt[j] += acc[j];
    }
}

// per-layer settings: cfg [L][DS_CFG] int64 and fcfg [L][DS_FCFG] float
enum { C_WINDOW, C_ROPE, C_QK_NORM, C_ACT, DS_CFG };  // window (0: none), ROPE_*, QK_NORM_*, ACT_*
enum { F_SM_SCALE, F_SOFTCAP, F_RESIDUAL_SCALE, DS_FCFG };  // softcap 0: none
enum { ROPE_GLOBAL = 0, ROPE_LOCAL = 1, ROPE_NONE = 2 };
#define DS_PLANS 4  // distinct sliding windows of a model's layers (and full attention)

// runs [L][4 linears][DS_RUNS][3]: (kind, weight address, output rows); kind -1 is x16 Q4_1,
// rows 0 ends a linear's runs (DS_RUNS: ops.h)

// row t of a [T, K] activation (q4_x16_matmul_team's layout: q row stride K, e/S K / 32;
// kq_matmul_team's qs K / 16)
void quantize_act_row(const act_rows *a, const float *x, int64_t K, int64_t t) {
    q4_1_quantize_row_q8(x, (int)K, a->q + t * K, a->e + t * (K / XQK), a->S + t * (K / XQK));
    if (a->qs) kq_row_sums16(a->q + t * K, K, a->qs + t * (K / 16));
}

// y [T, N] = quantized rows @ W.T for linear `which` of layer l: its x16 weight, or its runs,
// in passes of rows that stay in L2 (kq_pass_rows); then + bias [N] (NULL: none; one float32
// add per output, as the per-op path adds it after its matmul) and each row's LoRA delta (lo
// NULL: none), by the thread that wrote the group (the same static schedule: no barrier
// between). A row's sums are the same whatever pass holds it.
static void linear_team(const int64_t *runs, const uint8_t *x16, int64_t N, int64_t K,
                        const act_rows *a, int64_t T, float *y, const float *bias,
                        const lora_rows_t *lo, int64_t l, int which) {
    const int64_t whole[3] = {-1, (int64_t)x16, N};  // an x16 linear: one run
    const int64_t *rl = runs ? runs : whole;
    const int64_t pass = kq_pass_rows(K), nb = K / XQK;
    for (int64_t m0 = 0; m0 < T; m0 += pass) {
        const int64_t n = T - m0 < pass ? T - m0 : pass;
        const int8_t *q = a->q + m0 * K;
        const float *e = a->e + m0 * nb, *S = a->S + m0 * nb;
        const int32_t *qs = a->qs ? a->qs + m0 * (K / 16) : NULL;
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < N / KQ_GROUP_ROWS; g++) {
            int64_t g0 = 0;  // the run holding group g starts at group g0
            int r = 0;
            for (; g >= g0 + rl[3 * r + 2] / KQ_GROUP_ROWS; r++)
                g0 += rl[3 * r + 2] / KQ_GROUP_ROWS;
            kq_any_group((int)rl[3 * r], (const uint8_t *)rl[3 * r + 1], g - g0, K, q, e, S, qs,
                         n, y + m0 * N + g * KQ_GROUP_ROWS, N);
        }
    }
    if (!bias && !lo) {  // most linears: nothing to add, only the passes' end to wait for
#pragma omp barrier
        return;
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < N / KQ_GROUP_ROWS; g++) {
        const int64_t col = g * KQ_GROUP_ROWS;
        if (bias)
            for (int64_t t = 0; t < T; t++)
                for (int j = 0; j < KQ_GROUP_ROWS; j++) y[t * N + col + j] += bias[col + j];
        if (lo) lora_cols(lo, l, which, y, N, T, col);
    }
}

// x [T, H] float32, the embedded rows in, the residual stream after the last layer out.
// ptrs [L, DS_PTRS]: x16 weights of qkv [(Hq + 2 Hkv) D, H], o [H, Hq D], gate_up [2I, H],
// down [H, I]; fp32 norm weights [H] (q/k norms [D] per head, or [Hq D] / [Hkv D] over the
// whole); k/v pools [S, Hkv, D]. cfg / fcfg [L, ...]: each layer's settings (above). RoPE
// tables [P, D]: cos/sin the global pair, cos_local/sin_local the local one (NULL when no
// layer uses it). Attention: query row t reads slots [lo, seq_lens[t]) of table[rows[t]]
// (ld_table int32 per row; lo from the layer's window); its new k/v go to out_slots[t] at
// positions[t]. aux_slot [L]: -1, or where the residual entering the layer goes in features
// [T, n_aux * H] (EAGLE-3's capture). pool_kind: ops.h's KV_*; kv_scales [L, 2] (NULL for a
// float pool): each layer's K and V scale addresses ([S, Hkv] float32). LoRA (lora_rows NULL:
// none): lora_rows [T] each row's adapter (-1: the base), lora_tab [n_lora][L][4][4] (see
// lora_cols), lora_rmax the largest R. moe_tab [L][MOE_FIELDS] (NULL: every layer dense): a
// row with experts makes that layer's MLP a mixture of experts (moe.c's phases, in place of
// gate_up / act / down; ptrs' MLP weights unused there). Returns 0; -1 when scratch memory could not be
// allocated; -2 for shapes or settings the kernels do not take.
int decode_step_x16(int64_t L, int64_t T, int64_t H, int64_t Hq, int64_t Hkv, int64_t D,
                    int64_t I, float *x, const int64_t *ptrs, float eps, int pool_kind,
                    const float *cos_tab, const float *sin_tab, const float *cos_local,
                    const float *sin_local, const int64_t *positions,
                    const int64_t *out_slots, const int32_t *table, int64_t ld_table,
                    const int64_t *rows, const int64_t *seq_lens, const int64_t *cfg,
                    const float *fcfg, const int64_t *aux_slot, int64_t n_aux, float *features,
                    const int64_t *runs, const int64_t *kv_scales, const int64_t *lora_rows,
                    const int64_t *lora_tab, int64_t n_lora, int64_t lora_rmax,
                    const int64_t *moe_tab, int64_t shared_min) {
    const int64_t nqkv = (Hq + 2 * Hkv) * D, hqd = Hq * D;
    if (T <= 0 || L <= 0 || H % XQK || hqd % XQK || I % XQK || nqkv % 16 || H % 16 ||
        (2 * I) % 16 || Hkv <= 0 || Hq % Hkv || D % 8 || pool_kind < 0 ||
        pool_kind >= KV_KINDS || (pool_kind >= KV_I8 && !kv_scales) ||
        (lora_rows && (!lora_tab || n_lora <= 0 || lora_rmax <= 0)))
        return -2;
    if (lora_rows)
        for (int64_t t = 0; t < T; t++)
            if (lora_rows[t] >= n_lora) return -2;
    // sparse layers (moe_tab rows with experts): one scratch for the largest of them
    int64_t moe_E = 0, moe_k = 0, moe_I = 0, moe_Ish = 0;
    for (int64_t l = 0; moe_tab && l < L; l++) {
        const int64_t *m = moe_tab + l * MOE_FIELDS;
        if (!m[MOE_E]) continue;
        if (moe_layer_check(m, H)) return -2;
        if (m[MOE_E] > moe_E) moe_E = m[MOE_E];
        if (m[MOE_TOP_K] > moe_k) moe_k = m[MOE_TOP_K];
        if (m[MOE_I] > moe_I) moe_I = m[MOE_I];
        if (m[MOE_SH_I] > moe_Ish) moe_Ish = m[MOE_SH_I];
    }
    moe_scratch ms;
    memset(&ms, 0, sizeof(ms));
    if (moe_E && moe_scratch_alloc(&ms, T, H, moe_E, moe_k, moe_I, moe_Ish)) return -1;
    // one attention plan per distinct window (which keys each row reads), shared by its layers
    int64_t windows[DS_PLANS];
    int n_plans = 0;
    int64_t *plan_of = (int64_t *)malloc(sizeof(int64_t) * (size_t)L);
    if (!plan_of) {
        moe_scratch_free(&ms);
        return -1;
    }
    for (int64_t l = 0; l < L; l++) {
        const int64_t *c = cfg + l * DS_CFG;
        if (c[C_WINDOW] < 0 || c[C_ROPE] < ROPE_GLOBAL || c[C_ROPE] > ROPE_NONE ||
            (c[C_ROPE] == ROPE_LOCAL && !cos_local) || c[C_QK_NORM] < QK_NORM_NONE ||
            c[C_QK_NORM] > QK_NORM_FULL || c[C_ACT] < ACT_SILU || c[C_ACT] > ACT_GELU_TANH) {
            free(plan_of);
            moe_scratch_free(&ms);
            return -2;
        }
        int j = 0;
        while (j < n_plans && windows[j] != c[C_WINDOW]) j++;
        if (j == n_plans) {
            if (n_plans == DS_PLANS) {
                free(plan_of);
                moe_scratch_free(&ms);
                return -2;
            }
            windows[n_plans++] = c[C_WINDOW];
        }
        plan_of[l] = j;
    }
    attn_plan plans[DS_PLANS];
    for (int j = 0; j < n_plans; j++) {
        if (attn_plan_init(&plans[j], T, Hq, Hkv, D, table, ld_table, rows, seq_lens,
                           windows[j], shared_min) != 0) {
            for (int i = 0; i < j; i++) attn_plan_free(&plans[i]);
            free(plan_of);
            moe_scratch_free(&ms);
            return -1;
        }
    }
    int64_t kmax = H > hqd ? H : hqd;
    kmax = kmax > I ? kmax : I;
    const int threads = omp_get_max_threads();
    size_t per_thread = (size_t)H;
    for (int j = 0; j < n_plans; j++) {
        const size_t need = attn_thread_floats(&plans[j]);
        per_thread = need > per_thread ? need : per_thread;
    }
    // h [T, H] | qkv [T, nqkv] | att [T, hqd] | proj [T, H] | gu [T, 2I] | e, S [T, kmax/32]
    // | per-thread scratch
    const size_t shared = (size_t)(T * (2 * H + nqkv + hqd + 2 * I + 2 * (kmax / XQK)));
    float *fl = (float *)malloc(sizeof(float) * (shared + per_thread * (size_t)threads));
    int8_t *q = (int8_t *)malloc((size_t)(T * kmax));
    int32_t *qs = runs ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(T * (kmax / 16))) : NULL;
    float *lora_u = lora_rows ? (float *)malloc(sizeof(float) * (size_t)(T * lora_rmax)) : NULL;
    if (!fl || !q || (runs && !qs) || (lora_rows && !lora_u)) {
        free(fl); free(q); free(qs); free(lora_u); free(plan_of);
        for (int j = 0; j < n_plans; j++) attn_plan_free(&plans[j]);
        moe_scratch_free(&ms);
        return -1;
    }
    float *h = fl, *qkv = h + T * H, *att = qkv + T * nqkv, *proj = att + T * hqd;
    float *gu = proj + T * H;
    act_rows a = {q, gu + T * 2 * I, gu + T * 2 * I + T * (kmax / XQK), qs};
    float *thread_base = a.S + T * (kmax / XQK);
    const lora_rows_t lo = {lora_rows, lora_tab, L, lora_rmax, lora_u};

#pragma omp parallel num_threads(threads)
    {
        float *tmp = thread_base + per_thread * (size_t)omp_get_thread_num();
        for (int64_t l = 0; l < L; l++) {
            const int64_t *p = ptrs + l * DS_PTRS, *c = cfg + l * DS_CFG;
            const float *fc = fcfg + l * DS_FCFG;
            const attn_plan *plan = &plans[plan_of[l]];
            const int64_t *lr = runs ? runs + l * 4 * DS_RUNS * 3 : NULL;
#define LINEAR_RUNS(i) (lr ? lr + (i) * DS_RUNS * 3 : NULL)
            const uint8_t *w_qkv = (const uint8_t *)p[P_QKV], *w_o = (const uint8_t *)p[P_O];
            const uint8_t *w_gu = (const uint8_t *)p[P_GATE_UP];
            const uint8_t *w_down = (const uint8_t *)p[P_DOWN];
            void *k_pool = (void *)p[P_K], *v_pool = (void *)p[P_V];
            float *k_scale = kv_scales ? (float *)kv_scales[2 * l] : NULL;
            float *v_scale = kv_scales ? (float *)kv_scales[2 * l + 1] : NULL;
            const float scale = fc[F_RESIDUAL_SCALE];
            const attn_qk qk = {
                c[C_ROPE] == ROPE_NONE ? NULL : (c[C_ROPE] == ROPE_LOCAL ? cos_local : cos_tab),
                c[C_ROPE] == ROPE_LOCAL ? sin_local : sin_tab, (int)c[C_QK_NORM],
                (const float *)p[P_Q_NORM], (const float *)p[P_K_NORM], eps};
            if (aux_slot[l] >= 0) {  // read-only on x, which no phase before the next barrier writes
#pragma omp for schedule(static) nowait
                for (int64_t t = 0; t < T; t++)
                    memcpy(features + (t * n_aux + aux_slot[l]) * H, x + t * H,
                           sizeof(float) * (size_t)H);
            }
            if (l == 0) {  // the first sub-layer's input: norm(x), or x ("post")
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++) {
                    residual_norm_row(x + t * H, NULL, 0, t, NULL, 0.0f, 1.0f, NULL,
                                      (const float *)p[P_NORM_IN], H, eps, h, 0, tmp);
                    quantize_act_row(&a, h + t * H, H, t);
                    if (lora_rows) lora_u_row(&lo, l, 0, h + t * H, H, t);
                }
            }
            linear_team(LINEAR_RUNS(0), w_qkv, nqkv, H, &a, T, qkv,
                        (const float *)p[P_QKV_BIAS], lora_rows ? &lo : NULL, l, 0);
            attn_rope_store_team(plan, qkv, 0, &qk, positions, k_pool, v_pool, pool_kind,
                                 k_scale, v_scale, out_slots, tmp);
            attn_attend_team(plan, k_pool, v_pool, pool_kind, k_scale, v_scale, table, ld_table,
                             rows, seq_lens,
                             fc[F_SM_SCALE], fc[F_SOFTCAP], att, 0, tmp);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                quantize_act_row(&a, att + t * hqd, hqd, t);
                if (lora_rows) lora_u_row(&lo, l, 1, att + t * hqd, hqd, t);
            }
            linear_team(LINEAR_RUNS(1), w_o, H, hqd, &a, T, proj, (const float *)p[P_O_BIAS],
                        lora_rows ? &lo : NULL, l, 1);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                residual_norm_row(x + t * H, proj, 0, t, (const float *)p[P_ATTN_OUT], eps,
                                  scale, x, (const float *)p[P_NORM_POST], H, eps, h, 0, tmp);
                quantize_act_row(&a, h + t * H, H, t);
                if (lora_rows) lora_u_row(&lo, l, 2, h + t * H, H, t);
            }
            const int64_t *moe = moe_tab ? moe_tab + l * MOE_FIELDS : NULL;
            if (moe && moe[MOE_E]) {  // a sparse layer: routing and experts (moe.c)
                moe_team(moe, &ms, h, T, H, 1, proj);
            } else {
                linear_team(LINEAR_RUNS(2), w_gu, 2 * I, H, &a, T, gu, NULL,
                            lora_rows ? &lo : NULL, l, 2);
#pragma omp for schedule(static)
                for (int64_t t = 0; t < T; t++) {
                    act_mul_row((int)c[C_ACT], gu + t * 2 * I, I);
                    quantize_act_row(&a, gu + t * 2 * I, I, t);
                    if (lora_rows) lora_u_row(&lo, l, 3, gu + t * 2 * I, I, t);
                }
                linear_team(LINEAR_RUNS(3), w_down, H, I, &a, T, proj, NULL,
                            lora_rows ? &lo : NULL, l, 3);
            }
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                const float *w_mlp_out = (const float *)p[P_MLP_OUT];
                if (l + 1 < L) {
                    residual_norm_row(x + t * H, proj, 0, t, w_mlp_out, eps, scale, x,
                                      (const float *)ptrs[(l + 1) * DS_PTRS + P_NORM_IN], H, eps,
                                      h, 0, tmp);
                    quantize_act_row(&a, h + t * H, H, t);
                    if (lora_rows) lora_u_row(&lo, l + 1, 0, h + t * H, H, t);
                } else {
                    residual_norm_row(x + t * H, proj, 0, t, w_mlp_out, eps, scale, x, NULL, H,
                                      eps, NULL, 0, tmp);
                }
            }
        }
    }
#undef LINEAR_RUNS
    free(fl);
    free(q);
    free(qs);
    free(lora_u);
    free(plan_of);
    for (int j = 0; j < n_plans; j++) attn_plan_free(&plans[j]);
    moe_scratch_free(&ms);
    return 0;
}
