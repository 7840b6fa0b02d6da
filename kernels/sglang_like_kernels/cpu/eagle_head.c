// The EAGLE-3 draft head's forward, its LM head included, in one call and one OpenMP team.
//
// The head runs three times per verify at batch 1 (over the committed rows, then each draft
// step), each time over a few rows: as a dozen single ops (norms, fc, q/k/v, attention, o,
// gate/up, down, the draft LM head, each a Python -> ctypes crossing, tensors and an OpenMP
// fork/join) a call cost about a fifth of a batch-1 step. Here it is phases of one
// parallel region, each the fused decode step's own code (ops.h):
//
//   [fc over target features] | norm(embed) ++ norm(hidden), quantize | qkv | RoPE + k/v
//   store | attention | quantize | o | add + norm + quantize | gate_up | silu * up + quantize
//   | down | add | [final norm + quantize of the rows asked for | LM head]
//
// Linears are x16-packed int4 (q4_rows.c) without bias; activations, the residual and the
// logits float32; the head's KV pool float32 or bfloat16. The token embedding (the target's
// int8 rows) starts it and the top-k of the draft distribution ends it, so a call returns
// what the tree needs: candidates and the features they came from.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

#define XQK 32

// addresses, [EH_PTRS] int64: x16 weights of fc [H, F] (0: the inputs are the head's own
// outputs, F == H), qkv [(Hq + 2 Hkv) D, 2H], o [H, Hq D], gate_up [2I, H], down [H, I],
// lm_head [V, H]; fp32 norm weights [H] of the embedding, the hidden input, post-attention
// and the output
enum { E_FC, E_QKV, E_O, E_GATE_UP, E_DOWN, E_LM_HEAD, E_NORM_EMBED, E_NORM_HIDDEN,
       E_NORM_POST, E_NORM_OUT, EH_PTRS };

// the k largest of log_softmax(x [V]), largest first (the lower index among equals): their
// log-probabilities and target ids (draft index d + d2t[d])
static void top_log_softmax(const float *x, int64_t V, int64_t k, const int64_t *d2t,
                            int64_t *ids, float *lp) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < V; i++) mx = x[i] > mx ? x[i] : mx;
    double sum = 0.0;
    for (int64_t i = 0; i < V; i++) sum += expf(x[i] - mx);
    const float lse = mx + (float)log(sum);
    int64_t n = 0;  // ids/lp hold the n best so far as draft indices, largest first
    for (int64_t i = 0; i < V; i++) {
        if (n == k && x[i] <= lp[k - 1]) continue;
        int64_t at = n < k ? n++ : k - 1;
        while (at > 0 && lp[at - 1] < x[i]) {
            lp[at] = lp[at - 1];
            ids[at] = ids[at - 1];
            at--;
        }
        lp[at] = x[i];
        ids[at] = i;
    }
    for (int64_t j = 0; j < k; j++) {
        lp[j] -= lse;
        ids[j] += d2t[ids[j]];
    }
}

// row `id` of a block-int8 matrix [*, H] (see eagle_head_x16) as float32
static void embed_row(const int8_t *codes, const float *scale, int x16, int64_t id, int64_t H,
                      float *out) {
    const int64_t nb = H / XQK;
    if (!x16) {
        for (int64_t i = 0; i < H; i++)
            out[i] = (float)codes[id * H + i] * scale[id * nb + i / XQK];
        return;
    }
    const int64_t g = id / 16, r = id % 16;
    for (int64_t b = 0; b < nb; b++) {
        const float s = scale[(g * nb + b) * 16 + r];
        const int8_t *blk = codes + (g * nb + b) * XQK * 16 + r * 4;
        for (int t = 0; t < 8; t++)
            for (int j = 0; j < 4; j++) out[b * XQK + 4 * t + j] = (float)blk[t * 64 + j] * s;
    }
}

