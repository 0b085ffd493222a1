/*
 * Internals shared by the segment attention units (not part of the C API, see aipc_native.h): the block
 * sizes and the per-ISA table of the kernel's inner steps. generic/segment_sdpa.c holds the kernel and
 * its portable steps, x86/segment_sdpa_avx512.c and x86/segment_sdpa_avx2.c the SIMD ones.
 */
#ifndef AIPC_SEGMENT_SDPA_H
#define AIPC_SEGMENT_SDPA_H

#include <stdint.h>

#include "aipc_native.h"

#if defined(__x86_64__) || defined(_M_X64)
#define SEG_X86 1
#endif

#define KB 32 /* key positions per block */
/* Several rows at once (RB at most): each key block and value row loaded once for all of them, and
 * RB x 2 (dots) or RB x 4 (accum) independent FMA chains, where one row alone waits on FMA latency. */
#define RB 4

typedef void (*cvt_fn)(float *, const void *, int, int64_t);
typedef void (*dots_fn)(float *, const float *, const float *, int, int64_t);
typedef float (*softmax_fn)(float *, const float *, float, int);
typedef void (*accum_fn)(float *, float, const float *, const float *const *, int, int64_t);
typedef void (*keys_fn)(float *, const char *const *, int, int, int64_t);
typedef void (*dots_rows_fn)(float *, const float *, const float *, int, int64_t);
typedef void (*accum_rows_fn)(float *, const float *, const float *, const void *const *, int, int, int, int64_t);

typedef struct {
    cvt_fn cvt;
    dots_fn dots;   /* one row (row_block): used where dots_rows is NULL */
    softmax_fn softmax;
    accum_fn accum; /* one row, as dots */
    keys_fn keys_transposed; /* NULL: the portable per-key loop of load_block */
    dots_rows_fn dots_rows;   /* NULL: one row at a time */
    accum_rows_fn accum_rows;
} seg_isa;

/* generic/segment_sdpa.c: the portable steps the SIMD tables reuse. */
void cvt_scalar(float *dst, const void *src, int dt, int64_t D);
float softmax_scalar(float *p, const float *sc, float m, int n);

/* The step tables, entries of the dispatch table (dispatch.h): generic/segment_sdpa.c (portable, one row
 * at a time), x86/segment_sdpa_avx2.c (one row at a time), x86/segment_sdpa_avx512.c (several rows). */
extern const seg_isa seg_isa_scalar;
#ifdef SEG_X86
extern const seg_isa seg_isa_avx512, seg_isa_avx2;
#endif

#endif /* AIPC_SEGMENT_SDPA_H */
