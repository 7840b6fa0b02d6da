// What the fused decode step (decode_step.c) shares with the single ops (ops.c, q4_1.c,
// q4_rows.c): the per-row bodies and the `team` phases, which hold orphaned `omp for`
// loops: called by every thread of a parallel region they split its work; called outside
// one they run it on the calling thread. Either way a row's numbers are the same bits.
#ifndef SGLANG_LIKE_CPU_OPS_H
#define SGLANG_LIKE_CPU_OPS_H

#include <stddef.h>
#include <stdint.h>

void add_rmsnorm_row(const float *xr, const void *delta, int delta_bf16, int64_t t,
                     float *x_out, const float *w, int64_t H, float eps, void *out,
                     int out_bf16, float *row);
// the residual add after a sub-layer in every norm layout (ops.c); add_rmsnorm_row is its
// Llama case (no output norm, scale 1)
void residual_norm_row(const float *xr, const void *delta, int delta_bf16, int64_t t,
                       const float *w_sub, float sub_eps, float scale, float *x_out,
                       const float *w, int64_t H, float eps, void *out, int out_bf16,
                       float *row);
void silu_mul_row(float *row, int64_t I);
void gelu_tanh_mul_row(float *row, int64_t I);
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
void act_mul_row(int act, float *row, int64_t I);

// activations: one row [K] -> int8 codes q [K], scale e and sum S [K/32] per block of 32
void q4_1_quantize_row_q8(const float *x, int K, int8_t *q, float *e, float *S);
// y [M, N] (row stride ldy) = quantized rows (q [M, K], e/S [M, K/32]) @ W.T, W x16-packed
void q4_x16_matmul_team(const uint8_t *w, int64_t N, int64_t K, const int8_t *q,
                        const float *e, const float *S, int64_t M, float *y, int64_t ldy);

// one group of 16 output rows of q4_x16_matmul_team, on the calling thread
void q4_x16_matmul_group(const uint8_t *w, int64_t g, int64_t K, const int8_t *q,
                         const float *e, const float *S, int64_t M, float *y, int64_t ldy);

// kquants.c: a GGUF-type matrix of `kind` (kquants.c's enum) times quantized rows, which
// also carry qs [M, K/16] (kq_row_sums16 of q)
void kq_row_sums16(const int8_t *q, int64_t K, int32_t *qs);
void kq_matmul_team(int kind, const uint8_t *w, int64_t N, int64_t K, const int8_t *q,
                    const float *e, const float *S, const int32_t *qs, int64_t M, float *y,
                    int64_t ldy);
void kq_matmul_group(int kind, const uint8_t *w, int64_t g, int64_t K, const int8_t *q,
                     const float *e, const float *S, const int32_t *qs, int64_t M, float *y,
                     int64_t ldy);
// The same products where `kind` may also be -1 (an x16 Q4_1 weight): on AMX tiles from the
// row count kq_set_tiles names (same bits: amx_kq.c), else on the kernels above. _team splits
// the groups over the calling team; _group is one group on the calling thread.
int64_t kq_pass_rows(int64_t K);  // rows per pass of a team's matmul at width K
void kq_any_team(int kind, const uint8_t *w, int64_t N, int64_t K, const int8_t *q,
                 const float *e, const float *S, const int32_t *qs, int64_t M, float *y,
                 int64_t ldy);
void kq_any_group(int kind, const uint8_t *w, int64_t g, int64_t K, const int8_t *q,
                  const float *e, const float *S, const int32_t *qs, int64_t M, float *y,
                  int64_t ldy);

// Activation rows quantized for the int linears: q [T, K] int8 codes, e / S [T, K / 32] the
// block scales and sums, qs [T, K / 16] (NULL when every linear is x16) the sums kquants take.
typedef struct {
    int8_t *q;
    float *e;
    float *S;
    int32_t *qs;
} act_rows;
void quantize_act_row(const act_rows *a, const float *x, int64_t K, int64_t t);
// A linear as runs of output rows, one kind each: runs [DS_RUNS][3] (kind, packed weight
// address, rows), kind -1 an x16 Q4_1 weight, else a kquants.c kind; rows 0 ends the list
// (decode_step.c's linear_team; moe.c's experts).
#define DS_RUNS 4

// moe.c: a sparse layer as int64 fields (a row of the fused step's moe table, or one layer
// for moe_forward): experts, top k, expert width, renormalize (0/1), ACT_*, and addresses of
// the float32 router [E, H] and the experts' runs [E][DS_RUNS][3] of gate_up and down; then
// a shared expert every token runs (Qwen2-MoE's; width 0: none): its width, the address of
// its float32 gate [H] (output scaled by sigmoid(gate . x)) and its runs [DS_RUNS][3]
enum { MOE_E, MOE_TOP_K, MOE_I, MOE_RENORM, MOE_ACT, MOE_ROUTER, MOE_GU_RUNS, MOE_DN_RUNS,
       MOE_SH_I, MOE_SH_GATE, MOE_SH_GU_RUNS, MOE_SH_DN_RUNS, MOE_FIELDS };
