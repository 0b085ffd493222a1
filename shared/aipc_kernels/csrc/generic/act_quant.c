/*
 * Activation quantization of the low-bit linear layer: x[M, K] (fp32, bf16 or fp16) to int8 codes with
 * absmax scales per token or per K-group, and the codes' sums per weight group (the zero correction of
 * lowbit_kernels.h). Portable C vectorised per CPU by target_clones, or the table's one-pass kernel for the
 * ISA (dispatch.h; x86/act_quant_avx512.c).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "lowbit_kernels.h"

#ifdef AIPC_X86
#define MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MULTIVERSION
#endif

/* Row of x in float32 (vectorised per ISA by target_clones; fp16 through the scalar converter). */
MULTIVERSION static void row_to_f32(const void *x, int dt, int64_t K, float *out) {
    if (dt == AIPC_DT_F32) {
        memcpy(out, x, sizeof(float) * (size_t)K);
    } else if (dt == AIPC_DT_BF16) {
        const uint16_t *p = (const uint16_t *)x;
        uint32_t *o = (uint32_t *)out;
        for (int64_t k = 0; k < K; k++) o[k] = (uint32_t)p[k] << 16;
    } else {
        const uint16_t *p = (const uint16_t *)x;
        for (int64_t k = 0; k < K; k++) out[k] = f16_to_f32(p[k]);
    }
}

/* int8 absmax quantization of one span; returns its scale. Rounds half to even like rintf: adding
 * and removing 1.5 * 2^23 leaves the nearest integer for |v| <= 127 (no libm call, vectorises).
 * `given`: NULL for the span's own absmax, else the absmax to use (may be below the span's: then the
 * codes are clamped to [-127, 127] before rounding, which rounds as the unclamped value would). */
MULTIVERSION static float quantize_span(const float *v, int64_t n, const float *given, int8_t *q) {
    float amax;
    if (given) {
        amax = *given;
    } else {
        /* |v| as bit patterns: for non-negative floats integer order is value order, and an integer
         * max-reduction vectorises where a float one may not (without fast-math) */
        uint32_t abits = 0;
        const uint32_t *u = (const uint32_t *)v;
        for (int64_t k = 0; k < n; k++) {
            const uint32_t a = u[k] & 0x7fffffffu;
            abits = a > abits ? a : abits;
        }
        memcpy(&amax, &abits, 4);
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f, magic = 12582912.f;
    if (!given) { /* |v * inv| <= 127 up to one rounding, which the rounding to an integer absorbs: no clamp */
        for (int64_t k = 0; k < n; k++) q[k] = (int8_t)(int32_t)((v[k] * inv + magic) - magic);
    } else {
        for (int64_t k = 0; k < n; k++) {
            float p = v[k] * inv;
            p = p < -127.f ? -127.f : p > 127.f ? 127.f : p;
            q[k] = (int8_t)(int32_t)((p + magic) - magic);
        }
    }
    return amax / 127.f;
}


/* Row m of quantize_activations; `row` is a float scratch of K values (unused with AVX-512). */
static void quantize_row(const void *x, int dt, int64_t m, int64_t K, int64_t G, int64_t act_group, const float *amax,
                         act_row_fn one_pass, float *row, int8_t *xq, float *sx, int32_t *gsum) {
    const int64_t ng = K / G, nag = K / act_group;
    const void *xm = (const char *)x + m * K * (dt == AIPC_DT_F32 ? 4 : 2);
    int8_t *qm = xq + m * K;
    const float *given = amax ? amax + m : NULL; /* per token only (act_group == K): one span */
    sx += m * ng, gsum += m * ng;
    if (one_pass) {
        one_pass(xm, dt, K, G, act_group, given, qm, sx, gsum);
        return;
    }
    row_to_f32(xm, dt, K, row);
    for (int64_t a = 0; a < nag; a++) {
        const float scale = quantize_span(row + a * act_group, act_group, given, qm + a * act_group);
        for (int64_t g = a * act_group / G; g < (a + 1) * act_group / G; g++) sx[g] = scale;
    }
    for (int64_t g = 0; g < ng; g++) {
        int32_t sum = 0;
        for (int64_t k = g * G; k < (g + 1) * G; k++) sum += qm[k];
        gsum[g] = sum;
    }
}

/* Quantizes x[M, K] to int8 with absmax scales per token (act_group == K) or per K-group.
 * amax: NULL, or [M] the absmax of each token to use instead of its own (act_group == K only; e.g. the
 * whole row's when x is one tensor-parallel rank's slice of it): scale amax / 127, codes clamped to
 * [-127, 127]. xq: [M][K]; sx: [M][K/G] scale of each weight group; gsum: [M][K/G] group sums of xq.
 * With the table's one-pass kernel (AVX-512) no float copy of the row.
 * One row (decode) is quantized by the calling thread: a parallel region, even an inactive one,
 * costs about half as much as the row itself (0.35 us of 0.6 us at K=4096). */
int quantize_activations(const void *x, int dt, int64_t M, int64_t K, int64_t G, int64_t act_group, const float *amax,
                         int8_t *xq, float *sx, int32_t *gsum, int nthreads) {
    const act_row_fn one_pass = aipc_kernels()->act_row;
    const int need_row = !one_pass;
    if (M == 1) {
        float *row = need_row ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;
        if (need_row && !row) return AIPC_ERR_NOMEM;
        quantize_row(x, dt, 0, K, G, act_group, amax, one_pass, row, xq, sx, gsum);
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
            if (row || !need_row) quantize_row(x, dt, m, K, G, act_group, amax, one_pass, row, xq, sx, gsum);
        free(row);
    }
    return status;
}
