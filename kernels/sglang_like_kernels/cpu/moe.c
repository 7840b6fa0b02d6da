// A mixture-of-experts MLP's experts in one call and one OpenMP team (layers/moe.py's math):
// the per-op path makes four calls per chosen expert (gate_up, act * up, down, the scaled
// add), each a Python -> ctypes crossing with tensor allocations; a decode step of a model
// with 8 of 128 experts per token makes hundreds of them a layer. Here every chosen expert
// runs as the team's phases, over all of its rows at once (its weights read once per call
// whatever the batch):
//
//   quantize its rows of x | gate_up | act * up + quantize | down | out[t] += w * y
//
// Experts go in ascending id, so a token's output is the sum of its experts' scaled outputs
// in expert order whatever the batch (rows of one expert are computed each on its own: the
// kernels' per-row sums do not depend on the rows beside them).
// Linears are runs (ops.h's linear_runs_team: x16 Q4_1 or kquants.c kinds), every expert of
// a layer with its own runs: gu_runs / dn_runs [E][DS_RUNS][3].

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

#define XQK 32

// x [T, H] float32; ids [T, top_k] int64 expert ids in [0, E); wts [T, top_k] float32 routing
// weights; out [T, H] float32 (overwritten). act: ACT_* (ops.h). Returns 0; -1 when scratch
// memory could not be allocated; -2 for shapes or ids the kernels do not take.
int moe_experts(int64_t T, int64_t H, int64_t I, int64_t E, int64_t top_k, const float *x,
                const int64_t *ids, const float *wts, const int64_t *gu_runs,
                const int64_t *dn_runs, int act, float *out) {
    if (T <= 0 || H % XQK || I % XQK || E <= 0 || top_k <= 0 || top_k > E) return -2;
    const int64_t P = T * top_k;
    for (int64_t i = 0; i < P; i++)
        if (ids[i] < 0 || ids[i] >= E) return -2;
    // the (token, k) pairs sorted by expert, stably: a counting sort
    int64_t *start = (int64_t *)calloc((size_t)(E + 1), sizeof(int64_t));
    int64_t *pair = (int64_t *)malloc(sizeof(int64_t) * (size_t)P);
    if (!start || !pair) {
        free(start); free(pair);
        return -1;
    }
    for (int64_t i = 0; i < P; i++) start[ids[i] + 1]++;
    int64_t most = 0;
    for (int64_t e = 0; e < E; e++) {
        if (start[e + 1] > most) most = start[e + 1];
        start[e + 1] += start[e];
    }
    {
        int64_t *fill = (int64_t *)malloc(sizeof(int64_t) * (size_t)E);
        if (!fill) {
            free(start); free(pair);
            return -1;
        }
        memcpy(fill, start, sizeof(int64_t) * (size_t)E);
        for (int64_t i = 0; i < P; i++) pair[fill[ids[i]]++] = i;
        free(fill);
    }
    const int64_t kmax = H > I ? H : I;
    // scratch: gate_up [most, 2I], down's output [most, H], quantized rows [most, kmax]
    float *gu = (float *)malloc(sizeof(float) * (size_t)(most * (2 * I + H + 2 * (kmax / XQK))));
    int8_t *q = (int8_t *)malloc((size_t)(most * kmax));
    int32_t *qs = (int32_t *)malloc(sizeof(int32_t) * (size_t)(most * (kmax / 16)));
    if (!gu || !q || !qs) {
        free(start); free(pair); free(gu); free(q); free(qs);
        return -1;
    }
    float *y = gu + most * 2 * I;
    act_rows a = {q, y + most * H, y + most * H + most * (kmax / XQK), qs};
    memset(out, 0, sizeof(float) * (size_t)(T * H));
#pragma omp parallel
    {
        for (int64_t e = 0; e < E; e++) {
            const int64_t lo = start[e], n = start[e + 1] - lo;
            if (n == 0) continue;  // every thread skips it: no barrier is left unmatched
            const int64_t *gr = gu_runs + e * DS_RUNS * 3, *dr = dn_runs + e * DS_RUNS * 3;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) quantize_act_row(&a, x + (pair[lo + r] / top_k) * H, H, r);
            linear_runs_team(gr, NULL, 2 * I, H, &a, n, gu);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) {
                float *row = gu + r * 2 * I;
                act_mul_row(act, row, I);
                quantize_act_row(&a, row, I, r);
            }
            linear_runs_team(dr, NULL, H, I, &a, n, y);
            // distinct rows of one expert are distinct tokens: no two threads add to one row
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) {
                const int64_t p = pair[lo + r];
                const float w = wts[p];
                float *o = out + (p / top_k) * H;
                const float *yr = y + r * H;
                for (int64_t j = 0; j < H; j++) {
                    const float v = w * yr[j];
                    o[j] += v;
                }
            }
        }
    }
    free(start); free(pair); free(gu); free(q); free(qs);
    return 0;
}
