// What kquants.c (VNNI / AVX2 kernels) and amx_kq.c (AMX tiles) share: the six kinds of
// GGUF codes, their record layout (kquants.c's header says it in full) and the AVX-512
// expansion of a record's codes into the 8 vectors that are both `vpdpbusd`'s operands and
// the rows of an AMX B tile.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#define XQK 32
#define KQ_ROWS 16

enum { KQ_Q4M, KQ_IQ4, KQ_Q5O, KQ_Q5M, KQ_Q6, KQ_Q8, KQ_KINDS };
enum { MODE_MIN32, MODE_OFF32, MODE_OFF16 };

static const int KQ_BITS[KQ_KINDS] = {4, 4, 5, 5, 6, 8};
static const int KQ_MODE[KQ_KINDS] = {MODE_MIN32, MODE_OFF32, MODE_OFF32, MODE_MIN32,
                                      MODE_OFF16, MODE_OFF32};
static const int KQ_OFF[KQ_KINDS] = {0, 128, 16, 0, 32, 128};
// IQ4_NL's 16 values (ggml's kvalues_iq4nl), and the same + 128 for the unsigned dot
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

static inline int code_bytes(int bits) { return bits == 8 ? 512 : 256 + 64 * (bits - 4); }
static inline int scale_bytes(int mode) { return mode == MODE_OFF32 ? 32 : 64; }

// bytes of one record (16 rows x 32 columns) of `kind`; -1 for no such kind. KQ_Q4M's record
// is byte for byte q4_rows.c's x16 record (nibbles, then fp16 d and m).
static inline int kq_record_size(int kind) {
    if (kind < 0 || kind >= KQ_KINDS) return -1;
    return code_bytes(KQ_BITS[kind]) + scale_bytes(KQ_MODE[kind]);
}

// q [K] int8 -> qs [K/16]: the sums the offset kinds take off
static inline void kq_sums16(const int8_t *q, int64_t K, int32_t *qs) {
    for (int64_t h = 0; h < K / 16; h++) {
        int32_t s = 0;
        for (int j = 0; j < 16; j++) s += q[16 * h + j];
        qs[h] = s;
    }
}

#ifdef __AVX512BW__
// the 8 vectors of one record's codes for 16 rows (unsigned bytes; IQ4 as value + 128):
// byte 4r + j of c[t] is code[r][4t + j]
static inline __attribute__((always_inline)) void kq_expand16(const uint8_t *rec, int kind,
                                                              __m512i c[8]) {
    const int bits = KQ_BITS[kind];
    if (bits == 8) {
        for (int t = 0; t < 8; t++) c[t] = _mm512_loadu_si512((const void *)(rec + 64 * t));
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) {
        const __m512i v = _mm512_loadu_si512((const void *)(rec + 64 * t));
        c[t] = _mm512_and_si512(v, low);
        c[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if (kind == KQ_IQ4) {
        const __m512i table = _mm512_broadcast_i32x4(_mm_add_epi8(
            _mm_loadu_si128((const __m128i *)IQ4_VALUES), _mm_set1_epi8((char)0x80)));
        for (int t = 0; t < 8; t++) c[t] = _mm512_shuffle_epi8(table, c[t]);
    }
    for (int p = 0; p < bits - 4; p++) {
        const __m512i plane = _mm512_loadu_si512((const void *)(rec + 256 + 64 * p));
        const __m512i add = _mm512_set1_epi8((char)(16 << p));
        for (int t = 0; t < 8; t++) {
            const __mmask64 k = _mm512_test_epi8_mask(plane, _mm512_set1_epi8((char)(1 << t)));
            c[t] = _mm512_mask_add_epi8(c[t], k, c[t], add);
        }
    }
}
#endif
