/*
 * Rotary position embedding as transformers' apply_rotary_pos_emb computes it, in one pass:
 *
 *   out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[R/2 : R], x[0 : R/2])
 *
 * over the first R of each head's D dimensions (the other D - R are copied: Phi-3's partial rotary). Each
 * product and the sum are rounded to x's dtype, as torch's three element-wise ops round them, so the
 * output is bit-identical to theirs (the build's -ffp-contract=off keeps the products apart from the
 * sum). x: [B][L][H][D] with element strides (sb, sl, sh), last dimension dense; cos, sin: [Bc][L][R]
 * dense in x's dtype, Bc = 1 (shared by the batch: cstride 0) or B (cstride L * R); out: dense
 * [B][L][H][D]. Threads over the B * L rows when there is enough work (prefill), else one.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "aipc_native.h"
#include "half_float.h"

#define ROPE_MIN_PARALLEL (1 << 15) /* elements below which one thread does the whole call (decode) */

#if defined(__x86_64__) || defined(_M_X64)
/* one copy per ISA, chosen at load (GCC's ifunc): the row loops vectorize to the CPU's widest vectors */
#define ROPE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ROPE_CLONES
#endif

/* half_float.h's f32_to_bf16 (round to nearest even, NaN quieted) without its branch, so that loops vectorize */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t nan = (u >> 16) | 0x40u, rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rne);
}

static inline float bf16_value(float f) { return bf16_to_f32(bf16_round(f)); }

/* One position of a float32 x: its H heads against one row of cos / sin. */
static ROPE_CLONES void row_f32(const float *x, int64_t sh, const float *c, const float *s, float *o, int64_t H,
                                int64_t D, int64_t R) {
    const int64_t half = R / 2;
    for (int64_t h = 0; h < H; h++) {
        const float *xh = x + h * sh;
        float *oh = o + h * D;
        for (int64_t d = 0; d < half; d++) oh[d] = xh[d] * c[d] + -xh[d + half] * s[d];
        for (int64_t d = half; d < R; d++) oh[d] = xh[d] * c[d] + xh[d - half] * s[d];
        for (int64_t d = R; d < D; d++) oh[d] = xh[d];
    }
}

/* The same for bfloat16: each product and the sum rounded to bfloat16. */
static ROPE_CLONES void row_bf16(const uint16_t *x, int64_t sh, const uint16_t *c, const uint16_t *s, uint16_t *o,
                                 int64_t H, int64_t D, int64_t R) {
    const int64_t half = R / 2;
    for (int64_t h = 0; h < H; h++) {
        const uint16_t *xh = x + h * sh;
        uint16_t *oh = o + h * D;
        for (int64_t d = 0; d < half; d++)
            oh[d] = bf16_round(bf16_value(bf16_to_f32(xh[d]) * bf16_to_f32(c[d])) +
                               bf16_value(-bf16_to_f32(xh[d + half]) * bf16_to_f32(s[d])));
        for (int64_t d = half; d < R; d++)
            oh[d] = bf16_round(bf16_value(bf16_to_f32(xh[d]) * bf16_to_f32(c[d])) +
                               bf16_value(bf16_to_f32(xh[d - half]) * bf16_to_f32(s[d])));
        for (int64_t d = R; d < D; d++) oh[d] = xh[d];
    }
}

/* The same for float16 (scalar conversions: a CPU model rarely runs in float16). */
static void row_f16(const uint16_t *x, int64_t sh, const uint16_t *c, const uint16_t *s, uint16_t *o, int64_t H,
                    int64_t D, int64_t R) {
    const int64_t half = R / 2;
    for (int64_t h = 0; h < H; h++) {
        const uint16_t *xh = x + h * sh;
        uint16_t *oh = o + h * D;
        for (int64_t d = 0; d < R; d++) {
            const float rot = d < half ? -f16_to_f32(xh[d + half]) : f16_to_f32(xh[d - half]);
            const float a = f16_to_f32(f32_to_f16(f16_to_f32(xh[d]) * f16_to_f32(c[d])));
            const float b = f16_to_f32(f32_to_f16(rot * f16_to_f32(s[d])));
            oh[d] = f32_to_f16(a + b);
        }
        for (int64_t d = R; d < D; d++) oh[d] = xh[d];
    }
}

#define ROPE_ROWS(ROW, T)                                                                                           \
    _Pragma("omp parallel for schedule(static) num_threads(nt)") for (int64_t r = 0; r < B * L; r++) {            \
        const int64_t b = r / L, l = r % L, co = b * cstride + l * R;                                               \
        ROW((const T *)x + b * sb + l * sl, sh, (const T *)cos + co, (const T *)sin + co, (T *)out + r * H * D, H, \
            D, R);                                                                                                  \
    }

AIPC_API int aipc_rope(const void *x, int dt, int64_t B, int64_t L, int64_t H, int64_t D, int64_t sb, int64_t sl,
                       int64_t sh, const void *cos, const void *sin, int64_t cstride, int64_t R, void *out,
                       int nthreads) {
    if (!x || !cos || !sin || !out) return AIPC_ERR_NULL;
    if (dt < 0 || dt >= AIPC_DT_COUNT) return AIPC_ERR_DTYPE;
    if (B < 0 || L < 0 || H < 0 || D <= 0 || R <= 0 || R > D || R % 2) return AIPC_ERR_SHAPE;
    if (nthreads < 0 || nthreads > AIPC_MAX_THREADS) return AIPC_ERR_THREADS;
    const int nt = B * L * H * R < ROPE_MIN_PARALLEL ? 1 : nthreads > 0 ? nthreads : omp_get_max_threads();
    if (dt == AIPC_DT_F32) {
        ROPE_ROWS(row_f32, float)
    } else if (dt == AIPC_DT_BF16) {
        ROPE_ROWS(row_bf16, uint16_t)
    } else {
        ROPE_ROWS(row_f16, uint16_t)
    }
    return AIPC_OK;
}
