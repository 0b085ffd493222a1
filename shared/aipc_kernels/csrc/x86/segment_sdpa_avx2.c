/*
 * AVX2 (+ FMA, F16C) steps of the segment attention kernel (generic/segment_sdpa.c), one row at a time:
 * conversion, dot products of a block of keys and value accumulation (softmax: the portable step), as
 * the step table seg_isa_avx2.
 */
#include "segment_sdpa.h"
#ifdef SEG_X86
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define T256 __attribute__((target("avx2,f16c,fma")))

static T256 void cvt_256(float *dst, const void *src, int dt, int64_t D) {
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 x;
        if (dt == AIPC_DT_F32) {
            x = _mm256_loadu_ps((const float *)src + d);
        } else {
            __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + d));
            x = dt == AIPC_DT_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
        }
        _mm256_storeu_ps(dst + d, x);
    }
    if (d < D) cvt_scalar(dst + d, (const char *)src + d * (dt == AIPC_DT_F32 ? 4 : 2), dt, D - d);
}

static T256 void dots_256(float *sc, const float *q, const float *kT, int n, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 x = _mm256_set1_ps(q[d]);
        const float *k = kT + d * KB;
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 8), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 16), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 24), a3);
    }
    _mm256_storeu_ps(sc, a0);
    _mm256_storeu_ps(sc + 8, a1);
    _mm256_storeu_ps(sc + 16, a2);
    _mm256_storeu_ps(sc + 24, a3);
    (void)n;
}

static T256 void accum_256(float *acc, float alpha, const float *p, const float *const *v, int n, int64_t D) {
    const __m256 al = _mm256_set1_ps(alpha);
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
        __m256 a0 = _mm256_mul_ps(al, _mm256_loadu_ps(acc + d)), a1 = _mm256_mul_ps(al, _mm256_loadu_ps(acc + d + 8));
        __m256 a2 = _mm256_mul_ps(al, _mm256_loadu_ps(acc + d + 16)), a3 = _mm256_mul_ps(al, _mm256_loadu_ps(acc + d + 24));
        for (int j = 0; j < n; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *vj = v[j] + d;
            a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj), a0);
            a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8), a1);
            a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 16), a2);
            a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0);
        _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2);
        _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d + 8 <= D; d += 8) {
        __m256 a0 = _mm256_mul_ps(al, _mm256_loadu_ps(acc + d));
        for (int j = 0; j < n; j++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v[j] + d), a0);
        _mm256_storeu_ps(acc + d, a0);
    }
    for (; d < D; d++) {
        float a = acc[d] * alpha;
        for (int j = 0; j < n; j++) a += p[j] * v[j][d];
        acc[d] = a;
    }
}

const seg_isa seg_isa_avx2 = {cvt_256, dots_256, softmax_scalar, accum_256, NULL, NULL, NULL};
#endif /* SEG_X86 */
