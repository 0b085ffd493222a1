/*
 * AVX-512 (F, BW, VL) steps of the segment attention kernel (generic/segment_sdpa.c): conversion, dot
 * products of a block of keys for several rows at once, softmax weights and value accumulation, as the
 * step table seg_isa_avx512.
 */
#include "segment_sdpa.h"
#ifdef SEG_X86
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))

static inline T512 __mmask16 tail16(int64_t rem) {
    return rem >= 16 ? (__mmask16)0xFFFF : rem <= 0 ? (__mmask16)0 : (__mmask16)((1u << rem) - 1);
}

static T512 void cvt_512(float *dst, const void *src, int dt, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) {
        __mmask16 m = tail16(D - d);
        __m512 x;
        if (dt == AIPC_DT_F32) {
            x = _mm512_maskz_loadu_ps(m, (const float *)src + d);
        } else {
            __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)src + d);
            x = dt == AIPC_DT_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
        }
        _mm512_mask_storeu_ps(dst + d, m, x);
    }
}

/* exp(x) for x <= 0 (softmax arguments): Cody-Waite reduction, degree-6 polynomial, scalef; -inf -> 0,
 * NaN -> NaN (as expf: a NaN score or running max must reach the output, as in the reference) */
static inline T512 __m512 exp_512(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x); /* vmaxps returns its second operand, x, for a NaN */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n));
}

static T512 float softmax_512(float *p, const float *sc, float m, int n) {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = tail16(n - j);
        const __m512 e = _mm512_maskz_mov_ps(k, exp_512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + j), mv)));
        _mm512_storeu_ps(p + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}


/* sc[r * KB + j] = q_r . k_j for NR rows of q (D apart) against a transposed block kT[D][KB] */
static inline T512 __attribute__((always_inline)) void dots_rows_n(float *sc, const float *q, const float *kT, int64_t D,
                                                                  const int NR) {
    __m512 a[RB][2];
    for (int r = 0; r < NR; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k0 = _mm512_loadu_ps(kT + d * KB), k1 = _mm512_loadu_ps(kT + d * KB + 16);
        for (int r = 0; r < NR; r++) {
            const __m512 x = _mm512_set1_ps(q[r * D + d]);
            a[r][0] = _mm512_fmadd_ps(x, k0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(x, k1, a[r][1]);
        }
    }
    for (int r = 0; r < NR; r++) {
        _mm512_storeu_ps(sc + r * KB, a[r][0]);
        _mm512_storeu_ps(sc + r * KB + 16, a[r][1]);
    }
}

static T512 void dots_rows_512(float *sc, const float *q, const float *kT, int nr, int64_t D) {
    switch (nr) {
    case 4: dots_rows_n(sc, q, kT, D, 4); break;
    case 3: dots_rows_n(sc, q, kT, D, 3); break;
    case 2: dots_rows_n(sc, q, kT, D, 2); break;
    default: dots_rows_n(sc, q, kT, D, 1);
    }
}

/* 16 values (fp32, bf16 or fp16 at v[i..]) as float32, lanes outside m zero. */
static inline T512 __attribute__((always_inline)) __m512 load16_any(const void *v, int64_t i, __mmask16 m, const int dt) {
    if (dt == AIPC_DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)v + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)v + i);
    return dt == AIPC_DT_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

/* acc_r = alpha[r] * acc_r + sum_j p[r * KB + j] * v[j] for NR rows of acc (D apart), 64 floats at a time;
 * the value rows stay in their storage dtype DT and are converted in registers, once for all rows */
