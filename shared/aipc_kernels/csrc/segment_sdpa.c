/*
 * Segment-KV attention (index-select SDPA) for beam search, CPU
 * ("Efficient LLM inference solution on Intel GPU", segment KV cache + fused index-select SDPA).
 *
 * Rows n = b*E + e (batch entry b, beam e of E). The keys/values of row n are, in logical order,
 *   the prompt of its batch entry:  prompt_key[b, j, kvh, :]              j < Np   (shared by all E beams)
 *   its response tokens:            resp_key[t, path[t, n], kvh, :]        t < Nr   (path: resolved beam table)
 * and the output is the softmax attention of query[n, h, l, :] over those Np + Nr positions, with one
 * online softmax over both segments, grouped-query heads (h -> kvh = h / G), an optional additive float
 * mask indexed by logical position, and an optional causal rule (query l sees positions <= L - Lq + l).
 *
 * One work item = (batch entry, tile of rows, chunk of positions), every kv head: it reads each prompt
 * key/value row ONCE for all E beams x G query heads x Lq queries (the rows of a tile), which is where
 * the segment cache saves bandwidth over a per-beam cache, and walks the cache in address order,
 * block by block with all heads of a block in a row. Long sequences are split into chunks
 * (flash-decoding) so that small batches still occupy every thread; the partial softmax states are
 * merged at the end. Up to RB rows are computed together (each key block loaded once for them).
 *
 * Layouts (elements): query strides (q_sn, q_sh, q_sl), last dim contiguous; prompt [B][Np][Hkv][D];
 * response [cap][N][Hkv][D]; path int32 [Nr][N]; mask float32 strides (m_sn, m_sh, m_sl), last dim
 * contiguous over the L = Np + Nr logical positions; out float32 [N][Lq][Hq][D]. Fully masked query
 * rows produce zeros. Plain C with intrinsics, no torch headers; ISA chosen by the caller at run time
 * (0 scalar, 1-2 AVX2, 3 AVX-512); threads via OpenMP.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half_float.h"

#if defined(__x86_64__) || defined(_M_X64)
#define SEG_X86 1
#include <immintrin.h>
#endif

#define API __attribute__((visibility("default")))
#define KB 32          /* key positions per block */
#define ROW_TILE 64    /* query rows per tile (all beams x heads x queries of one kv head, tiled) */
#define MIN_CHUNK 256  /* fewest positions per chunk when splitting a sequence across threads */
/* Software prefetch of the K/V rows PF_AHEAD positions ahead (one block): a head's rows are D of
 * every Hkv * D elements, a strided walk the hardware prefetchers barely follow (A/B on 2 cores,
 * 12 heads of 64, 1024-token prompt, 4 beams, K/V from DRAM: bf16 520 vs 600 us a call, fp32 530 vs
 * 490 us: kept for the 16-bit caches decode uses). */
#ifndef PF_LOCALITY
#define PF_LOCALITY 3 /* _MM_HINT_T0 */
#endif
#ifndef PF_AHEAD
#define PF_AHEAD KB
#endif

enum { S_F32 = 0, S_BF16 = 1, S_F16 = 2 };
enum { S_OK = 0, S_ERR_SHAPE = -2, S_ERR_DTYPE = -4, S_ERR_NOMEM = -6, S_ERR_PATH = -7, S_ERR_NULL = -9 };

/* ------------------------------------------------------------------ scalar helpers */

static void cvt_scalar(float *dst, const void *src, int dt, int64_t D) {
    if (dt == S_F32) {
        memcpy(dst, src, (size_t)D * 4);
    } else if (dt == S_BF16) {
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(((const uint16_t *)src)[d]);
    } else {
        for (int64_t d = 0; d < D; d++) dst[d] = f16_to_f32(((const uint16_t *)src)[d]);
    }
}

/* sc[j] = q . k_j for the n keys of a block held transposed: kT[d][KB] */
static void dots_scalar(float *sc, const float *q, const float *kT, int n, int64_t D) {
    for (int j = 0; j < n; j++) sc[j] = 0.f;
    for (int64_t d = 0; d < D; d++)
        for (int j = 0; j < n; j++) sc[j] += q[d] * kT[d * KB + j];
}

