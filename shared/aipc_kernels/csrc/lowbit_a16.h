/*
 * Internals of the activation-exact W4A16 linear (generic/lowbit_a16.c: the entry point and the portable
 * kernel; x86/lowbit_a16_avx2.c, x86/lowbit_a16_avx512.c: the SIMD kernels), not part of the C API.
 */
#ifndef AIPC_LOWBIT_A16_H
#define AIPC_LOWBIT_A16_H

#include "lowbit_kernels.h"

#define A16_M 4 /* tokens per tile: each dequantized vector feeds that many FMAs / dot products */

/* The AVX2 kernel's int dequantization masks the code at k = 8c + p in place: bit offset 8 (p & 3) + 4 (p >> 2)
 * of its lane, the top nibble (p = 7) shifted down. It takes x[k] times A16_INT_SCALE[p], 2^-offset (exact). */
static const float A16_INT_SCALE[8] = {1.f, 0x1p-8f, 0x1p-16f, 0x1p-24f, 0x1p-4f, 0x1p-12f, 0x1p-20f, 1.f};

typedef struct {
    const uint8_t *w;
    const void *scales, *zeros;
    int scale_dt;
    int64_t M, N, K, G;
    float zero_const;
    const float *xf;     /* [M][K] float32 activations (FMA paths; AVX2 int: times A16_INT_SCALE[k % 8]) */
    const uint32_t *xp;  /* [M][K/2] bf16 pairs (k = 8c + kk, 8c + 4 + kk) at [m][4c + kk] (bf16 path) */
    const float *xs;     /* [M][K/G] group sums of x */
    const void *bias;
    void *y;
    int out_dt;
    int dequant;         /* AIPC_DEQUANT_E0M4 or AIPC_DEQUANT_INT */
} a16_args;

/* Constant-MT instances of a tile (the tiles keep MT accumulators in registers). */
#define A16_INSTANCES(NAME, TILE, ATTR)                                                                               \
    static ATTR __attribute__((noinline)) void NAME(const a16_args *a, int64_t nb, int64_t m0, int mt, int e0m4) {    \
        switch (mt * 2 + (e0m4 != 0)) {                                                                               \
        case 2: TILE(a, nb, m0, 1, 0); break;                                                                         \
        case 3: TILE(a, nb, m0, 1, 1); break;                                                                         \
        case 4: TILE(a, nb, m0, 2, 0); break;                                                                         \
        case 5: TILE(a, nb, m0, 2, 1); break;                                                                         \
        case 6: TILE(a, nb, m0, 3, 0); break;                                                                         \
        case 7: TILE(a, nb, m0, 3, 1); break;                                                                         \
        case 8: TILE(a, nb, m0, 4, 0); break;                                                                         \
        default: TILE(a, nb, m0, 4, 1); break;                                                                        \
        }                                                                                                             \
    }

/* Row block nb for every token: portable C (generic/lowbit_a16.c) and the SIMD kernels (x86/); use_bf16:
 * the activations are bf16 pairs in xp (AVX512-BF16 only). Entries of the dispatch table (dispatch.h). */
void a16_block_scalar(const a16_args *a, int64_t nb, int use_bf16);
#ifdef AIPC_X86
void a16_block_avx2(const a16_args *a, int64_t nb, int use_bf16);
void a16_block_avx512(const a16_args *a, int64_t nb, int use_bf16);
#endif

#endif /* AIPC_LOWBIT_A16_H */