static inline T512 __attribute__((always_inline)) void accum_rows_n(float *acc, const float *alpha, const float *p,
                                                                   const void *const *v, int n, int64_t D,
                                                                   const int NR, const int DT) {
    for (int64_t d = 0; d < D; d += 64) {
        __mmask16 m[4];
        for (int i = 0; i < 4; i++) m[i] = tail16(D - d - 16 * i);
        __m512 c[RB][4];
        for (int r = 0; r < NR; r++) {
            const __m512 al = _mm512_set1_ps(alpha[r]);
            for (int i = 0; i < 4; i++) c[r][i] = _mm512_mul_ps(al, _mm512_maskz_loadu_ps(m[i], acc + r * D + d + 16 * i));
        }
        for (int j = 0; j < n; j++) {
            __m512 x[4];
            for (int i = 0; i < 4; i++) x[i] = load16_any(v[j], d + 16 * i, m[i], DT);
            for (int r = 0; r < NR; r++) {
                const __m512 pj = _mm512_set1_ps(p[r * KB + j]);
                for (int i = 0; i < 4; i++) c[r][i] = _mm512_fmadd_ps(pj, x[i], c[r][i]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int i = 0; i < 4; i++) _mm512_mask_storeu_ps(acc + r * D + d + 16 * i, m[i], c[r][i]);
    }
}

#define ACCUM_ROWS_DT(DT)                                                                                           \
    switch (nr) {                                                                                                   \
    case 4: accum_rows_n(acc, alpha, p, v, n, D, 4, DT); break;                                                    \
    case 3: accum_rows_n(acc, alpha, p, v, n, D, 3, DT); break;                                                    \
    case 2: accum_rows_n(acc, alpha, p, v, n, D, 2, DT); break;                                                    \
    default: accum_rows_n(acc, alpha, p, v, n, D, 1, DT);                                                          \
    }

static T512 void accum_rows_512(float *acc, const float *alpha, const float *p, const void *const *v, int dt, int n,
                                int nr, int64_t D) {
    if (dt == AIPC_DT_BF16) {
        ACCUM_ROWS_DT(AIPC_DT_BF16)
    } else if (dt == AIPC_DT_F16) {
        ACCUM_ROWS_DT(AIPC_DT_F16)
    } else {
        ACCUM_ROWS_DT(AIPC_DT_F32)
    }
}
#undef ACCUM_ROWS_DT

/* 16 x 16 floats transposed in registers: r[i] = row i in, column i out (unpack, then 128-bit lanes). */
static inline T512 void transpose16_512(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + c], 128-bit lane l: column 4l + c of rows 4i..4i+3 */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; c++) {
        const __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xEE);
        const __m512 v0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44), v1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_f32x4(u0, v0, 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(u0, v0, 0xDD);
        t[8 + c] = _mm512_shuffle_f32x4(u1, v1, 0x88);
        t[12 + c] = _mm512_shuffle_f32x4(u1, v1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* kT[d][KB] = key row j's element d (fp32) for j < nk, 0 for nk <= j < KB: converted and transposed
 * 16 x 16 at a time (the scalar transpose was half of the decode kernel's work). */
static T512 void keys_transposed_512(float *kT, const char *const *krow, int nk, int dt, int64_t D) {
    for (int h = 0; h < KB; h += 16) {
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            const __mmask16 m = tail16(D - d0);
            __m512 r[16];
            for (int i = 0; i < 16; i++) {
                if (h + i >= nk) {
                    r[i] = _mm512_setzero_ps();
                } else if (dt == AIPC_DT_F32) {
                    r[i] = _mm512_maskz_loadu_ps(m, (const float *)krow[h + i] + d0);
                } else {
                    const __m256i x = _mm256_maskz_loadu_epi16(m, (const uint16_t *)krow[h + i] + d0);
                    r[i] = dt == AIPC_DT_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)) : _mm512_cvtph_ps(x);
                }
            }
            transpose16_512(r);
            for (int i = 0; i < 16 && d0 + i < D; i++) _mm512_storeu_ps(kT + (d0 + i) * KB + h, r[i]);
        }
    }
}

const seg_isa seg_isa_avx512 = {cvt_512, NULL, softmax_512, NULL, keys_transposed_512, dots_rows_512, accum_rows_512};
#endif /* SEG_X86 */