typedef struct {
    int64_t cap_T, cap_E, cap_k, cap_I, cap_Ish, H;  // what it was sized for
    int64_t *ints, *ids, *start, *pair, *pos, *hit, *cursor;
    float *floats, *wts, *logits, *gu, *y;
    float *sfloats, *sgu, *sy, *sgate;  // the shared expert's gate_up [T, 2 Ish], down [T, H],
                                        // gates [T] (in sfloats)
    int8_t *q, *sq;
    act_rows a, sa;  // the pairs' rows; the shared expert's (one per token)
} moe_scratch;
int moe_layer_check(const int64_t *m, int64_t H);  // 0, or -2 for a layer moe.c cannot run
int moe_scratch_alloc(moe_scratch *s, int64_t T, int64_t H, int64_t E, int64_t k, int64_t I,
                      int64_t Ish);
void moe_scratch_free(moe_scratch *s);
// team phases: out [T, H] = the experts' sum for h [T, H] (route 0: s->ids / s->wts given)
void moe_team(const int64_t *m, const moe_scratch *s, const float *h, int64_t T, int64_t H,
              int route, float *out);

typedef struct {
    int64_t B, Hq, Hkv, D;
    int64_t group, sub, subs;  // query heads per kv head; per attend call; calls per kv head
    float *q_all;              // [B, Hq, D] the rotated queries
    int16_t *q16;              // [B, Hq, D] over an int8 pool: q_all rounded, per head scale
    float *q16_scale;          // [B, Hq] (attention.c's int8 kernel)
    int64_t *num_chunks;       // [B] chunks of KV_CHUNK keys per query row
    int64_t *item_start;       // [B + 1] first partial of each row
    int64_t num_groups;        // runs of rows that read the same keys (attention.c)
    int64_t *group_start;      // [num_groups + 1] first row of each group
    int64_t *group_chunks;     // [num_groups] most chunks of a row of the group
    int64_t *kv_item_start;    // [num_groups + 1] first work item of each group
    int by_chunk;              // a work item: every head of a chunk (long contexts; attention.c)
    int64_t total_kv_items;
    float *partials;           // per (row, head, chunk): max, sum, acc [D]
    int64_t *lo;               // [B] first key of a row's window (0 without one)
    // rows that share a prefix of keys (attention.c's cascade): each shared group's keys
    // [0, shared_len) read once for all its rows, their own keys from own_from[b]
    int64_t num_shared;        // shared groups
    int64_t *shared_start;     // [num_shared + 1] into shared_rows
    int64_t *shared_rows;      // [B] the groups' rows
    int64_t *shared_len;       // [num_shared] keys every row of the group shares
    int64_t *own_from;         // [B] first key a row reads by itself (lo, or shared_len)
    int64_t *chunk0;           // [B] the row's partials before its own: its shared chunks
    int64_t *shared_item_start; // [num_shared + 1] first work item of each shared group
                               // (its shared chunks x kv heads); the rows' own items follow
    int64_t most_shared;       // the largest group's rows
} attn_plan;

// window: a row sees only the last `window` of its seq_len keys (0: all of them).
// shared_min > 0 (and no window): rows whose key rows begin with at least shared_min equal
// slots read those keys once together (attention.c's cascade: other float sums than a row
// alone, so callers that need a row's bits independent of its batch pass 0).
int attn_plan_init(attn_plan *p, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                   const int32_t *table, int64_t ld_table, const int64_t *rows,
                   const int64_t *seq_lens, int64_t window, int64_t shared_min);
void attn_plan_free(attn_plan *p);
size_t attn_thread_floats(const attn_plan *p);  // scratch floats each thread brings

// How q and k become what attention reads (a layer's description, decoder.py): an RMSNorm of
// q and of k (per head, or over all of a token's q / k rows), then RoPE by a [P, D] table pair
// ([cos, cos] and [-sin, sin] rows), or no rotation where cos is NULL.
enum { QK_NORM_NONE = 0, QK_NORM_HEAD = 1, QK_NORM_FULL = 2 };
typedef struct {
    const float *cos, *sin;
    int qk_norm;
    const float *q_norm, *k_norm;  // [D] (head) or [Hq D] / [Hkv D] (full)
    float eps;
} attn_qk;

// The KV pool's element kinds (pool_kind; 0 and 1 are the older bf16 flag's values): float32,
// bfloat16, or 8-bit codes with a float32 scale per (slot, kv head) in k_scale / v_scale
// [S, Hkv] (kv_quant.py: the row rotated, r = W x; scale = max|r| / 127, 448 or 57344;
// code = r / scale rounded).
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2, KV_E4M3 = 3, KV_E5M2 = 4, KV_KINDS = 5 };
// n rows [n, D] -> codes and scales as kv_quant.quantize (rotated = 1: as quantize_rotated)
int kv_quantize_rows(const float *x, int64_t n, int64_t D, int kind, int rotated, void *codes,
                     float *scales);

// k_scale / v_scale: unused (NULL) unless pool_kind is a quantized kind
void attn_rope_store_team(const attn_plan *p, const void *qkv, int qkv_bf16, const attn_qk *qk,
                          const int64_t *positions, void *k_pool, void *v_pool, int pool_kind,
                          float *k_scale, float *v_scale, const int64_t *out_slots, float *tmp);
// softcap: scores -> softcap * tanh(scores / softcap) (0: none)
void attn_attend_team(const attn_plan *p, const void *k_pool, const void *v_pool,
                      int pool_kind, const float *k_scale, const float *v_scale,
                      const int32_t *table, int64_t ld_table,
                      const int64_t *rows, const int64_t *seq_lens, float sm_scale,
                      float softcap, void *out, int out_bf16, float *tmp);

#endif
