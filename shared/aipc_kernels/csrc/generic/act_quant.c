/*
 * Activation quantization of the low-bit linear layer: x[M, K] (fp32, bf16 or fp16) to int8 codes with
 * absmax scales per token or per K-group, and the codes' sums per weight group (the zero correction of
 * lowbit_kernels.h), per token with the dispatch table's kernel for the ISA (dispatch.h): the portable body
 * of act_quant.h compiled here and for AVX2 (x86/act_quant_avx2.c), or AVX-512's fused pass
 * (x86/act_quant_avx512.c).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "act_quant.h"
#include "dispatch.h"
#include "lowbit_kernels.h"

/* The portable one-token kernel for CPUs without a SIMD unit of their own (the dispatch table's scalar entry). */
void act_row_scalar(const void *x, int dt, int64_t K, int64_t G, int64_t act_group, const float *given, float *row,
                    int8_t *q, float *sx, int32_t *gsum) {
    act_row_portable(x, dt, K, G, act_group, given, row, q, sx, gsum);
}

/* Row m of quantize_activations with the table's kernel; `row`: a float scratch of K values (NULL when the
 * kernel needs none). */
static void quantize_row(const act_row_kernel *kernel, const void *x, int dt, int64_t m, int64_t K, int64_t G,
                         int64_t act_group, const float *amax, float *row, int8_t *xq, float *sx, int32_t *gsum) {
    const int64_t ng = K / G;
    const void *xm = (const char *)x + m * K * (dt == AIPC_DT_F32 ? 4 : 2);
    const float *given = amax ? amax + m : NULL; /* per token only (act_group == K): one span */
    kernel->run(xm, dt, K, G, act_group, given, row, xq + m * K, sx + m * ng, gsum + m * ng);
}

/* Quantizes x[M, K] to int8 with absmax scales per token (act_group == K) or per K-group.
 * amax: NULL, or [M] the absmax of each token to use instead of its own (act_group == K only; e.g. the
 * whole row's when x is one tensor-parallel rank's slice of it): scale amax / 127, codes clamped to
 * [-127, 127]. xq: [M][K]; sx: [M][K/G] scale of each weight group; gsum: [M][K/G] group sums of xq.
 * The dispatch table's kernel per token (AVX-512: one fused pass, no float copy of the row).
 * One row (decode) is quantized by the calling thread: a parallel region, even an inactive one,
 * costs about half as much as the row itself (0.35 us of 0.6 us at K=4096). */
int quantize_activations(const void *x, int dt, int64_t M, int64_t K, int64_t G, int64_t act_group, const float *amax,
                         int8_t *xq, float *sx, int32_t *gsum, int nthreads) {
    const act_row_kernel *kernel = aipc_kernels()->act_row;
    const int need_row = kernel->needs_row;
    if (M == 1) {
        float *row = need_row ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;
        if (need_row && !row) return AIPC_ERR_NOMEM;
        quantize_row(kernel, x, dt, 0, K, G, act_group, amax, row, xq, sx, gsum);
        free(row);
        return AIPC_OK;
    }
    int status = AIPC_OK;
#pragma omp parallel num_threads(nthreads)
    {
        float *row = need_row ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;
        if (need_row && !row) {
#pragma omp atomic write
            status = AIPC_ERR_NOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            if (row || !need_row) quantize_row(kernel, x, dt, m, K, G, act_group, amax, row, xq, sx, gsum);
        free(row);
    }
    return status;
}
