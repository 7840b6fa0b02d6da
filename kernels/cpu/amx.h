// Shared by the AMX kernels (amx.c, amx_q4.c, amx_q8.c): tile configuration and scratch.
#pragma once

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

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
