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