/* p[j] = exp(sc[j] - m) (0 for -inf); returns the sum */
static float softmax_scalar(float *p, const float *sc, float m, int n) {
    float sum = 0.f;
    for (int j = 0; j < n; j++) {
        p[j] = expf(sc[j] - m);
        sum += p[j];
    }
    return sum;
}

static void accum_scalar(float *acc, float alpha, const float *p, const float *const *v, int n, int64_t D) {
    for (int64_t d = 0; d < D; d++) {
        float a = acc[d] * alpha;
        for (int j = 0; j < n; j++) a += p[j] * v[j][d];
        acc[d] = a;
    }
}

/* ------------------------------------------------------------------ AVX-512 */
#ifdef SEG_X86
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define T256 __attribute__((target("avx2,f16c,fma")))

static inline T512 __mmask16 tail16(int64_t rem) {
    return rem >= 16 ? (__mmask16)0xFFFF : rem <= 0 ? (__mmask16)0 : (__mmask16)((1u << rem) - 1);
}

static T512 void cvt_512(float *dst, const void *src, int dt, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) {
        __mmask16 m = tail16(D - d);
        __m512 x;
        if (dt == S_F32) {
            x = _mm512_maskz_loadu_ps(m, (const float *)src + d);
        } else {
            __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)src + d);
            x = dt == S_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
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

/* Several rows at once (RB at most): each key block and value row loaded once for all of them, and
 * RB x 2 (dots) or RB x 4 (accum) independent FMA chains, where one row alone waits on FMA latency. */
#define RB 4

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
    if (dt == S_F32) return _mm512_maskz_loadu_ps(m, (const float *)v + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)v + i);
    return dt == S_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
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
    if (dt == S_BF16) {
        ACCUM_ROWS_DT(S_BF16)
    } else if (dt == S_F16) {
        ACCUM_ROWS_DT(S_F16)
    } else {
        ACCUM_ROWS_DT(S_F32)
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
                } else if (dt == S_F32) {
                    r[i] = _mm512_maskz_loadu_ps(m, (const float *)krow[h + i] + d0);
                } else {
                    const __m256i x = _mm256_maskz_loadu_epi16(m, (const uint16_t *)krow[h + i] + d0);
                    r[i] = dt == S_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)) : _mm512_cvtph_ps(x);
                }
            }
            transpose16_512(r);
            for (int i = 0; i < 16 && d0 + i < D; i++) _mm512_storeu_ps(kT + (d0 + i) * KB + h, r[i]);
        }
    }
}

/* ------------------------------------------------------------------ AVX2 */

static T256 void cvt_256(float *dst, const void *src, int dt, int64_t D) {
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 x;
        if (dt == S_F32) {
            x = _mm256_loadu_ps((const float *)src + d);
        } else {
            __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)src + d));
            x = dt == S_BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
        }
        _mm256_storeu_ps(dst + d, x);
    }
    if (d < D) cvt_scalar(dst + d, (const char *)src + d * (dt == S_F32 ? 4 : 2), dt, D - d);
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
#endif /* SEG_X86 */

/* ------------------------------------------------------------------ kernel */

typedef void (*cvt_fn)(float *, const void *, int, int64_t);
typedef void (*dots_fn)(float *, const float *, const float *, int, int64_t);
typedef float (*softmax_fn)(float *, const float *, float, int);
typedef void (*accum_fn)(float *, float, const float *, const float *const *, int, int64_t);
typedef void (*keys_fn)(float *, const char *const *, int, int, int64_t);
typedef void (*dots_rows_fn)(float *, const float *, const float *, int, int64_t);
typedef void (*accum_rows_fn)(float *, const float *, const float *, const void *const *, int, int, int, int64_t);

typedef struct {
    cvt_fn cvt;
    dots_fn dots;   /* one row (row_block): used where dots_rows is NULL */
    softmax_fn softmax;
    accum_fn accum; /* one row, as dots */
    keys_fn keys_transposed; /* NULL: the portable per-key loop of load_block */
    dots_rows_fn dots_rows;   /* NULL: one row at a time */
    accum_rows_fn accum_rows;
} seg_isa;

typedef struct {
    /* problem */
    const char *q;
    int64_t q_sn, q_sh, q_sl;
    const char *pk, *pv, *rk, *rv;
    const int32_t *path;
    const float *mask;
    int64_t m_sn, m_sh, m_sl;
    int dt;
    size_t esz;
    int64_t N, B, E, Hq, Hkv, G, Lq, D, Np, Nr, L;
    float scale;
    int causal;
    seg_isa isa;
} seg_args;