static inline void quantize(int8_t *q, float *e, float *S, const float *x, int64_t K,
                            int64_t t) {
    q4_1_quantize_row_q8(x, (int)K, q + t * K, e + t * (K / XQK), S + t * (K / XQK));
}

// The rows' tokens: ids [T] into the target's embedding, int8 codes with a float32 scale per
// 32 columns (GGUF Q8_0's blocks), rows [*, H] and scales [*, H/32], or with embed_x16 in
// q8_rows.c's layout (codes [*/16, H/32, 8, 16, 4], scales [*/16, H/32, 16]); with
// embed_codes NULL, embeds [T, H] float32 given. features [T, F] float32: the target's
// features when ptrs[E_FC] is set, else the head's own outputs (F == H). Each query row t
// stores its k/v at out_slots[t] (position positions[t]) and attends to the first
// seq_lens[t] slots of table[rows[t]]. out [T, H]: the layer's output (the next draft step's
// feature). For rows logit_rows[j] of out, the top
// `topk` of the draft vocabulary's log-softmax, largest first (the first index among equals):
// top_lp [n_logits, topk], top_ids [n_logits, topk] as target ids (draft id d is d + d2t[d]).
// Returns 0; -1 when scratch memory could not be allocated; -2 for shapes the kernels do not
// take.
int eagle_head_x16(int64_t T, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t I,
                   int64_t V, int64_t F, const float *embeds, const int8_t *embed_codes,
                   const float *embed_scale, int embed_x16, const int64_t *ids,
                   const float *features, const int64_t *ptrs, float eps,
                   const float *cos_tab, const float *sin_tab,
                   const int64_t *positions, const int64_t *out_slots, void *k_pool,
                   void *v_pool, int pool_bf16, const int32_t *table, int64_t ld_table,
                   const int64_t *rows, const int64_t *seq_lens, float sm_scale, float *out,
                   const int64_t *logit_rows, int64_t n_logits, const int64_t *d2t,
                   int64_t topk, int64_t *top_ids, float *top_lp) {
    const int64_t nqkv = (Hq + 2 * Hkv) * D, hqd = Hq * D;
    const int has_fc = ptrs[E_FC] != 0;
    if (T <= 0 || H % XQK || hqd % XQK || I % XQK || F % XQK || nqkv % 16 || H % 16 ||
        (2 * I) % 16 || V % 16 || Hkv <= 0 || Hq % Hkv || D % 8 || (!has_fc && F != H) ||
        n_logits < 0 || n_logits > T || topk < 1 || topk > V || (!embeds && !embed_codes))
        return -2;
    attn_plan plan;
    if (attn_plan_init(&plan, T, Hq, Hkv, D, table, ld_table, rows, seq_lens, 0, 0) != 0)
        return -1;
    const attn_qk qk = {cos_tab, sin_tab, QK_NORM_NONE, NULL, NULL, 0.0f};
    int64_t kmax = 2 * H;
    kmax = kmax > hqd ? kmax : hqd;
    kmax = kmax > I ? kmax : I;
    kmax = kmax > F ? kmax : F;
    const int threads = omp_get_max_threads();
    size_t per_thread = attn_thread_floats(&plan);
    per_thread = per_thread > (size_t)H ? per_thread : (size_t)H;
    // res [T, H] | xin [T, 2H] | qkv [T, nqkv] | att [T, hqd] | proj [T, H] | gu [T, 2I]
    // | e, S [T, kmax/32] | emb [T, H] | logits [n_logits, V] | per-thread scratch
    const size_t shared = (size_t)(T * (5 * H + nqkv + hqd + 2 * I + 2 * (kmax / XQK) + H) +
                                   n_logits * V);
    float *fl = (float *)malloc(sizeof(float) * (shared + per_thread * (size_t)threads));
    int8_t *q = (int8_t *)malloc((size_t)(T * kmax));
    if (!fl || !q) {
        free(fl); free(q);
        attn_plan_free(&plan);
        return -1;
    }
    float *res = fl, *xin = res + T * H, *qkv = xin + T * 2 * H, *att = qkv + T * nqkv;
    float *proj = att + T * hqd, *gu = proj + T * H, *e = gu + T * 2 * I;
    float *S = e + T * (kmax / XQK), *emb = S + T * (kmax / XQK), *logits = emb + T * H;
    float *thread_base = logits + n_logits * V;
    const float *w_embed = (const float *)ptrs[E_NORM_EMBED];
    const float *w_hidden = (const float *)ptrs[E_NORM_HIDDEN];
    const float *w_post = (const float *)ptrs[E_NORM_POST];
    const float *w_out = (const float *)ptrs[E_NORM_OUT];

#pragma omp parallel num_threads(threads)
    {
        float *tmp = thread_base + per_thread * (size_t)omp_get_thread_num();
        if (has_fc) {  // the target's features -> the head's hidden size
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) quantize(q, e, S, features + t * F, F, t);
            q4_x16_matmul_team((const uint8_t *)ptrs[E_FC], H, F, q, e, S, T, res, H);
        } else {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++)
                memcpy(res + t * H, features + t * H, sizeof(float) * (size_t)H);
        }
        // the layer's input: norm(embed) and norm(hidden) side by side [2H]
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const float *er = embeds ? embeds + t * H : emb + t * H;
            if (!embeds) embed_row(embed_codes, embed_scale, embed_x16, ids[t], H, emb + t * H);
            add_rmsnorm_row(er, NULL, 0, 0, NULL, w_embed, H, eps, xin + t * 2 * H,
                            0, tmp);
            add_rmsnorm_row(res + t * H, NULL, 0, 0, NULL, w_hidden, H, eps,
                            xin + t * 2 * H + H, 0, tmp);
            quantize(q, e, S, xin + t * 2 * H, 2 * H, t);
        }
        q4_x16_matmul_team((const uint8_t *)ptrs[E_QKV], nqkv, 2 * H, q, e, S, T, qkv, nqkv);
        attn_rope_store_team(&plan, qkv, 0, &qk, positions, k_pool, v_pool, pool_bf16, NULL,
                             NULL,
                             out_slots, tmp);
        attn_attend_team(&plan, k_pool, v_pool, pool_bf16, NULL, NULL, table, ld_table, rows,
                         seq_lens, sm_scale, 0.0f, att, 0, tmp);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) quantize(q, e, S, att + t * hqd, hqd, t);
        q4_x16_matmul_team((const uint8_t *)ptrs[E_O], H, hqd, q, e, S, T, proj, H);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {  // res += o; xin = norm(res)
            add_rmsnorm_row(res + t * H, proj, 0, t, res, w_post, H, eps, xin, 0, tmp);
            quantize(q, e, S, xin + t * H, H, t);
        }
        q4_x16_matmul_team((const uint8_t *)ptrs[E_GATE_UP], 2 * I, H, q, e, S, T, gu, 2 * I);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            silu_mul_row(gu + t * 2 * I, I);
            quantize(q, e, S, gu + t * 2 * I, I, t);
        }
        q4_x16_matmul_team((const uint8_t *)ptrs[E_DOWN], H, I, q, e, S, T, proj, H);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < H; i++) out[t * H + i] = res[t * H + i] + proj[t * H + i];
        if (n_logits > 0) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n_logits; j++) {
                add_rmsnorm_row(out + logit_rows[j] * H, NULL, 0, 0, NULL, w_out, H, eps,
                                xin + j * H, 0, tmp);
                quantize(q, e, S, xin + j * H, H, j);
            }
            q4_x16_matmul_team((const uint8_t *)ptrs[E_LM_HEAD], V, H, q, e, S, n_logits,
                               logits, V);
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n_logits; j++)
                top_log_softmax(logits + j * V, V, topk, d2t, top_ids + j * topk,
                                top_lp + j * topk);
        }
    }
    free(fl);
    free(q);
    attn_plan_free(&plan);
    return 0;
}
