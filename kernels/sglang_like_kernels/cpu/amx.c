// Matmuls on Intel AMX tiles (Sapphire Rapids and later), in four files:
//   amx_q4_codes.c  int4 weights in torch's own x86 pack (the int4 linears) below 256 rows:
//             the codes as exact bf16 integers against activations put on a grid
//   amx_q4.c  the same weights for prefill chunks: a bf16 kernel
//   amx_q8.c  block-int8 weights (the LM head)
//   amx.c     (this file) what they share: the OS permission, tile configuration, scratch
//
// Threads: OpenMP in the caller's team (torch's libgomp). Linux hands AMX tile state to a
// process only on request (arch_prctl ARCH_REQ_XCOMP_PERM): `amx_init` asks once. Each call
// loads its tile configuration and leaves it loaded (no tilerelease: a decode step makes 120
// calls; whoever uses the tiles next configures them).
//
// Every kernel computes each output row on its own, in an order that does not depend on the
// batch: a row's result is the same alone or among 64.

#define _GNU_SOURCE  // syscall()
#include "amx.h"

#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define SCRATCH_KEEP (512 * 1024)

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static __thread void *scratch_buf[2];
static __thread size_t scratch_cap[2];

void *amx_scratch_get(int slot, size_t bytes) {
    bytes = (bytes + 63) & ~(size_t)63;
    if (bytes > SCRATCH_KEEP) return aligned_alloc(64, bytes);
    if (scratch_cap[slot] < bytes) {
        free(scratch_buf[slot]);
        scratch_buf[slot] = aligned_alloc(64, SCRATCH_KEEP);
        scratch_cap[slot] = scratch_buf[slot] ? SCRATCH_KEEP : 0;
    }
    return scratch_buf[slot];
}

void amx_scratch_put(void *p) {
    if (p != scratch_buf[0] && p != scratch_buf[1]) free(p);
}

void amx_configure(const int rows[8], const int colsb[8]) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = (uint16_t)colsb[t];
    }
    // not _tile_loadconfig: gcc 12 declares its operand as 8 bytes of memory, so the stores
    // that fill the other 56 bytes may be dropped as dead (they were here: a #GP on ldtilecfg)
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// 0 when this process may use AMX tiles (the permission is per process).
int amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

const char *amx_isa(void) { return "amx_bf16"; }