/* Per-thread scratch of one row tile. */
typedef struct {
    float *qf, *acc, *m, *s, *kT, *kbuf, *vbuf;
    const float *vp[KB];  /* value rows as fp32 (one-row path) */
    const void *vr[KB];   /* value rows as stored (accum_rows converts them itself) */
    float sc[RB * KB], p[RB * KB];
} seg_scratch;

/* Row r of a (b, kvh) work item -> (beam e, head group g, query l); rows ordered e-major. */
static inline void row_coords(const seg_args *a, int64_t r, int64_t *e, int64_t *g, int64_t *l) {
    *l = r % a->Lq;
    *g = (r / a->Lq) % a->G;
    *e = r / (a->Lq * a->G);
}

/* Prefetches the n rows of `bytes` each at p, p + stride, ... (all cache lines of each row). */
static inline void prefetch_rows(const char *p, int64_t stride, int64_t n, int64_t bytes) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + j * stride + o, 0, PF_LOCALITY);
}

/* Whether the ISA computes several rows of a tile at once (dots_rows + accum_rows, which read the value
 * rows as stored); else row by row (dots + accum, which read them as fp32). */
static inline int multi_row(const seg_isa *isa) { return isa->dots_rows && isa->accum_rows; }

/* Gather one block of KB positions: keys transposed to fp32 kT[D][KB] (read by every row of the tile),
 * values as stored (vr) for accum_rows, else as fp32 rows (in place when already fp32). Lanes past nk
 * are zero. */
static void load_block(const seg_args *a, seg_scratch *w, const char *const *krow, const char *const *vrow, int nk) {
    const int64_t D = a->D;
    if (a->isa.keys_transposed) a->isa.keys_transposed(w->kT, krow, nk, a->dt, D);
    for (int j = 0; j < nk; j++) {
        if (!a->isa.keys_transposed) {
            const float *k = (const float *)krow[j];
            if (a->dt != S_F32) {
                a->isa.cvt(w->kbuf, krow[j], a->dt, D);
                k = w->kbuf;
            }
            for (int64_t d = 0; d < D; d++) w->kT[d * KB + j] = k[d];
        }
        if (multi_row(&a->isa)) {
            w->vr[j] = vrow[j];
        } else if (a->dt == S_F32) {
            w->vp[j] = (const float *)vrow[j];
        } else {
            a->isa.cvt(w->vbuf + (int64_t)j * D, vrow[j], a->dt, D);
            w->vp[j] = w->vbuf + (int64_t)j * D;
        }
    }
    if (nk < KB && !a->isa.keys_transposed)
        for (int64_t d = 0; d < D; d++)
            for (int j = nk; j < KB; j++) w->kT[d * KB + j] = 0.f;
}

/* The largest of the nk scores, NaN if one is NaN (the reference's max propagates NaN). Four independent
 * max chains and a separate NaN test: one chain of compare-selects (with the NaN test in it) made the
 * decode kernel 60% slower, this loop being on its critical path once per row and block. */
static inline float block_max(const float *sc, int nk) {
    float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int nan = 0, j = 0;
    for (; j + 4 <= nk; j += 4)
        for (int i = 0; i < 4; i++) {
            m[i] = sc[j + i] > m[i] ? sc[j + i] : m[i];
            nan |= sc[j + i] != sc[j + i];
        }
    for (; j < nk; j++) {
        m[0] = sc[j] > m[0] ? sc[j] : m[0];
        nan |= sc[j] != sc[j];
    }
    const float a = m[0] > m[1] ? m[0] : m[1], b = m[2] > m[3] ? m[2] : m[3];
    return nan ? NAN : a > b ? a : b;
}

/* Mask, causal rule and online-softmax update of row r (state index rt) given its scores sc against the
 * block of nk positions from logical position pos0: writes p = exp(sc - m_new) and *alpha, the factor
 * for the row's old accumulator. Returns 0, leaving the state and p alone, when no position of the
 * block is visible to the row. NaN propagates as in the reference: a NaN score (from q, k, the scale or
 * the mask) makes the block max, and so the row's sum and accumulator, NaN; NaN stays in them through
 * every later rescale (NaN * alpha), so the output is NaN. */
