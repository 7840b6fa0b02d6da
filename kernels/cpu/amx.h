// Shared by the AMX kernels (amx.c, amx_q4.c, amx_q8.c): tile configuration and scratch.
#pragma once

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// Load a palette-1 tile configuration: tile t (t < 8) has rows[t] rows of colsb[t] bytes.
void amx_configure(const int rows[8], const int colsb[8]);

// Per-thread scratch that outlives a call (a decode step makes 120 calls; allocating and
// freeing their buffers each time measured as much as the work of a small matrix). Slot 0
// is used inside parallel regions, slot 1 by the calling thread. Requests above 512 KB
// (prefill-sized activations) are allocated for the call alone: pass every pointer back
// to amx_scratch_put.
void *amx_scratch_get(int slot, size_t bytes);
void amx_scratch_put(void *p);

// 32 floats (lo: the first 16) as bf16 to top[0..32) and the bf16 rounding of what that
// left out to rest[0..32): top + rest keeps 16 bits of each value
static inline void store_bf16_split(__m512 lo, __m512 hi, uint16_t *top, uint16_t *rest) {
    const __m512i t = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    const __m512 t_lo = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(t)), 16));
    const __m512 t_hi = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(t, 1)), 16));
    _mm512_storeu_si512(top, t);
    _mm512_storeu_si512(rest, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(hi, t_hi),
                                                           _mm512_sub_ps(lo, t_lo)));
}

// ---- integer kernels (amx_q4.c, amx_q8.c): activations as two int8 parts --------------------
//
// A block of 32 activations is taken as e * (q + r / 256) with one scale e = amax / 127:
// q = round(x / e) (|q| <= 127, llama.cpp's activation rounding) and r the rounded rest in
// 256ths of e, so the activations keep about 15 bits. The weights go in as unsigned bytes,
// regrouped into B tiles of 8 rows x 64 bytes (row kq: for each of 16 output columns, the
// bytes at k = 4kq .. 4kq + 3), and each block's two integer dots (q and r against the
// weights) come out as int32 C rows of 16 output columns, which the caller scales.

// 32 floats (v0: the first 16) -> q[0..32), r[0..32); returns e, and the sums of q and r
static inline float split_int8_block(__m512 v0, __m512 v1, int8_t *q, int8_t *r,
                                     int32_t *qsum, int32_t *rsum) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float scale = amax / 127.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    const __m512 v[2] = {v0, v1};
    __m128i qb[2], rb[2];
    __m512i sum = _mm512_setzero_si512(), rs = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        // x / e, its nearest integer, and the remainder in 256ths
        const __m512 u = _mm512_mul_ps(v[h], _mm512_set1_ps(inv));
        const __m512i qi = _mm512_cvtps_epi32(u);
        const __m512 rest = _mm512_mul_ps(_mm512_sub_ps(u, _mm512_cvtepi32_ps(qi)),
                                          _mm512_set1_ps(256.0f));
        const __m512i ri = _mm512_cvtps_epi32(rest);
        qb[h] = _mm512_cvtsepi32_epi8(qi);
        rb[h] = _mm512_cvtsepi32_epi8(ri);
        sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(qb[h]));
        rs = _mm512_add_epi32(rs, _mm512_cvtepi8_epi32(rb[h]));
    }
    _mm256_storeu_si256((__m256i *)q, _mm256_set_m128i(qb[1], qb[0]));
    _mm256_storeu_si256((__m256i *)r, _mm256_set_m128i(rb[1], rb[0]));
    *qsum = _mm512_reduce_add_epi32(sum);
    *rsum = _mm512_reduce_add_epi32(rs);
    return scale;
}

// Up to this many rows the integer dots run on AVX-512 VNNI over the same B tiles (a B row is
// a vpdpbusd operand as it is). Integer sums are exact, so the results are bit for bit the
// tiles'; one row through the tiles waited on each block's tdp -> store -> epilogue chain
// (0.060 ms for an int4 3072x576 against torch's 0.049), here the blocks overlap.
#define VNNI_MAX_ROWS 4

// tmm0, 1: C of q (output tile 0 / 1), tmm6, 7: C of r, tmm2, 5: A (q, r: rows activation
// rows x 32 bytes), tmm3, 4: B
static inline void configure_i8(int rows) {
    const int r[8] = {rows, rows, rows, 8, 8, rows, rows, rows};
    const int colsb[8] = {64, 64, 32, 64, 64, 32, 64, 64};
    amx_configure(r, colsb);
}

// Activation rows m0.. of M as one chunk of at most 16: its row count, and in *tiles whether
// it runs on the tiles (loading their configuration when the row count changed) or on VNNI
static inline int i8_chunk_rows(int64_t M, int64_t m0, int *configured, int *tiles) {
    const int rows = M - m0 < 16 ? (int)(M - m0) : 16;
    *tiles = rows > VNNI_MAX_ROWS;
    if (*tiles && rows != *configured) {
        configure_i8(rows);
        *configured = rows;
    }
    return rows;
}

// One block of 32 columns: c[t] (q) and c[2 + t] (r), rows x 16 int32 each (ld 16), of
// `rows` activation rows (q, r at row stride K) against the two B tiles at b_tiles (output
// tile t at b_tiles + 512 t); on tiles when `tiles` (configure_i8(rows) loaded), else VNNI.
static inline void block_dots_i8(const uint8_t *b_tiles, const int8_t *q, const int8_t *r,
                                 int64_t K, int rows, int tiles, int32_t c[4][256]) {
    if (tiles) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(6);
        _tile_zero(7);
        _tile_loadd(2, q, K);
        _tile_loadd(5, r, K);
        _tile_loadd(3, b_tiles, 64);
        _tile_loadd(4, b_tiles + 512, 64);
        _tile_dpbsud(0, 2, 3);
        _tile_dpbsud(1, 2, 4);
        _tile_dpbsud(6, 5, 3);
        _tile_dpbsud(7, 5, 4);
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(6, c[2], 64);
        _tile_stored(7, c[3], 64);
        return;
    }
    for (int i = 0; i < rows; i++) {
        for (int t = 0; t < 2; t++) {
            const uint8_t *bt = b_tiles + t * 512;
            __m512i dq = _mm512_setzero_si512(), dr = _mm512_setzero_si512();
            for (int kq = 0; kq < 8; kq++) {
                const __m512i w = _mm512_load_si512(bt + kq * 64);
                int32_t q4, r4;
                memcpy(&q4, q + i * K + 4 * kq, 4);
                memcpy(&r4, r + i * K + 4 * kq, 4);
                dq = _mm512_dpbusd_epi32(dq, w, _mm512_set1_epi32(q4));
                dr = _mm512_dpbusd_epi32(dr, w, _mm512_set1_epi32(r4));
            }
            _mm512_store_si512(c[t] + 16 * i, dq);
            _mm512_store_si512(c[2 + t] + 16 * i, dr);
        }
    }
}
