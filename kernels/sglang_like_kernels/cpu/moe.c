// A mixture-of-experts MLP (layers/moe.py's math) as phases of one OpenMP team: the
// per-op path makes four calls per chosen expert (gate_up, act * up, down, the scaled add),
// each a Python -> ctypes crossing with tensor allocations, and a team that ran the experts
// one after another would wait at a barrier per expert and phase. Here a sparse layer is
//
//   route every token | sort the (token, expert) pairs by expert | quantize the pairs' rows |
//   gate_up of every chosen expert | act * up + quantize | down of every chosen expert |
//   each token's scaled sum
//
// six barriers whatever the number of experts: the matmul phases split (expert, group of 16
// output rows) work items over the team, each expert over all of its rows at once (its weights
// read once per step whatever the batch; an expert nobody chose costs nothing).
//
// Routing: logits = h @ router.T in float32, softmax, the top_k largest (ties: the lower
// expert id), divided by their sum when `renorm`. A token's k experts are summed in ascending
// id, and every row's numbers come from per-row sums: a token's output is the same bits alone
// or in any batch. Linears are runs (ops.h's DS_RUNS: x16 Q4_1 or kquants.c kinds),
// each expert with its own: gu_runs / dn_runs [E][DS_RUNS][3].
//
// The same phases run inside the fused decode step (decode_step.c) for its sparse layers, and
// alone through moe_forward (the per-op path).

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

#define XQK 32
#define GROUP 16  // output rows of one work item (x16 and kquants.c groups)

int moe_layer_check(const int64_t *m, int64_t H) {
    const int64_t E = m[MOE_E], k = m[MOE_TOP_K], I = m[MOE_I];
    if (E <= 0 || k <= 0 || k > E || I % XQK || (2 * I) % GROUP || H % XQK || H % GROUP ||
        !m[MOE_ROUTER] || !m[MOE_GU_RUNS] || !m[MOE_DN_RUNS] || m[MOE_ACT] < ACT_SILU ||
        m[MOE_ACT] > ACT_GELU_TANH)
        return -2;
    const int64_t Ish = m[MOE_SH_I];
    if (Ish < 0 || (Ish && (Ish % XQK || !m[MOE_SH_GATE] || !m[MOE_SH_GU_RUNS] ||
                            !m[MOE_SH_DN_RUNS])))
        return -2;
    for (int w = 0; w < 4; w++) {  // every expert's runs cover its rows in groups of 16
        if (w >= 2 && !Ish) break;
        static const int field[4] = {MOE_GU_RUNS, MOE_DN_RUNS, MOE_SH_GU_RUNS, MOE_SH_DN_RUNS};
        const int64_t *runs = (const int64_t *)m[field[w]];
        const int64_t want = w & 1 ? H : 2 * (w < 2 ? I : Ish);
        for (int64_t e = 0; e < (w < 2 ? E : 1); e++) {
            int64_t rows = 0;
            for (int r = 0; r < DS_RUNS && runs[(e * DS_RUNS + r) * 3 + 2] > 0; r++) {
                const int64_t n = runs[(e * DS_RUNS + r) * 3 + 2];
                if (n % GROUP || !runs[(e * DS_RUNS + r) * 3 + 1]) return -2;
                rows += n;
            }
            if (rows != want) return -2;
        }
    }
    return 0;
}

void moe_scratch_free(moe_scratch *s) {
    free(s->ints); free(s->floats); free(s->q); free(s->a.qs);
    free(s->sfloats); free(s->sq); free(s->sa.qs);
    memset(s, 0, sizeof(*s));
}

