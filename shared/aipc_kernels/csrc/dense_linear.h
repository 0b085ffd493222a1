/*
 * Internals shared by the small-M dense linear units (not part of the C API, see aipc_native.h):
 * the tile sizes, the arguments every tile reads, and the per-ISA tile functions. generic/dense_linear.c
 * holds the entry point, the threading and the portable tile; x86/dense_linear_avx512.c and
 * x86/dense_linear_avx2.c the SIMD ones (entries of the dispatch table, dispatch.h).
 */
#ifndef AIPC_DENSE_LINEAR_H
#define AIPC_DENSE_LINEAR_H

#include <math.h>
#include <stdint.h>

#include "aipc_native.h"
#include "half_float.h"

#if defined(__x86_64__) || defined(_M_X64)
#define DENSE_X86 1
#endif

/* Output rows (weight rows) per tile: the unit threads split, streamed once for every token. */
#define DENSE_NB 4
/* Tokens per register block: DENSE_MB x DENSE_NB accumulators (AVX-512: 16 of 32 registers). */
#define DENSE_MB 4
/* K padding of the float32 copy of x (and of a converted weight tile): one 512-bit vector. */
#define DENSE_KPAD 16
/* K padding of the bf16 copy of x (the AVX512-BF16 path): one 512-bit vector of bf16. */
#define DENSE_KPAD_BF16 32

typedef struct {
    const float *xf;  /* [M][Kp] float32 copy of x, zero past K (NULL on the bf16 path) */
    const uint16_t *xb; /* [M][Kb] bf16 copy of x, zero past K: bf16 x and weights on AVX512-BF16, else NULL */
    const void *w;    /* [N][K] weights, row-major, in wdt */
    const void *bias; /* [N] in dt, or NULL */
    void *y;          /* [M][ldy] in dt: this weight's first output column */
    const void *res;  /* residual added after rounding, laid out as y, or NULL */
    int64_t M, K, Kp, Kb, N, ldy;
    int dt, wdt;
} dense_args;

/* Bytes per element of a float32 / bf16 / fp16 array. */
static inline int64_t dense_elem_bytes(int dt) { return dt == AIPC_DT_F32 ? 4 : 2; }

/* Element i of a float32 / bf16 / fp16 array, as float32. */
static inline __attribute__((always_inline)) float dense_load_f32(const void *p, int dt, int64_t i) {
    return dt == AIPC_DT_F32    ? ((const float *)p)[i]
           : dt == AIPC_DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i])
                                : f16_to_f32(((const uint16_t *)p)[i]);
}

/* v rounded to dtype dt and back (identity for float32). */
static inline __attribute__((always_inline)) float dense_round(float v, int dt) {
    return dt == AIPC_DT_F32 ? v : dt == AIPC_DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : f16_to_f32(f32_to_f16(v));
}

/* y[m][n] = v + bias[n], rounded to the output dtype (then + residual[m][n], rounded again). Always inlined:
 * called out of line from the AVX-512 tiles, it made a decode step of llama-150m 40% slower. */
static inline __attribute__((always_inline)) void dense_store(const dense_args *a, int64_t m, int64_t n, float v) {
    if (a->bias) v += dense_load_f32(a->bias, a->dt, n);
    const int64_t i = m * a->ldy + n;
    if (a->res) v = dense_round(v, a->dt) + dense_load_f32(a->res, a->dt, i);
    if (a->dt == AIPC_DT_F32)
        ((float *)a->y)[i] = v;
    else if (a->dt == AIPC_DT_BF16)
        ((uint16_t *)a->y)[i] = f32_to_bf16(v);
    else
        ((uint16_t *)a->y)[i] = f32_to_f16(v);
}

/* One value of x after the prologue (see aipc_prologue), k-th of the row starting at element `row`, in
 * float32: rounded to dt where the modules it replaces round (an RMSNorm's normalized row and its product with
 * gamma; SiLU's output and its product with the up half). inv: the row's 1 / sqrt(mean(x^2) + eps). The
 * portable prologue, and the AVX2 one's tail. */
static inline __attribute__((always_inline)) float dense_prologue_value(const void *x, int dt, int64_t row, int64_t k,
                                                                        int64_t K, int pro, const void *gamma,
                                                                        float inv) {
    const float v = dense_load_f32(x, dt, row + k);
    if (pro == AIPC_PRO_RMSNORM) return dense_round(dense_load_f32(gamma, dt, k) * dense_round(v * inv, dt), dt);
    if (pro == AIPC_PRO_SILU_MUL) return dense_round(dense_round(v / (1.f + expf(-v)), dt) * dense_load_f32(x, dt, row + K + k), dt);
    return v;
}

/* The outputs of weight rows [n0, n0 + nb) for every token; wtile: a per-thread scratch of
 * DENSE_NB * Kp floats (a tile converted to float32 once when several token blocks read it). */
typedef void (*dense_tile_fn)(const dense_args *a, int64_t n0, int nb, float *wtile);

void dense_tile_scalar(const dense_args *a, int64_t n0, int nb, float *wtile);
#ifdef DENSE_X86
void dense_tile_avx512(const dense_args *a, int64_t n0, int nb, float *wtile);
void dense_tile_avx2(const dense_args *a, int64_t n0, int nb, float *wtile);
/* AVX-512 prologue (aipc_prologue) of one row of x: sum of x^2 over K values from element `row`, and the K
 * prologue values written as float32 to dstf or, when dstf is NULL, as bf16 to dstb. */
float dense_sumsq_avx512(const void *x, int dt, int64_t row, int64_t K);
void dense_prologue_avx512(float *dstf, uint16_t *dstb, const void *x, int dt, int64_t row, int64_t K, int pro,
                           const void *gamma, float inv);
/* The same with AVX2 (client CPUs without AVX-512). */
float dense_sumsq_avx2(const void *x, int dt, int64_t row, int64_t K);
void dense_prologue_avx2(float *dstf, uint16_t *dstb, const void *x, int dt, int64_t row, int64_t K, int pro,
                         const void *gamma, float inv);
#endif

#endif /* AIPC_DENSE_LINEAR_H */
