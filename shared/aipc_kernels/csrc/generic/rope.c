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
 * [B][L][H][D]. Threads over the B * L rows when there is enough work (prefill), else one. The row loops
 * (rope.h) are the dispatch table's for the ISA (dispatch.h).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "dispatch.h"
#include "rope.h"

#define ROPE_MIN_PARALLEL (1 << 15) /* elements below which one thread does the whole call (decode) */

/* The row loops for the build's baseline ISA: the dispatch table's scalar entry (x86/ has the SIMD ones). */
ROPE_ROWS_INSTANCE(rope_rows_scalar, )

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
    const rope_rows *rows = aipc_kernels()->rope;
    const rope_row_f32_fn row_f32 = rows->f32;
    const rope_row_bf16_fn row_bf16 = rows->bf16;
    if (dt == AIPC_DT_F32) {
        ROPE_ROWS(row_f32, float)
    } else if (dt == AIPC_DT_BF16) {
        ROPE_ROWS(row_bf16, uint16_t)
    } else {
        ROPE_ROWS(row_f16, uint16_t)
    }
    return AIPC_OK;
}
