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

// ---- int4 kernels (amx_q4.c, amx_q4_codes.c): torch's AVX-512 int4 pack -----------------

// The (scale, zero) of 32 outputs n0.. in group g: sz bf16 [K/group, N, 2] holds, per
// output, a dword scale | zero << 16
static inline void load_scale_zero(const uint16_t *sz, int64_t g, int64_t N, int64_t n0,
                                   __m512 s[2], __m512 z[2]) {
    const __m512i hi16 = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int t = 0; t < 2; t++) {
        const __m512i p = _mm512_loadu_si512(sz + (g * N + n0 + 16 * t) * 2);
        s[t] = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
        z[t] = _mm512_castsi512_ps(_mm512_and_si512(p, hi16));
    }
}

// Block b's codes of the next 64-row block (next_codes, NULL for none), K / 2 cache lines
// over both halves' blocks, so that streaming the weights overlaps the tile work (without
// it one row ran at half torch's speed; docs/cpu-kernels.md)
static inline void prefetch_next_codes(const uint8_t *next_codes, int half, int64_t nb,
                                       int64_t b) {
    if (!next_codes) return;
    const uint8_t *line = next_codes + (half * nb + b) * 8 * 64;
    for (int l = 0; l < 8; l++) _mm_prefetch((const char *)(line + 64 * l), _MM_HINT_T0);
}

// `rows` rows of 32 fp32 accumulators (two 16-wide halves) -> bf16 y rows at column n0
static inline void store_rows_bf16(__m512 (*acc)[2], int rows, uint16_t *y, int64_t ldy,
                                   int64_t n0) {
    for (int i = 0; i < rows; i++)
        for (int t = 0; t < 2; t++)
            _mm256_storeu_si256((__m256i *)(y + i * ldy + n0 + 16 * t),
                                (__m256i)_mm512_cvtneps_pbh(acc[i][t]));
}

// Up to this many rows the integer-activation kernels (amx_q4_codes.c, amx_q8.c) run their
// dots on AVX-512 VNNI over the same B operands instead of the tiles, whose fixed cost per
// block dominates a few rows (one row waited on each block's tdp -> store -> epilogue
// chain); the integer sums are exact, so the results are bit for bit the tiles'.
#define VNNI_MAX_ROWS 4