static int softmax_step(const seg_args *a, seg_scratch *w, int64_t b, int64_t kvh, int64_t r, int64_t rt, int64_t pos0,
                        int nk, float *sc, float *p, float *alpha) {
    int64_t e, g, l;
    row_coords(a, r, &e, &g, &l);
    if (a->mask) {
        const int64_t n = b * a->E + e, h = kvh * a->G + g;
        const float *mr = a->mask + n * a->m_sn + h * a->m_sh + l * a->m_sl + pos0;
        for (int j = 0; j < nk; j++) sc[j] += mr[j];
    }
    if (a->causal) {
        const int64_t limit = a->L - a->Lq + l;
        for (int j = 0; j < nk; j++)
            if (pos0 + j > limit) sc[j] = -INFINITY;
    }
    const float bmax = block_max(sc, nk);
    if (bmax == -INFINITY) return 0;
    const float mold = w->m[rt], mnew = mold > bmax ? mold : bmax;
    *alpha = mold == -INFINITY ? 0.f : expf(mold - mnew);
    const float sum = a->isa.softmax(p, sc, mnew, nk);
    w->s[rt] = w->s[rt] * *alpha + sum;
    w->m[rt] = mnew;
    return 1;
}

/* One row against a block of nk positions starting at logical position pos0 (online softmax update).
 * A block the row cannot see is still accumulated with weights 0, as the reference's p @ v does: a NaN
 * value anywhere gives NaN (0 * NaN), whatever the block boundaries (only masked inputs pay for it). */
static void row_block(const seg_args *a, seg_scratch *w, int64_t b, int64_t kvh, int64_t r, int64_t rt, int64_t pos0, int nk) {
    float alpha;
    a->isa.dots(w->sc, w->qf + rt * a->D, w->kT, nk, a->D);
    if (!softmax_step(a, w, b, kvh, r, rt, pos0, nk, w->sc, w->p, &alpha)) {
        alpha = 1.f;
        memset(w->p, 0, (size_t)nk * sizeof(float));
    }
    a->isa.accum(w->acc + rt * a->D, alpha, w->p, w->vp, nk, a->D);
}

/* Rows r .. r + nr - 1 (tile rows rt ..) against a block: row_block for nr rows at once. */
static void rows_block(const seg_args *a, seg_scratch *w, int64_t b, int64_t kvh, int64_t r, int64_t rt, int nr,
                       int64_t pos0, int nk) {
    if (!multi_row(&a->isa)) {
        for (int i = 0; i < nr; i++) row_block(a, w, b, kvh, r + i, rt + i, pos0, nk);
        return;
    }
    a->isa.dots_rows(w->sc, w->qf + rt * a->D, w->kT, nr, a->D);
    float alpha[RB];
    for (int i = 0; i < nr; i++) {
        float *p = w->p + i * KB;
        if (!softmax_step(a, w, b, kvh, r + i, rt + i, pos0, nk, w->sc + i * KB, p, &alpha[i])) {
            alpha[i] = 1.f; /* nothing visible: weights 0 (a NaN value still propagates, as in row_block) */
            memset(p, 0, (size_t)nk * sizeof(float));
        }
    }
    a->isa.accum_rows(w->acc + rt * a->D, alpha, w->p, w->vr, a->dt, nk, nr, a->D);
}

/* Work item (b, rows [r0, r1) of every kv head, positions [j0, j1)): leaves m, s, acc of the tile in w,
 * row rt of kv head kvh at state index kvh * (r1 - r0) + rt. Every kv head of a block is done before
 * the next block, so the item walks the cache position by position, [positions][Hkv][D] contiguous:
 * one stream the hardware prefetchers follow (one head at a time reads D of every Hkv * D elements,
 * a strided walk they barely follow), each key/value row read once for all rows of the tile. */
