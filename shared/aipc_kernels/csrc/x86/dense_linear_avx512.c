/*
 * AVX-512 tiles of the small-M dense linear (generic/dense_linear.c): DENSE_NB weight rows against a
 * block of tokens, float32 FMAs (or vdpbf16ps with AVX512-BF16), the weight rows loaded once per block
 * (converted from bf16 / fp16 in registers) and prefetched ahead. With more tokens than one register
 * block, a bf16 / fp16 tile is converted to float32 once into the thread's scratch and the blocks read it
 * from L1/L2. And the RMSNorm / SiLU-mul prologue of a row of x.
 */
#include "dense_linear.h"
#ifdef DENSE_X86
#include <immintrin.h>

#include "prefetch.h"

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define T512BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma")))
#define INLINE inline __attribute__((always_inline))

/* ---------------------------------------------------------------- AVX-512 */

static INLINE T512 __m512 load16(const void *w, const int wdt, int64_t off, __mmask16 m) {
    if (wdt == AIPC_DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)w + off);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + off);
    return wdt == AIPC_DT_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                               : _mm512_cvtph_ps(h);
}

/* MB tokens from m0 x NB weight rows from w0 (ws elements apart) -> y[m0.., n0..] */
static INLINE T512 void block512(const dense_args *a, const void *w0, int64_t ws, const int wdt, int64_t n0, int64_t m0,
                                 const int MB, const int NB, const int PF) {
    __m512 acc[DENSE_MB][DENSE_NB];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t K = a->K, Kp = a->Kp, Kv = K & ~(int64_t)15, es = dense_elem_bytes(wdt);
    const float *x0 = a->xf + m0 * Kp;
    int64_t k = 0;
    for (; k < Kv; k += 16) {
        __m512 wv[DENSE_NB];
        for (int j = 0; j < NB; j++) {
            if (PF) { /* the first token block streams the rows; the next ones find them in L1/L2 */
                const char *p = (const char *)w0 + (j * ws + k) * es;
                _mm_prefetch(p + PREFETCH_BYTES, _MM_HINT_T0);
                PREFETCH_L2(p);
            }
            wv[j] = load16(w0, wdt, j * ws + k, (__mmask16)0xFFFF);
        }
        for (int i = 0; i < MB; i++) {
            const __m512 xv = _mm512_load_ps(x0 + i * Kp + k);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < K) { /* the last K % 16: weights masked (never read past the row), x is zero padded */
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[DENSE_NB];
        for (int j = 0; j < NB; j++) wv[j] = load16(w0, wdt, j * ws + k, m);
        for (int i = 0; i < MB; i++) {
            const __m512 xv = _mm512_load_ps(x0 + i * Kp + k);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) dense_store(a, m0 + i, n0 + j, _mm512_reduce_add_ps(acc[i][j]));
}

/* every token block of nb rows (a full tile, else one row at a time) */
static INLINE T512 void rows512(const dense_args *a, const void *w0, int64_t ws, const int wdt, int64_t n0, int nb) {
    for (int64_t m0 = 0; m0 < a->M; m0 += DENSE_MB) {
        const int64_t mb = a->M - m0 < DENSE_MB ? a->M - m0 : DENSE_MB;
        for (int j = 0; j < nb; j += (nb == DENSE_NB ? DENSE_NB : 1)) {
            const void *wj = (const char *)w0 + j * ws * dense_elem_bytes(wdt);
            const int full = nb == DENSE_NB;
#define B512(MBV)                                                                                                     \
    m0 == 0 ? (full ? block512(a, wj, ws, wdt, n0 + j, m0, MBV, DENSE_NB, 1) : block512(a, wj, ws, wdt, n0 + j, m0, MBV, 1, 1)) \
            : (full ? block512(a, wj, ws, wdt, n0 + j, m0, MBV, DENSE_NB, 0) : block512(a, wj, ws, wdt, n0 + j, m0, MBV, 1, 0))
            switch (mb) {
            case 1: B512(1); break;
            case 2: B512(2); break;
            case 3: B512(3); break;
            default: B512(4);
            }
#undef B512
        }
    }
}

static INLINE T512 void tile512(const dense_args *a, int64_t n0, int nb, float *wtile, const int wdt) {
    const void *w0 = (const char *)a->w + n0 * a->K * dense_elem_bytes(wdt);
    if (wdt == AIPC_DT_F32 || a->M <= DENSE_MB) {
        rows512(a, w0, a->K, wdt, n0, nb);
        return;
    }
    for (int j = 0; j < nb; j++) /* converted once, read by every token block */
        for (int64_t k = 0; k < a->Kp; k += 16) {
            const int64_t r = a->K - k;
            const __mmask16 m = r >= 16 ? (__mmask16)0xFFFF : r <= 0 ? (__mmask16)0 : (__mmask16)((1u << r) - 1);
            const char *p = (const char *)w0 + (j * a->K + k) * dense_elem_bytes(wdt);
            _mm_prefetch(p + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(p);
            _mm512_store_ps(wtile + j * a->Kp + k, load16(w0, wdt, j * a->K + k, m));
        }
    rows512(a, wtile, a->Kp, AIPC_DT_F32, n0, nb);
}

/* ---------------------------------------------------------------- AVX512-BF16: bf16 x and weights */

/* MB tokens x NB bf16 weight rows: vdpbf16ps over 32 k at a time (pairs (2i, 2i+1) of x and w). */
static INLINE T512BF void block512_bf16(const dense_args *a, const uint16_t *w0, int64_t n0, int64_t m0, const int MB,
                                        const int NB, const int PF) {
    __m512 acc[DENSE_MB][DENSE_NB];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t K = a->K, Kb = a->Kb, Kv = K & ~(int64_t)31;
    const uint16_t *x0 = a->xb + m0 * Kb;
    int64_t k = 0;
    for (; k < Kv; k += 32) {
        __m512i wv[DENSE_NB];
        for (int j = 0; j < NB; j++) {
            const uint16_t *p = w0 + j * K + k;
            if (PF) {
                _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
                PREFETCH_L2(p);
            }
            wv[j] = _mm512_loadu_si512((const void *)p);
        }
        for (int i = 0; i < MB; i++) {
            const __m512bh xv = (__m512bh)_mm512_load_si512((const void *)(x0 + i * Kb + k));
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, (__m512bh)wv[j]);
        }
    }
    if (k < K) { /* the last K % 32: weights masked, x zero padded */
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512i wv[DENSE_NB];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_maskz_loadu_epi16(m, w0 + j * K + k);
        for (int i = 0; i < MB; i++) {
            const __m512bh xv = (__m512bh)_mm512_load_si512((const void *)(x0 + i * Kb + k));
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, (__m512bh)wv[j]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) dense_store(a, m0 + i, n0 + j, _mm512_reduce_add_ps(acc[i][j]));
}

static T512BF void tile512_bf16(const dense_args *a, int64_t n0, int nb) {
    const uint16_t *w0 = (const uint16_t *)a->w + n0 * a->K;
    for (int64_t m0 = 0; m0 < a->M; m0 += DENSE_MB) {
        const int64_t mb = a->M - m0 < DENSE_MB ? a->M - m0 : DENSE_MB;
        const int full = nb == DENSE_NB;
        for (int j = 0; j < nb; j += (full ? DENSE_NB : 1)) {
            const uint16_t *wj = w0 + j * a->K;
#define BBF(MBV)                                                                                                     \
    m0 == 0 ? (full ? block512_bf16(a, wj, n0 + j, m0, MBV, DENSE_NB, 1) : block512_bf16(a, wj, n0 + j, m0, MBV, 1, 1)) \
            : (full ? block512_bf16(a, wj, n0 + j, m0, MBV, DENSE_NB, 0) : block512_bf16(a, wj, n0 + j, m0, MBV, 1, 0))
            switch (mb) {
            case 1: BBF(1); break;
            case 2: BBF(2); break;
            case 3: BBF(3); break;
            default: BBF(4);
            }
#undef BBF
        }
    }
}

T512 void dense_tile_avx512(const dense_args *a, int64_t n0, int nb, float *wtile) {
    if (a->xb) { /* dense_linear.c chose vdpbf16ps: bf16 x and weights, a CPU with AVX512-BF16 */
        tile512_bf16(a, n0, nb);
        return;
    }
    switch (a->wdt) {
    case AIPC_DT_F32: tile512(a, n0, nb, wtile, AIPC_DT_F32); break;
    case AIPC_DT_BF16: tile512(a, n0, nb, wtile, AIPC_DT_BF16); break;
    default: tile512(a, n0, nb, wtile, AIPC_DT_F16);
    }
}

/* ---------------------------------------------------------------- AVX-512 prologue (aipc_prologue) */

/* exp(x) in float32: x = n ln2 + r, |r| <= ln2 / 2, degree-6 Taylor polynomial (relative error < 1e-7),
 * times 2^n by vscalefps (which also gives 0 and inf past the float range); NaN stays NaN. */
static INLINE T512 __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.f), x); /* max/min return x when it is NaN */
    x = _mm512_min_ps(_mm512_set1_ps(89.f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* v rounded to bf16 (nearest even) or fp16 and back; float32 as it is. NaN needs no care: the rounding
 * add can only turn a NaN payload into another NaN or into infinity's neighbour NaN pattern. */
static INLINE T512 __m512 round512(__m512 v, const int dt) {
    if (dt == AIPC_DT_F32) return v;
    if (dt == AIPC_DT_F16) return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __m512 r = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v); /* NaN kept as NaN */
}

T512 float dense_sumsq_avx512(const void *x, int dt, int64_t row, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        const __m512 v = load16(x, dt, row + k, m);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static INLINE T512 void prologue512(float *dstf, uint16_t *dstb, const void *x, const int dt, int64_t row, int64_t K,
                                    int pro, const void *gamma, float inv) {
    const __m512 vinv = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        const __m512 v = load16(x, dt, row + k, m);
        __m512 out;
        if (pro == AIPC_PRO_RMSNORM) {
            out = round512(_mm512_mul_ps(load16(gamma, dt, k, m), round512(_mm512_mul_ps(v, vinv), dt)), dt);
        } else { /* AIPC_PRO_SILU_MUL */
            const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
            const __m512 act = round512(_mm512_div_ps(v, _mm512_add_ps(one, e)), dt);
            out = round512(_mm512_mul_ps(act, load16(x, dt, row + K + k, m)), dt);
        }
        if (dstb) {
            const __m512i u = _mm512_srli_epi32(_mm512_castps_si512(out), 16); /* exact: out is bf16 already */
            _mm256_mask_storeu_epi16(dstb + k, m, _mm512_cvtepi32_epi16(u));
        } else {
            _mm512_mask_storeu_ps(dstf + k, m, out);
        }
    }
}

T512 void dense_prologue_avx512(float *dstf, uint16_t *dstb, const void *x, int dt, int64_t row, int64_t K, int pro,
                                const void *gamma, float inv) {
    switch (dt) {
    case AIPC_DT_F32: prologue512(dstf, dstb, x, AIPC_DT_F32, row, K, pro, gamma, inv); break;
    case AIPC_DT_BF16: prologue512(dstf, dstb, x, AIPC_DT_BF16, row, K, pro, gamma, inv); break;
    default: prologue512(dstf, dstb, x, AIPC_DT_F16, row, K, pro, gamma, inv);
    }
}

#endif /* DENSE_X86 */
