// The cascade's shared keys (attention.c, attend_shared) on AMX-BF16 tiles, for a bf16 pool.
//
// attend_shared gives every query head of every row on a shared prefix its scores against a
// chunk of up to 256 shared keys, then their softmax weights times the chunk's values. On the
// vector unit those two products were 18% of the decode steps of 32 requests on a ~900-token
// system prompt (perf, AMX Xeon); here they are tile products, and what is left on the vector
// unit is the softmax and moving the keys and values into the tiles' layout once a chunk.
//
// Precision: the keys and values are bf16 already (the pool's own bits). The queries and the
// softmax weights are float32; each is split into a bf16 top and the bf16 rounding of the
// rest (store_bf16_split: 16 significant bits), and both parts multiply the keys or values:
// two tile products instead of one, and a relative error near 2^-17 a term instead of bf16's
// 2^-9. The tiles sum in float32 in their own order, so the bits differ from the vector
// cascade (which is off wherever bits must not depend on the batch: deterministic mode).

#include "amx.h"
#include "simd.h"

#include <math.h>

// 16 rows of 16 dwords -> their 16 columns
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // 128-bit lane l of r[4a + b] now holds column 4l + b of rows 4a .. 4a + 3: two rounds
    // of lane shuffles bring the four lanes of each column together
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
    }
}

// tiles: C 0-3 (m rows of 16 floats), A 4 / 5 (m rows: the top and rest parts), B 6 / 7
static void configure_attn(int m) {
    const int rows[8] = {m, m, m, m, m, m, 16, 16};
    const int colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure(rows, colsb);
}

static inline const uint16_t *pool_row(const uint16_t *pool, const int32_t *slots, int64_t t,
                                       int64_t Hkv, int64_t g, int64_t D) {
    return pool + ((int64_t)slots[t] * Hkv + g) * D;
}

// one C tile per block of 16 keys or 16 dims: c += top . b, c += rest . b
#define DP2(c, b)                \
    do {                         \
        _tile_dpbf16ps(c, 4, b); \
        _tile_dpbf16ps(c, 5, b); \
    } while (0)