static void run_item(const seg_args *a, seg_scratch *w, int64_t b, int64_t r0, int64_t r1, int64_t j0, int64_t j1) {
    const int64_t D = a->D, R = r1 - r0, H = a->Hkv, esz = (int64_t)a->esz;
    for (int64_t kvh = 0; kvh < H; kvh++)
        for (int64_t rt = 0; rt < R; rt++) {
            int64_t e, g, l;
            row_coords(a, r0 + rt, &e, &g, &l);
            const int64_t n = b * a->E + e, h = kvh * a->G + g, st = kvh * R + rt;
            a->isa.cvt(w->qf + st * D, a->q + (n * a->q_sn + h * a->q_sh + l * a->q_sl) * esz, a->dt, D);
            for (int64_t d = 0; d < D; d++) w->qf[st * D + d] *= a->scale;
            w->m[st] = -INFINITY;
            w->s[st] = 0.f;
        }
    memset(w->acc, 0, (size_t)(H * R * D) * sizeof(float));
    const char *krow[KB], *vrow[KB];
    const int64_t rowb = H * D * esz; /* bytes between positions of one head */

    /* prompt segment: each key/value row read once for every row of the tile */
    const int64_t pend = j1 < a->Np ? j1 : a->Np;
    for (int64_t jb = j0; jb < pend; jb += KB) {
        const int nk = (int)(pend - jb < KB ? pend - jb : KB);
        const char *kb = a->pk + (b * a->Np + jb) * rowb, *vb = a->pv + (b * a->Np + jb) * rowb;
        const int64_t npf = jb + PF_AHEAD < pend ? (pend - jb - PF_AHEAD < KB ? pend - jb - PF_AHEAD : KB) : 0;
        for (int64_t kvh = 0; kvh < H; kvh++) {
            /* this head's rows of the block PF_AHEAD positions on, spread over the heads: one burst
             * for the whole slab fills the load buffers and stalls the arithmetic behind it */
            prefetch_rows(kb + PF_AHEAD * rowb + kvh * D * esz, rowb, npf, D * esz);
            prefetch_rows(vb + PF_AHEAD * rowb + kvh * D * esz, rowb, npf, D * esz);
            for (int j = 0; j < nk; j++) {
                krow[j] = kb + j * rowb + kvh * D * esz;
                vrow[j] = vb + j * rowb + kvh * D * esz;
            }
            load_block(a, w, krow, vrow, nk);
            for (int64_t rt = 0; rt < R; rt += RB)
                rows_block(a, w, b, kvh, r0 + rt, kvh * R + rt, (int)(R - rt < RB ? R - rt : RB), jb, nk);
        }
    }

    /* response segment: per beam, rows chosen through the path table */
    const int64_t t0 = (j0 > a->Np ? j0 : a->Np) - a->Np, t1 = j1 - a->Np;
    if (t1 <= t0) return;
    const int64_t rows_per_beam = a->G * a->Lq;
    for (int64_t e = r0 / rows_per_beam; e * rows_per_beam < r1; e++) {
        const int64_t n = b * a->E + e;
        const int64_t ra = e * rows_per_beam > r0 ? e * rows_per_beam : r0;
        const int64_t rb = (e + 1) * rows_per_beam < r1 ? (e + 1) * rows_per_beam : r1;
        for (int64_t tb = t0; tb < t1; tb += KB) {
            const int nk = (int)(t1 - tb < KB ? t1 - tb : KB);
            for (int64_t kvh = 0; kvh < H; kvh++) {
                for (int j = 0; j < nk; j++) {
                    const int64_t t = tb + j, phys = a->path[t * a->N + n];
                    const int64_t off = ((t * a->N + phys) * H + kvh) * D * esz;
                    krow[j] = a->rk + off;
                    vrow[j] = a->rv + off;
                }
                load_block(a, w, krow, vrow, nk);
                for (int64_t r = ra; r < rb; r += RB)
                    rows_block(a, w, b, kvh, r, kvh * R + r - r0, (int)(rb - r < RB ? rb - r : RB), a->Np + tb, nk);
            }
        }
    }
}

/* vbuf (fp32 copies of a block's value rows) only for the row-by-row path of non-fp32 values. */
static int scratch_alloc(seg_scratch *w, int64_t rows, int64_t D, int need_vbuf) {
    w->qf = malloc((size_t)(rows * D) * sizeof(float));
    w->acc = malloc((size_t)(rows * D) * sizeof(float));
    w->m = malloc((size_t)rows * sizeof(float));
    w->s = malloc((size_t)rows * sizeof(float));
    w->kT = malloc((size_t)(KB * D) * sizeof(float));
    w->kbuf = malloc((size_t)D * sizeof(float));
    w->vbuf = need_vbuf ? malloc((size_t)(KB * D) * sizeof(float)) : NULL;
    return w->qf && w->acc && w->m && w->s && w->kT && w->kbuf && (w->vbuf || !need_vbuf);
}

