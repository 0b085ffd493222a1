/*
 * The portable activation quantization of one token (not part of the C API): absmax int8 codes per token
 * or per K-group and the codes' sums per weight group (the zero correction of lowbit_kernels.h), as
 * always-inline bodies that each ISA's unit compiles with its own target (the dispatch table's act_row).
 */
#ifndef AIPC_ACT_QUANT_H
#define AIPC_ACT_QUANT_H

#include <string.h>

#include "lowbit_kernels.h"

/* Row of x in float32 (fp16 through the scalar converter). */
static inline __attribute__((always_inline)) void act_row_to_f32(const void *x, int dt, int64_t K, float *out) {
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
static inline __attribute__((always_inline)) float act_quantize_span(const float *v, int64_t n, const float *given, int8_t *q) {
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

/* One token's row (x: its K values; given: NULL or its absmax) to int8 codes q, the scales sx and group
 * sums gsum of its [K/G] weight groups, through the float32 scratch `row` of K values. Inlined into each
 * unit that compiles it for an ISA (generic/act_quant.c, x86/act_quant_avx2.c), where the loops vectorise
 * to that ISA's vectors: every instance gives the same codes. */
static inline __attribute__((always_inline)) void act_row_portable(const void *x, int dt, int64_t K, int64_t G,
                                                                   int64_t act_group, const float *given, float *row,
                                                                   int8_t *q, float *sx, int32_t *gsum) {
    const int64_t ng = K / G, nag = K / act_group;
    act_row_to_f32(x, dt, K, row);
    for (int64_t a = 0; a < nag; a++) {
        const float scale = act_quantize_span(row + a * act_group, act_group, given, q + a * act_group);
        for (int64_t g = a * act_group / G; g < (a + 1) * act_group / G; g++) sx[g] = scale;
    }
    for (int64_t g = 0; g < ng; g++) {
        int32_t sum = 0;
        for (int64_t k = g * G; k < (g + 1) * G; k++) sum += q[k];
        gsum[g] = sum;
    }
}

#endif /* AIPC_ACT_QUANT_H */
