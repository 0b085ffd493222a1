/*
 * AVX2 (+ FMA, F16C) tiles of the small-M dense linear (generic/dense_linear.c), for CPUs without
 * AVX-512 (AVX-VNNI adds nothing to float products): the AVX-512 unit's scheme on 8 float lanes, and the
 * prologue of a row of x.
 */
#include "dense_linear.h"
#ifdef DENSE_X86
#include <immintrin.h>

#include "prefetch.h"

#define T256 __attribute__((target("avx2,f16c,fma")))
#define INLINE inline __attribute__((always_inline))
#define MB256 2 /* AVX2: 2 tokens x 4 rows = 8 accumulators of 16 registers */

/* ---------------------------------------------------------------- AVX2 */

static INLINE T256 __m256 load8(const void *w, const int wdt, int64_t off) {
    if (wdt == AIPC_DT_F32) return _mm256_loadu_ps((const float *)w + off);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + off));
    return wdt == AIPC_DT_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

static INLINE T256 float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static INLINE T256 void block256(const dense_args *a, const void *w0, int64_t ws, const int wdt, int64_t n0, int64_t m0,
                                 const int MB, const int NB) {
    __m256 acc[MB256][DENSE_NB];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();
    const int64_t K = a->K, Kp = a->Kp, Kv = K & ~(int64_t)7, es = dense_elem_bytes(wdt);
    const float *x0 = a->xf + m0 * Kp;
    for (int64_t k = 0; k < Kv; k += 8) {
        __m256 wv[DENSE_NB];
        for (int j = 0; j < NB; j++) {
            const char *p = (const char *)w0 + (j * ws + k) * es;
            _mm_prefetch(p + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(p);
            wv[j] = load8(w0, wdt, j * ws + k);
        }
        for (int i = 0; i < MB; i++) {
            const __m256 xv = _mm256_load_ps(x0 + i * Kp + k);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) {
            float s = hsum256(acc[i][j]);
            for (int64_t k = Kv; k < K; k++) s += x0[i * Kp + k] * dense_load_f32(w0, wdt, j * ws + k);
            dense_store(a, m0 + i, n0 + j, s);
        }
}

static INLINE T256 void rows256(const dense_args *a, const void *w0, int64_t ws, const int wdt, int64_t n0, int nb) {
    for (int64_t m0 = 0; m0 < a->M; m0 += MB256) {
        const int full = nb == DENSE_NB, one = a->M - m0 < MB256;
        for (int j = 0; j < nb; j += (full ? DENSE_NB : 1)) {
            const void *wj = (const char *)w0 + j * ws * dense_elem_bytes(wdt);
            if (full)
                one ? block256(a, wj, ws, wdt, n0 + j, m0, 1, DENSE_NB) : block256(a, wj, ws, wdt, n0 + j, m0, 2, DENSE_NB);
            else
                one ? block256(a, wj, ws, wdt, n0 + j, m0, 1, 1) : block256(a, wj, ws, wdt, n0 + j, m0, 2, 1);
        }
    }
}

static INLINE T256 void tile256(const dense_args *a, int64_t n0, int nb, float *wtile, const int wdt) {
    const void *w0 = (const char *)a->w + n0 * a->K * dense_elem_bytes(wdt);
    if (wdt == AIPC_DT_F32 || a->M <= MB256) {
        rows256(a, w0, a->K, wdt, n0, nb);
        return;
    }
    for (int j = 0; j < nb; j++) {
        int64_t k = 0;
        for (; k + 8 <= a->K; k += 8) _mm256_store_ps(wtile + j * a->Kp + k, load8(w0, wdt, j * a->K + k));
        for (; k < a->Kp; k++) wtile[j * a->Kp + k] = k < a->K ? dense_load_f32(w0, wdt, j * a->K + k) : 0.f;
    }
    rows256(a, wtile, a->Kp, AIPC_DT_F32, n0, nb);
}

T256 void dense_tile_avx2(const dense_args *a, int64_t n0, int nb, float *wtile) {
    switch (a->wdt) {
    case AIPC_DT_F32: tile256(a, n0, nb, wtile, AIPC_DT_F32); break;
    case AIPC_DT_BF16: tile256(a, n0, nb, wtile, AIPC_DT_BF16); break;
    default: tile256(a, n0, nb, wtile, AIPC_DT_F16);
    }
}

/* ---------------------------------------------------------------- AVX2 prologue (aipc_prologue) */

/* exp(x) in float32 as exp512, 2^n built in the exponent field (x clamped to [-87, 88]: n stays normal); inf
 * past the float range (so that silu(-inf) is -inf / inf = NaN, as torch's). */
static INLINE T256 __m256 exp256(__m256 x) {
    const __m256 overflow = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-87.f), x); /* max/min return x when it is NaN */
    x = _mm256_min_ps(_mm256_set1_ps(88.f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY), overflow);
}

static INLINE T256 __m256 round256(__m256 v, const int dt) {
    if (dt == AIPC_DT_F32) return v;
    if (dt == AIPC_DT_F16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256 r = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
    return _mm256_blendv_ps(r, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)); /* NaN kept as NaN */
}

T256 float dense_sumsq_avx2(const void *x, int dt, int64_t row, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = load8(x, dt, row + k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum256(acc);
    for (; k < K; k++) {
        const float v = dense_load_f32(x, dt, row + k);
        ss += v * v;
    }
    return ss;
}

static INLINE T256 void prologue256(float *dstf, uint16_t *dstb, const void *x, const int dt, int64_t row, int64_t K,
                                    int pro, const void *gamma, float inv) {
    const __m256 vinv = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = load8(x, dt, row + k);
        __m256 out;
        if (pro == AIPC_PRO_RMSNORM) {
            out = round256(_mm256_mul_ps(load8(gamma, dt, k), round256(_mm256_mul_ps(v, vinv), dt)), dt);
        } else { /* AIPC_PRO_SILU_MUL */
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), v));
            const __m256 act = round256(_mm256_div_ps(v, _mm256_add_ps(one, e)), dt);
            out = round256(_mm256_mul_ps(act, load8(x, dt, row + K + k)), dt);
        }
        if (dstb) {
            const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(out), 16); /* exact: out is bf16 already */
            const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
            _mm_storeu_si128((__m128i *)(dstb + k), packed);
        } else {
            _mm256_storeu_ps(dstf + k, out);
        }
    }
    for (; k < K; k++) {
        const float out = dense_prologue_value(x, dt, row, k, K, pro, gamma, inv);
        if (dstb)
            dstb[k] = f32_to_bf16(out);
        else
            dstf[k] = out;
    }
}

T256 void dense_prologue_avx2(float *dstf, uint16_t *dstb, const void *x, int dt, int64_t row, int64_t K, int pro,
                              const void *gamma, float inv) {
    switch (dt) {
    case AIPC_DT_F32: prologue256(dstf, dstb, x, AIPC_DT_F32, row, K, pro, gamma, inv); break;
    case AIPC_DT_BF16: prologue256(dstf, dstb, x, AIPC_DT_BF16, row, K, pro, gamma, inv); break;
    default: prologue256(dstf, dstb, x, AIPC_DT_F16, row, K, pro, gamma, inv);
    }
}

#endif /* DENSE_X86 */