// e^x for 16 lanes: simd.h's exp256 (the same steps) twice as wide
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                         _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __mmask16 lanes_below(int64_t left) {  // the first min(left, 16) lanes
    return left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

// keys [0, n) of pool rows slots[.] of kv head g (zeros past n, up to nk) as B tiles, per
// block of 16 keys and 32 dims: 16 rows (dim pairs) of the 16 keys' pairs
static void pack_keys(const uint16_t *k_pool, const int32_t *slots, int64_t n, int64_t nk,
                      int64_t Hkv, int64_t g, int64_t D, uint32_t *kb) {
    const int64_t nd = D / 32;
    for (int64_t b = 0; b < nk / 16; b++) {
        const uint16_t *row[16];
        for (int i = 0; i < 16; i++) {
            const int64_t t = 16 * b + i;
            row[i] = t < n ? pool_row(k_pool, slots, t, Hkv, g, D) : NULL;
            if (t + 16 < n) {  // the next block's rows, gathered by slot
                const char *next = (const char *)pool_row(k_pool, slots, t + 16, Hkv, g, D);
                for (int64_t o = 0; o < 2 * D; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
            }
        }
        for (int64_t c = 0; c < nd; c++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = row[i] ? _mm512_loadu_si512(row[i] + 32 * c) : _mm512_setzero_si512();
            transpose16(r);  // r[p]: dim pair 16 c + p of the 16 keys
            for (int p = 0; p < 16; p++)
                _mm512_store_si512(kb + ((b * nd + c) * 16 + p) * 16, r[p]);
        }
    }
}

// values [0, n) likewise (zeros past n) as B tiles, per block of 32 keys and 16 dims: 16 rows
// (key pairs) of the 16 dims' pairs
static void pack_values(const uint16_t *v_pool, const int32_t *slots, int64_t n, int64_t nk,
                        int64_t Hkv, int64_t g, int64_t D, uint16_t *vb) {
    // word i: word i / 2 of the first key's 32 (i even) or the second's, from dim 0 or 16
    uint16_t lo[32], hi[32];
    for (int i = 0; i < 32; i++) {
        lo[i] = (uint16_t)((i & 1) * 32 + i / 2);
        hi[i] = (uint16_t)((i & 1) * 32 + 16 + i / 2);
    }
    const __m512i lo_idx = _mm512_loadu_si512(lo), hi_idx = _mm512_loadu_si512(hi);
    const int64_t nd16 = D / 16;
    for (int64_t t = 0; t < nk; t += 2) {
        const uint16_t *a = t < n ? pool_row(v_pool, slots, t, Hkv, g, D) : NULL;
        const uint16_t *b = t + 1 < n ? pool_row(v_pool, slots, t + 1, Hkv, g, D) : NULL;
        for (int64_t u = t + 8; u < t + 10 && u < n; u++) {
            const char *next = (const char *)pool_row(v_pool, slots, u, Hkv, g, D);
            for (int64_t o = 0; o < 2 * D; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
        }
        const int64_t kp = t / 32, p = (t % 32) / 2;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i va = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
            const __m512i vv = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
            uint16_t *blk = vb + ((kp * nd16 + d / 16) * 16 + p) * 32;
            _mm512_store_si512(blk, _mm512_permutex2var_epi16(va, lo_idx, vv));
            _mm512_store_si512(blk + 512, _mm512_permutex2var_epi16(va, hi_idx, vv));
        }
    }
}

// Shared-prefix attention partials over a bf16 pool: for the nq query rows qp[j] [D] and the
// keys and values of pool rows slots[0 .. n) of kv head g (n <= 256), parts[j] = (max, sum,
// acc [D]) of the scores sm_scale q_j . k_t (soft-capped when softcap > 0), as attention.c's
// attend_shared leaves them. D a multiple of 32. Returns -1 (nothing written) for another
// shape or when scratch memory could not be had.
int attn_amx_shared(const float *const *qp, int64_t nq, const uint16_t *k_pool,
                    const uint16_t *v_pool, const int32_t *slots, int64_t n, int64_t Hkv,
                    int64_t g, int64_t D, float sm_scale, float softcap, float *const *parts) {
    if (D % 32 || n <= 0 || n > 256 || nq <= 0) return -1;
    const int64_t nk = (n + 31) / 32 * 32, nd = D / 32, nd16 = D / 16;
    // queries' two parts [nq, D]; keys and values as tiles [nk, D] each; one query tile's
    // scores [16, nk] float, its weights' two parts [16, nk]; 16 x 64 floats of output
    const size_t bytes = (size_t)(2 * nq * D + 2 * nk * D + 2 * 16 * nk) * 2 +
                         (size_t)(16 * nk + 16 * 64) * 4;
    uint16_t *top = amx_scratch_get(0, bytes);
    if (!top) return -1;
    uint16_t *rest = top + nq * D, *vb = rest + nq * D;
    uint32_t *kb = (uint32_t *)(vb + nk * D);
    uint16_t *wt = (uint16_t *)(kb + nk * D / 2), *wr = wt + 16 * nk;
    float *sc = (float *)(wr + 16 * nk), *out = sc + 16 * nk;
    const __m512 s = _mm512_set1_ps(sm_scale);
    for (int64_t j = 0; j < nq; j++)
        for (int64_t d = 0; d < D; d += 32)
            store_bf16_split(_mm512_mul_ps(_mm512_loadu_ps(qp[j] + d), s),
                             _mm512_mul_ps(_mm512_loadu_ps(qp[j] + d + 16), s),
                             top + j * D + d, rest + j * D + d);
    pack_keys(k_pool, slots, n, nk, Hkv, g, D, kb);
    pack_values(v_pool, slots, n, nk, Hkv, g, D, vb);
    int configured = -1;
    for (int64_t q0 = 0; q0 < nq; q0 += 16) {
        const int m = nq - q0 < 16 ? (int)(nq - q0) : 16;
        if (m != configured) {
            configure_attn(m);
            configured = m;
        }
        // scores of these m rows, two blocks of 16 keys a pass
        for (int64_t b0 = 0; b0 < nk / 16; b0 += 2) {
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t c = 0; c < nd; c++) {
                _tile_loadd(4, top + q0 * D + 32 * c, 2 * D);
                _tile_loadd(5, rest + q0 * D + 32 * c, 2 * D);
                _tile_loadd(6, kb + (b0 * nd + c) * 256, 64);
                _tile_loadd(7, kb + ((b0 + 1) * nd + c) * 256, 64);
                DP2(0, 6);
                DP2(1, 7);
            }
            _tile_stored(0, sc + 16 * b0, 4 * nk);
            _tile_stored(1, sc + 16 * b0 + 16, 4 * nk);
        }
        // each row's softmax: (max, sum) into its partial, its weights (zero past n) split
        for (int i = 0; i < m; i++) {
            float *row = sc + i * nk;
            if (softcap > 0.0f) softcap_row(row, n, softcap);
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t t = 0; t < n; t += 16)
                mx = _mm512_mask_max_ps(mx, lanes_below(n - t), mx, _mm512_loadu_ps(row + t));
            const float shift = _mm512_reduce_max_ps(mx);
            const __m512 sh = _mm512_set1_ps(shift);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < nk; t += 32) {
                const __m512 e0 = _mm512_maskz_mov_ps(
                    lanes_below(n - t), exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), sh)));
                const __m512 e1 = _mm512_maskz_mov_ps(
                    lanes_below(n - t - 16),
                    exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t + 16), sh)));
                sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
                store_bf16_split(e0, e1, wt + i * nk + t, wr + i * nk + t);
            }
            parts[q0 + i][0] = shift;
            parts[q0 + i][1] = _mm512_reduce_add_ps(sum);
        }
        // their weighted values, 64 dims a pass (4 C tiles; 2 for the last 32 of D % 64)
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int nb = D - d0 < 64 ? 2 : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kp = 0; kp < nk / 32; kp++) {
                const uint16_t *blk = vb + (kp * nd16 + d0 / 16) * 512;
                _tile_loadd(4, wt + 32 * kp, 2 * nk);
                _tile_loadd(5, wr + 32 * kp, 2 * nk);
                _tile_loadd(6, blk, 64);
                _tile_loadd(7, blk + 512, 64);
                DP2(0, 6);
                DP2(1, 7);
                if (nb == 4) {
                    _tile_loadd(6, blk + 1024, 64);
                    _tile_loadd(7, blk + 1536, 64);
                    DP2(2, 6);
                    DP2(3, 7);
                }
            }
            _tile_stored(0, out, 256);
            _tile_stored(1, out + 16, 256);
            if (nb == 4) {
                _tile_stored(2, out + 32, 256);
                _tile_stored(3, out + 48, 256);
            }
            for (int i = 0; i < m; i++)  // (memcpy's rep movsq was 5% of this function)
                for (int c = 0; c < nb; c++)
                    _mm512_storeu_ps(parts[q0 + i] + 2 + d0 + 16 * c,
                                     _mm512_load_ps(out + 64 * i + 16 * c));
        }
    }
    amx_scratch_put(top);
    return 0;
}