// the shared expert's scratch (Ish > 0): gate_up [T, 2 Ish], down [T, H], gates [T], and its
// rows quantized at up to max(H, Ish) columns
static int shared_alloc(moe_scratch *s, int64_t T, int64_t H, int64_t Ish) {
    const int64_t kmax = H > Ish ? H : Ish;
    s->sfloats = (float *)malloc(sizeof(float) *
                                 (size_t)(T * 2 * Ish + T * H + T + 2 * T * (kmax / XQK)));
    s->sq = (int8_t *)malloc((size_t)(T * kmax));
    s->sa.qs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(T * (kmax / 16)));
    if (!s->sfloats || !s->sq || !s->sa.qs) return -1;
    s->sgu = s->sfloats; s->sy = s->sgu + T * 2 * Ish; s->sgate = s->sy + T * H;
    s->sa.q = s->sq; s->sa.e = s->sgate + T; s->sa.S = s->sa.e + T * (kmax / XQK);
    return 0;
}

int moe_scratch_alloc(moe_scratch *s, int64_t T, int64_t H, int64_t E, int64_t k, int64_t I,
                      int64_t Ish) {
    memset(s, 0, sizeof(*s));
    const int64_t P = T * k, kmax = H > I ? H : I;
    s->cap_T = T; s->cap_E = E; s->cap_k = k; s->cap_I = I; s->cap_Ish = Ish; s->H = H;
    if (Ish > 0 && shared_alloc(s, T, H, Ish)) {
        moe_scratch_free(s);
        return -1;
    }
    // ints: ids [P] | start [E + 1] | pair [P] | pos [P] | hit [E + 1] | cursor [E]
    s->ints = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * P + 3 * E + 2));
    // floats: wts [P] | logits [T, E] | gu [P, 2I] | y [P, H] | e, S [P, kmax / 32]
    s->floats = (float *)malloc(sizeof(float) *
                                (size_t)(P + T * E + P * 2 * I + P * H + 2 * P * (kmax / XQK)));
    s->q = (int8_t *)malloc((size_t)(P * kmax));
    s->a.qs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(P * (kmax / 16)));
    if (!s->ints || !s->floats || !s->q || !s->a.qs) {
        moe_scratch_free(s);
        return -1;
    }
    s->ids = s->ints; s->start = s->ids + P; s->pair = s->start + E + 1; s->pos = s->pair + P;
    s->hit = s->pos + P; s->cursor = s->hit + E + 1;
    s->wts = s->floats; s->logits = s->wts + P; s->gu = s->logits + T * E;
    s->y = s->gu + P * 2 * I;
    s->a.q = s->q; s->a.e = s->y + P * H; s->a.S = s->a.e + P * (kmax / XQK);
    return 0;
}

// the top k of row[0..E) (ties: the lower index) into ids / w, by descending value
static void top_k(const float *row, int64_t E, int64_t k, int64_t *ids, float *w) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || row[e] > row[best])) best = e;
        }
        ids[j] = best;
        w[j] = row[best];
    }
}

static void route_row(const moe_scratch *s, const int64_t *m, const float *h, int64_t H,
                      int64_t t) {
    const int64_t E = m[MOE_E], k = m[MOE_TOP_K];
    const float *router = (const float *)m[MOE_ROUTER], *x = h + t * H;
    float *lg = s->logits + t * E;
    float most = -INFINITY;
    for (int64_t e = 0; e < E; e++) {
        const float *r = router + e * H;
        float acc = 0.0f;
        for (int64_t j = 0; j < H; j++) acc += r[j] * x[j];
        lg[e] = acc;
        most = acc > most ? acc : most;
    }
    float sum = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        lg[e] = expf(lg[e] - most);
        sum += lg[e];
    }
    for (int64_t e = 0; e < E; e++) lg[e] /= sum;
    int64_t *ids = s->ids + t * k;
    float *w = s->wts + t * k;
    top_k(lg, E, k, ids, w);
    if (m[MOE_RENORM]) {
        float total = 0.0f;
        for (int64_t j = 0; j < k; j++) total += w[j];
        for (int64_t j = 0; j < k; j++) w[j] /= total;
    }
}