static void scratch_free(seg_scratch *w) {
    free(w->qf);
    free(w->acc);
    free(w->m);
    free(w->s);
    free(w->kT);
    free(w->kbuf);
    free(w->vbuf);
}

/* Final value of one row: acc / s, or zeros when every position was masked (s == 0); NaN when s is. */
static void write_row(const seg_args *a, float *out, int64_t b, int64_t kvh, int64_t r, const float *acc, float s) {
    int64_t e, g, l;
    row_coords(a, r, &e, &g, &l);
    const int64_t n = b * a->E + e, h = kvh * a->G + g;
    float *o = out + ((n * a->Lq + l) * a->Hq + h) * a->D;
    const float inv = s > 0.f ? 1.f / s : s == 0.f ? 0.f : s;
    for (int64_t d = 0; d < a->D; d++) o[d] = acc[d] * inv;
}

/*
 * out[N][Lq][Hq][D] (float32) = segment attention (see the file comment). dt: 0 f32, 1 bf16, 2 f16 for
 * query, prompt and response K/V. isa: 0 scalar, 1-2 AVX2, 3 AVX-512. Returns 0 or a negative error.
 */
API int aipc_segment_sdpa(const void *q, int64_t q_sn, int64_t q_sh, int64_t q_sl, const void *pk, const void *pv,
                          const void *rk, const void *rv, const int32_t *path, const float *mask, int64_t m_sn,
                          int64_t m_sh, int64_t m_sl, float *out, int dt, int64_t N, int64_t B, int64_t Hq,
                          int64_t Hkv, int64_t Lq, int64_t D, int64_t Np, int64_t Nr, float scale, int causal,
                          int isa, int nthreads) {
    if (dt < S_F32 || dt > S_F16) return S_ERR_DTYPE;
    if (B <= 0 || N <= 0 || N % B || Hkv <= 0 || Hq <= 0 || Hq % Hkv || Lq <= 0 || D <= 0 || Np < 0 || Nr < 0 ||
        Np + Nr <= 0)
        return S_ERR_SHAPE;
    if (!q || !out || (Np && (!pk || !pv)) || (Nr && (!rk || !rv || !path))) return S_ERR_NULL;
    for (int64_t i = 0; i < Nr * N; i++)
        if (path[i] < 0 || path[i] >= N) return S_ERR_PATH;
    seg_args a = {
        .q = q, .q_sn = q_sn, .q_sh = q_sh, .q_sl = q_sl, .pk = pk, .pv = pv, .rk = rk, .rv = rv, .path = path,
        .mask = mask, .m_sn = m_sn, .m_sh = m_sh, .m_sl = m_sl, .dt = dt, .esz = dt == S_F32 ? 4 : 2, .N = N,
        .B = B, .E = N / B, .Hq = Hq, .Hkv = Hkv, .G = Hq / Hkv, .Lq = Lq, .D = D, .Np = Np, .Nr = Nr,
        .L = Np + Nr, .scale = scale, .causal = causal,
        .isa = {cvt_scalar, dots_scalar, softmax_scalar, accum_scalar},
    };
#ifdef SEG_X86
    if (isa >= 3)
        a.isa = (seg_isa){cvt_512, NULL, softmax_512, NULL, keys_transposed_512, dots_rows_512, accum_rows_512};
    else if (isa >= 1) a.isa = (seg_isa){cvt_256, dots_256, softmax_scalar, accum_256, NULL, NULL, NULL};
#else
    (void)isa;
#endif
    if (nthreads < 1) nthreads = 1;
    const int64_t R = a.E * a.G * Lq;                    /* rows per (b, kvh) */
    const int64_t ntiles = (R + ROW_TILE - 1) / ROW_TILE;
    const int64_t tile = (R + ntiles - 1) / ntiles;      /* balanced tiles */
    const int64_t units = B * Hkv * ntiles; /* (b, kvh, tile): one softmax state per row */
    const int64_t items = B * ntiles;         /* (b, tile) x chunk: a work item does every kv head */
    /* Split the positions into chunks (flash-decoding) until the items spread evenly over the threads
     * (or 4 per thread), chunks of MIN_CHUNK positions at least; the partial states merge at the end. */
    const int64_t most = (a.L + MIN_CHUNK - 1) / MIN_CHUNK;
    int64_t nchunks = 1;
    while (nchunks < most && (items * nchunks) % nthreads && items * nchunks < 4 * nthreads) nchunks++;
    int64_t *bounds = malloc((size_t)(nchunks + 1) * sizeof(int64_t));
    if (!bounds) return S_ERR_NOMEM;
    {   /* chunk boundaries at equal cost: a response position is gathered once per beam, E times */
        const int64_t total = Np + a.E * Nr;
        bounds[0] = 0;
        for (int64_t c = 1; c < nchunks; c++) {
            const int64_t cost = total * c / nchunks;
            int64_t pos = cost <= Np ? (cost + KB / 2) / KB * KB : Np + (cost - Np + a.E - 1) / a.E;
            if (pos > a.L) pos = a.L;
            bounds[c] = pos > bounds[c - 1] ? pos : bounds[c - 1];
        }
        bounds[nchunks] = a.L;
    }

    const int64_t part_stride = tile * (D + 2); /* per (unit, chunk): m[tile], s[tile], acc[tile][D] */
    float *part = NULL;
    if (nchunks > 1) {
        part = malloc((size_t)(units * nchunks * part_stride) * sizeof(float));
        if (!part) {
            free(bounds);
            return S_ERR_NOMEM;
        }
    }
    int status = S_OK;
#pragma omp parallel num_threads(nthreads)
    {
        seg_scratch w;
        if (!scratch_alloc(&w, Hkv * tile, D, !multi_row(&a.isa) && a.dt != S_F32)) {
#pragma omp atomic write
            status = S_ERR_NOMEM;
        }
#pragma omp barrier
        if (status == S_OK) {
            /* chunk-major, contiguous ranges per thread */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items * nchunks; it++) {
                const int64_t c = it / items, ti = it % items % ntiles, b = it % items / ntiles;
                const int64_t r0 = ti * tile, r1 = r0 + tile < R ? r0 + tile : R, nr = r1 - r0;
                run_item(&a, &w, b, r0, r1, bounds[c], bounds[c + 1]);
                for (int64_t kvh = 0; kvh < Hkv; kvh++) {
                    const int64_t u = (b * Hkv + kvh) * ntiles + ti, st = kvh * nr;
                    if (nchunks == 1) {
                        for (int64_t r = r0; r < r1; r++)
                            write_row(&a, out, b, kvh, r, w.acc + (st + r - r0) * D, w.s[st + r - r0]);
                    } else {
                        float *pp = part + (u * nchunks + c) * part_stride;
                        memcpy(pp, w.m + st, (size_t)nr * sizeof(float));
                        memcpy(pp + tile, w.s + st, (size_t)nr * sizeof(float));
                        memcpy(pp + 2 * tile, w.acc + st * D, (size_t)(nr * D) * sizeof(float));
                    }
                }
            }
            if (nchunks > 1) {
                /* merge the chunks' softmax states: one (unit, row) per iteration */
#pragma omp for schedule(static)
                for (int64_t ur = 0; ur < units * tile; ur++) {
                    const int64_t u = ur / tile, rr = ur % tile;
                    const int64_t ti = u % ntiles, bk = u / ntiles, kvh = bk % Hkv, b = bk / Hkv;
                    const int64_t r = ti * tile + rr;
                    if (r >= R || rr >= (ti * tile + tile < R ? tile : R - ti * tile)) continue;
                    float M = -INFINITY;
                    for (int64_t c = 0; c < nchunks; c++) {
                        const float mc = part[(u * nchunks + c) * part_stride + rr];
                        M = mc > M || mc != mc ? mc : M; /* a NaN sticks */
                    }
                    float S = 0.f;
                    float *acc = w.acc; /* D floats of scratch */
                    memset(acc, 0, (size_t)D * sizeof(float));
                    for (int64_t c = 0; c < nchunks; c++) { /* a chunk that saw nothing: weight 0 (NaN stays) */
                        const float *pp = part + (u * nchunks + c) * part_stride;
                        const float f = pp[rr] == -INFINITY ? 0.f : expf(pp[rr] - M);
                        S += pp[tile + rr] * f;
                        const float *ac = pp + 2 * tile + rr * D;
                        for (int64_t d = 0; d < D; d++) acc[d] += ac[d] * f;
                    }
                    write_row(&a, out, b, kvh, r, acc, S);
                }
            }
        }
        scratch_free(&w);
    }
    free(part);
    free(bounds);
    return status;
}
