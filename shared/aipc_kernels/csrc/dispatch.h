/*
 * The one CPU dispatch table (not part of the C API): for every ISA of aipc_isa, the kernel of every
 * operation of the library, filled once when the library loads (dispatch.c) from the entries each ISA's
 * units provide and an explicit fallback map (an ISA without its own kernel for an operation runs its
 * fallback's, e.g. AVX-VNNI's float kernels are AVX2's). The entry points ask aipc_kernels() for the
 * current ISA's row (aipc_get_isa: the CPU's best, or the one aipc_set_isa forced).
 *
 * Adding an ISA: its units under x86/ (or a new architecture folder), its value in aipc_isa (aipc_native.h)
 * with its detection (cpu_features.c), and one row of ENTRIES plus its FALLBACK in dispatch.c.
 * Adding an operation: a field here (AIPC_KERNEL_OPS) and an entry in the rows that have a kernel for it.
 */
#ifndef AIPC_DISPATCH_H
#define AIPC_DISPATCH_H

#include "dense_linear.h"
#include "lowbit_a16.h"
#include "lowbit_kernels.h"
#include "rope.h"
#include "segment_sdpa.h"

typedef void (*a16_block_fn)(const a16_args *a, int64_t nb, int use_bf16);
typedef float (*dense_sumsq_fn)(const void *x, int dt, int64_t row, int64_t K);
typedef void (*dense_prologue_fn)(float *dstf, uint16_t *dstb, const void *x, int dt, int64_t row, int64_t K, int pro,
                                  const void *gamma, float inv);

/* X(OP, field, type): every operation of the table. NULL in a row: that ISA has no kernel of its own for
 * it (then its fallback's, or none at all: the caller's portable path). */
#define AIPC_KERNEL_OPS(X)                                                                                           \
    X(LOWBIT_BLOCK, lowbit_block, const lowbit_block_kernel *) /* W*A8 row block, every token */                   \
    X(LOWBIT_TILES, lowbit_tiles, lowbit_tiles_fn)             /* W*A8 all row blocks, from AMX_MIN_M tokens */   \
    X(ACT_ROW, act_row, const act_row_kernel *)                /* int8 activations of one token */                \
    X(A16, a16_block, a16_block_fn)                            /* W4A16 row block, every token */                 \
    X(DENSE_TILE, dense_tile, dense_tile_fn)                   /* dense linear, DENSE_NB weight rows */           \
    X(DENSE_SUMSQ, dense_sumsq, dense_sumsq_fn)                /* RMSNorm prologue: sum of squares of a row */    \
    X(DENSE_PROLOGUE, dense_prologue, dense_prologue_fn)       /* dense prologue of a row */                      \
    X(SEGMENT, segment, const seg_isa *)                       /* segment attention steps */                      \
    X(ROPE, rope, const rope_rows *)                           /* rotary embedding of one position */

typedef struct {
#define AIPC_KERNEL_FIELD(OP, field, type) type field;
    AIPC_KERNEL_OPS(AIPC_KERNEL_FIELD)
#undef AIPC_KERNEL_FIELD
} aipc_kernel_set;

typedef enum {
#define AIPC_KERNEL_ENUM(OP, field, type) AIPC_OP_##OP,
    AIPC_KERNEL_OPS(AIPC_KERNEL_ENUM)
#undef AIPC_KERNEL_ENUM
    AIPC_OP_COUNT
} aipc_kernel_op;

/* The kernels of the current ISA (never NULL; a field is NULL where no ISA down its fallbacks has one). */
const aipc_kernel_set *aipc_kernels(void);
/* The ISA whose kernel the current ISA runs for `op` (itself or a fallback), or -1 where there is none. */
int aipc_kernel_isa(aipc_kernel_op op);

#endif /* AIPC_DISPATCH_H */