// a token's k (expert, weight) pairs in ascending expert id (insertion sort: k is small)
static void sort_pairs(int64_t *ids, float *w, int64_t k) {
    for (int64_t i = 1; i < k; i++) {
        const int64_t id = ids[i];
        const float v = w[i];
        int64_t j = i - 1;
        for (; j >= 0 && ids[j] > id; j--) {
            ids[j + 1] = ids[j];
            w[j + 1] = w[j];
        }
        ids[j + 1] = id;
        w[j + 1] = v;
    }
}

// group g of an expert's linear (runs [DS_RUNS][3]) over its n rows from row r0 of the
// quantized activations (row stride K), into y (row stride ldy) at the group's columns
static void linear_group(const int64_t *runs, int64_t g, int64_t K, const act_rows *a,
                         int64_t r0, int64_t n, float *y, int64_t ldy) {
    int64_t col = 0;
    for (int r = 0; r < DS_RUNS; r++) {
        const int64_t kind = runs[3 * r], rows = runs[3 * r + 2];
        const uint8_t *w = (const uint8_t *)runs[3 * r + 1];
        if (g < rows / GROUP) {
            const int8_t *q = a->q + r0 * K;
            const float *e = a->e + r0 * (K / XQK), *S = a->S + r0 * (K / XQK);
            kq_any_group((int)kind, w, g, K, q, e, S, a->qs ? a->qs + r0 * (K / 16) : NULL, n,
                         y + col + g * GROUP, ldy);
            return;
        }
        g -= rows / GROUP;
        col += rows;
    }
}

// the shared expert's gate of row x: sigmoid(gate . x), the dot in column order
static float shared_gate(const float *gate, const float *x, int64_t H) {
    float acc = 0.0f;
    for (int64_t j = 0; j < H; j++) acc += gate[j] * x[j];
    return 1.0f / (1.0f + expf(-acc));
}

void moe_team(const int64_t *m, const moe_scratch *s, const float *h, int64_t T, int64_t H,
              int route, float *out) {
    const int64_t E = m[MOE_E], k = m[MOE_TOP_K], I = m[MOE_I], P = T * k;
    const int64_t *gu_runs = (const int64_t *)m[MOE_GU_RUNS];
    const int64_t *dn_runs = (const int64_t *)m[MOE_DN_RUNS];
    // the shared expert (Ish > 0) rides in the same phases: its T rows are extra work items
    // of each, so it adds no barrier
    const int64_t Ish = m[MOE_SH_I];
    const int64_t *sgu_runs = (const int64_t *)m[MOE_SH_GU_RUNS];
    const int64_t *sdn_runs = (const int64_t *)m[MOE_SH_DN_RUNS];
    const act_rows *a = &s->a, *sa = &s->sa;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        if (route) route_row(s, m, h, H, t);
        sort_pairs(s->ids + t * k, s->wts + t * k, k);
        if (Ish) {
            s->sgate[t] = shared_gate((const float *)m[MOE_SH_GATE], h + t * H, H);
            quantize_act_row(sa, h + t * H, H, t);
        }
    }
#pragma omp single
    {  // the pairs sorted by expert (a counting sort, stable) and the experts chosen
        int64_t *start = s->start;
        memset(start, 0, sizeof(int64_t) * (size_t)(E + 1));
        for (int64_t p = 0; p < P; p++) start[s->ids[p] + 1]++;
        int64_t nh = 0;
        for (int64_t e = 0; e < E; e++) {
            if (start[e + 1]) s->hit[nh++] = e;
            start[e + 1] += start[e];
        }
        s->hit[E] = nh;  // hit has E + 1 slots: the count last
        int64_t *fill = s->cursor;
        for (int64_t e = 0; e < E; e++) fill[e] = start[e];
        for (int64_t p = 0; p < P; p++) s->pair[fill[s->ids[p]]++] = p;
        for (int64_t r = 0; r < P; r++) s->pos[s->pair[r]] = r;
    }
    const int64_t nh = s->hit[E];
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P; r++) quantize_act_row(a, h + (s->pair[r] / k) * H, H, r);
    const int64_t gg = 2 * I / GROUP, gd = H / GROUP, gs = 2 * Ish / GROUP;
    const int64_t sd = Ish ? gd : 0;  // the shared expert's work items in the down phase
