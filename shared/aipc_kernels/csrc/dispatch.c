/*
 * The CPU dispatch table (see dispatch.h): each ISA's own kernels (ENTRIES), the fallback of each ISA
 * (FALLBACK), and the table every entry point reads, filled from both once when the library loads.
 */
#include "dispatch.h"

/* ---------------------------------------------------------------- the W*A8 row-block kernels */

static const lowbit_block_kernel LOWBIT_SCALAR = {block_scalar, 0, 0};
#ifdef AIPC_X86
static const lowbit_block_kernel LOWBIT_AVX2 = {block_avx2, 0, 0, block_avx2_prog};
static const lowbit_block_kernel LOWBIT_AVX_VNNI = {block_avxvnni, 0, 0, block_avxvnni_prog};
static const lowbit_block_kernel LOWBIT_AVX512 = {block_avx512, 1, 1, block_avx512_prog};
#endif

/* ---------------------------------------------------------------- the one-token activation quantizers */

static const act_row_kernel ACT_SCALAR = {act_row_scalar, 1};
#ifdef AIPC_X86
static const act_row_kernel ACT_AVX2 = {act_row_avx2, 1};
static const act_row_kernel ACT_AVX512 = {act_row_avx512, 0};
#endif

/* ---------------------------------------------------------------- each ISA's own kernels */

/* Portable C is complete: every operation has a kernel here or a portable path in its caller (the dense
 * prologue's); the AMX tiles alone have no fallback. */
static const aipc_kernel_set ENTRIES[AIPC_ISA_COUNT] = {
    [AIPC_ISA_SCALAR] = {.lowbit_block = &LOWBIT_SCALAR, .act_row = &ACT_SCALAR, .a16_block = a16_block_scalar,
                         .dense_tile = dense_tile_scalar, .segment = &seg_isa_scalar, .rope = &rope_rows_scalar},
#ifdef AIPC_X86
    [AIPC_ISA_AVX2] = {.lowbit_block = &LOWBIT_AVX2, .act_row = &ACT_AVX2, .a16_block = a16_block_avx2,
                       .dense_tile = dense_tile_avx2, .dense_sumsq = dense_sumsq_avx2,
                       .dense_prologue = dense_prologue_avx2, .segment = &seg_isa_avx2, .rope = &rope_rows_avx2},
    /* VNNI's integer dot products: the W*A8 kernel; the float kernels are AVX2's */
    [AIPC_ISA_AVX_VNNI] = {.lowbit_block = &LOWBIT_AVX_VNNI},
    [AIPC_ISA_AVX512_VNNI] = {.lowbit_block = &LOWBIT_AVX512, .act_row = &ACT_AVX512,
                              .a16_block = a16_block_avx512, .dense_tile = dense_tile_avx512,
                              .dense_sumsq = dense_sumsq_avx512, .dense_prologue = dense_prologue_avx512,
                              .segment = &seg_isa_avx512, .rope = &rope_rows_avx512},
#ifdef AIPC_AMX
    /* tiles from AMX_MIN_M tokens; fewer tokens, and everything else: AVX-512 */
    [AIPC_ISA_AMX_INT8] = {.lowbit_tiles = amx_linear},
#endif
#endif
};

/* Whose kernels an ISA runs where it has none of its own; -1 ends the chain. AVX-512 falls back to AVX2,
 * not AVX-VNNI (server CPUs have AVX-512 VNNI without AVX-VNNI). */
static const int FALLBACK[AIPC_ISA_COUNT] = {
    [AIPC_ISA_SCALAR] = -1,
    [AIPC_ISA_AVX2] = AIPC_ISA_SCALAR,
    [AIPC_ISA_AVX_VNNI] = AIPC_ISA_AVX2,
    [AIPC_ISA_AVX512_VNNI] = AIPC_ISA_AVX2,
    [AIPC_ISA_AMX_INT8] = AIPC_ISA_AVX512_VNNI,
};

/* ---------------------------------------------------------------- the table, filled at load */

static aipc_kernel_set TABLE[AIPC_ISA_COUNT];
static int PROVIDER[AIPC_ISA_COUNT][AIPC_OP_COUNT];

__attribute__((constructor)) static void fill_table(void) {
    for (int isa = 0; isa < AIPC_ISA_COUNT; isa++) {
#define AIPC_KERNEL_FILL(OP, field, type)                                                                            \
    {                                                                                                                \
        int from = isa;                                                                                              \
        while (from >= 0 && !ENTRIES[from].field) from = FALLBACK[from];                                             \
        TABLE[isa].field = from >= 0 ? ENTRIES[from].field : NULL;                                                   \
        PROVIDER[isa][AIPC_OP_##OP] = from;                                                                          \
    }
        AIPC_KERNEL_OPS(AIPC_KERNEL_FILL)
#undef AIPC_KERNEL_FILL
    }
}

const aipc_kernel_set *aipc_kernels(void) { return &TABLE[aipc_get_isa()]; }

int aipc_kernel_isa(aipc_kernel_op op) { return PROVIDER[aipc_get_isa()][op]; }
