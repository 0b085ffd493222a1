/*
 * The AVX-512 pass of activation quantization (generic/act_quant.c): one token's row to int8 codes, its
 * scales and group sums, fused (no float copy of the row), bit-identical to the portable path.
 */
#include "lowbit_kernels.h"
#ifdef AIPC_X86
#include "lowbit_avx512.h"

/* 16 activations x[i..i+15] (fp32, bf16 or fp16) as float32. */
static inline T512 __m512 load16_act(const void *x, int64_t i, int dt) {
    if (dt == AIPC_DT_F32) return _mm512_loadu_ps((const float *)x + i);
    return half16_to_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i)), dt);
}

/* quantize_span + group sums for one row, fused: per span an absmax pass over x (or the `given` absmax,
 * then with quantize_span's clamp), then one pass that rounds (same arithmetic as quantize_span:
 * bit-identical codes and scales), stores the int8 codes and sums them per weight group. G is a
 * multiple of 16 (the 2-bit chunk). */
T512 void act_row_avx512(const void *x, int dt, int64_t K, int64_t G, int64_t act_group, const float *given,
                         float *row, int8_t *q, float *sx, int32_t *gsum) {
    (void)row; /* one pass over x: no float copy */
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (int64_t a0 = 0; a0 < K; a0 += act_group) {
        float amax;
        if (given) {
            amax = *given;
        } else {
            __m512i mx = _mm512_setzero_si512(); /* max of |x| bit patterns, as quantize_span */
            for (int64_t k = a0; k < a0 + act_group; k += 16)
                mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_castps_si512(load16_act(x, k, dt)), absmask));
            const uint32_t abits = (uint32_t)_mm512_reduce_max_epu32(mx);
            memcpy(&amax, &abits, 4);
        }
        const float inv_s = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
        const __m512 inv = _mm512_set1_ps(inv_s);
        for (int64_t g = a0 / G; g < (a0 + act_group) / G; g++) {
            __m512i sum = _mm512_setzero_si512();
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                __m512 p = _mm512_mul_ps(load16_act(x, k, dt), inv);
                if (given) p = _mm512_min_ps(_mm512_max_ps(p, lo), hi);
                /* round to nearest even, as the magic-number rounding of quantize_span: same codes */
                const __m512i v = _mm512_cvt_roundps_epi32(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(v));
                sum = _mm512_add_epi32(sum, v);
            }
            sx[g] = scale;
            gsum[g] = _mm512_reduce_add_epi32(sum);
        }
    }
}
#endif /* AIPC_X86 */