#pragma omp for schedule(static)
    for (int64_t i = 0; i < nh * gg + gs; i++) {
        if (i >= nh * gg) {
            linear_group(sgu_runs, i - nh * gg, H, sa, 0, T, s->sgu, 2 * Ish);
            continue;
        }
        const int64_t e = s->hit[i / gg], r0 = s->start[e];
        linear_group(gu_runs + e * DS_RUNS * 3, i % gg, H, a, r0, s->start[e + 1] - r0,
                     s->gu + r0 * 2 * I, 2 * I);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P + (Ish ? T : 0); r++) {
        if (r >= P) {
            float *row = s->sgu + (r - P) * 2 * Ish;
            act_mul_row((int)m[MOE_ACT], row, Ish);
            quantize_act_row(sa, row, Ish, r - P);
            continue;
        }
        float *row = s->gu + r * 2 * I;
        act_mul_row((int)m[MOE_ACT], row, I);
        quantize_act_row(a, row, I, r);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < nh * gd + sd; i++) {
        if (i >= nh * gd) {
            linear_group(sdn_runs, i - nh * gd, Ish, sa, 0, T, s->sy, H);
            continue;
        }
        const int64_t e = s->hit[i / gd], r0 = s->start[e];
        linear_group(dn_runs + e * DS_RUNS * 3, i % gd, I, a, r0, s->start[e + 1] - r0,
                     s->y + r0 * H, H);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        memset(o, 0, sizeof(float) * (size_t)H);
        for (int64_t j = 0; j < k; j++) {  // ascending expert id (sort_pairs)
            const float w = s->wts[t * k + j];
            const float *yr = s->y + s->pos[t * k + j] * H;
            for (int64_t c = 0; c < H; c++) {
                const float v = w * yr[c];
                o[c] += v;
            }
        }
        if (Ish) {  // then the shared expert, as layers/moe.py adds it
            const float g = s->sgate[t];
            const float *yr = s->sy + t * H;
            for (int64_t c = 0; c < H; c++) {
                const float v = g * yr[c];
                o[c] += v;
            }
        }
    }
}

// x [T, H] float32 -> out [T, H] float32, the experts' sum (the shared expert's included).
// m: the layer (ops.h's MOE_* fields). route 1: ids [T, k] / wts [T, k] are written (each
// token's experts in ascending id); route 0: they are read (given routings, for tests).
// Returns 0; -1 when scratch memory could not be allocated; -2 for shapes, ids or runs the
// kernels do not take.
int moe_forward(int64_t T, int64_t H, const float *x, const int64_t *m, int route,
                int64_t *ids, float *wts, float *out) {
    if (T <= 0 || moe_layer_check(m, H)) return -2;
    const int64_t E = m[MOE_E], k = m[MOE_TOP_K];
    if (!route)
        for (int64_t p = 0; p < T * k; p++)
            if (ids[p] < 0 || ids[p] >= E) return -2;
    moe_scratch s;
    if (moe_scratch_alloc(&s, T, H, E, k, m[MOE_I], m[MOE_SH_I])) return -1;
    if (!route) {
        memcpy(s.ids, ids, sizeof(int64_t) * (size_t)(T * k));
        memcpy(s.wts, wts, sizeof(float) * (size_t)(T * k));
    }
#pragma omp parallel
    moe_team(m, &s, x, T, H, route, out);
    memcpy(ids, s.ids, sizeof(int64_t) * (size_t)(T * k));
    memcpy(wts, s.wts, sizeof(float) * (size_t)(T * k));
    moe_scratch_free(&s);
    return 0;
}
