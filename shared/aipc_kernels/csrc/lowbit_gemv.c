/*
 * Low-bit weight x float activation linear layer, CPU up-convert-and-compute
 * (Georganas et al., "Pushing the Envelope of LLM Inference on AI-PC and Intel GPUs", III-B..D).
 *
 *   y[m, n] = sum_g  sx[m,g] * ( s[n,g] * cmul * dot_g(c[n,:], xq[m,:]) - s[n,g] * z[n,g] * sum_g(xq[m,:]) ) + bias[n]
 *
 * where c are the unsigned weight codes (0..3 for 2 bits, 0..1 for 1 bit), w = s * (cmul * c - z),
 * xq = round(x / sx) the int8 activations (absmax per token, or per K-group), and dot_g an int32 dot
 * product over group g. The zero correction uses the group sum of the quantized activations, so the
 * inner loop is a pure u8 x s8 -> s32 dot product: vpdpbusd (AVX-512 VNNI, AVX-VNNI) or
 * vpmaddubsw + vpmaddwd (AVX2), and a portable C loop on the same layout.
 *
 * Weight layout ("cpu_vnni16", produced by aipc_kernels.packing): rows in blocks of 16; per block the
 * K axis in chunks of 64 bytes. A chunk holds, at byte [n][kk] (n < 16, kk < 4), the codes of
 * k = kc*chunk + 4*q + kk for every bit-plane q (2 bits: q < 4 at bits 2q; 1 bit: q < 8 at bit q).
 * So one 64-byte load and a shift + mask per plane yield a [16 rows][4 k] u8 vector, exactly the
 * operand vpdpbusd wants against a broadcast of 4 consecutive int8 activations.
 * Scales (and affine zeros) are [N/16][K/G][16] in fp16 or bf16.
 *
 * Plain C with intrinsics, no torch headers; ISA chosen at run time; threads via OpenMP.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "half_float.h"

#if defined(__x86_64__) || defined(_M_X64)
#define AIPC_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(AIPC_X86) && defined(__linux__)
#define AIPC_AMX 1 /* AMX needs the kernel's permission (arch_prctl), asked for once */
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define API __attribute__((visibility("default")))
#define BLOCK_N 16
#define CHUNK_BYTES 64
#define OTF_M 4    /* tokens per tile when up-converting on the fly (2 bits; half that for 1 bit) */
#define UP_M 8     /* tokens per tile once a row block is up-converted */
#define UP_MIN_M 8 /* from this many tokens on, each row block is up-converted once */
#define AMX_M 16   /* tokens per AMX tile (tile rows); two tiles share each weight tile */
#define AMX_MIN_M 16 /* from this many tokens on, AMX (where available) does the int8 dot products */
/* Software prefetch of the weight stream, two distances: into L1 just ahead of the loads, and into
 * L2 far ahead. The far one keeps more lines in flight than the L1 fill buffers allow, and crosses the
 * 4 KiB pages where the hardware streamer stops: +7-9% of DRAM bandwidth at M=1 on 2 cores (A/B in one
 * process, bench/results/gemv_cpu.md). Override with -DPREFETCH_BYTES=... / -DPREFETCH_L2_BYTES=0. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif
#ifndef PREFETCH_L2_BYTES
#define PREFETCH_L2_BYTES 4096
#endif
#if PREFETCH_L2_BYTES > 0
#define PREFETCH_L2(p) _mm_prefetch((const char *)(p) + PREFETCH_L2_BYTES, _MM_HINT_T1)
#else
#define PREFETCH_L2(p)
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX_VNNI = 2, ISA_AVX512_VNNI = 3, ISA_AMX_INT8 = 4 };
enum {
    OK = 0,
    ERR_BITS = -1,
    ERR_SHAPE = -2,
    ERR_GROUP = -3,
    ERR_DTYPE = -4,
    ERR_ISA = -5,
    ERR_NOMEM = -6,
    ERR_CODEBOOK = -7, /* cmul not finite and positive, or zero_const infinite */
    ERR_ZEROS = -8,    /* zero_const NaN (per-group zero points) without zeros */
    ERR_NULL = -9,     /* a pointer the call reads or writes is NULL */
    ERR_THREADS = -10, /* nthreads outside [0, MAX_THREADS] */
};
#define MAX_THREADS 4096

/* ------------------------------------------------------------------ scalar conversions */

static inline float load_f(const void *p, int64_t i, int dt) {
    switch (dt) {
    case DT_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case DT_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline void store_f(void *p, int64_t i, int dt, float v) {
    switch (dt) {
    case DT_BF16: ((uint16_t *)p)[i] = f32_to_bf16(v); break;
    case DT_F16: ((uint16_t *)p)[i] = f32_to_f16(v); break;
    default: ((float *)p)[i] = v;
    }
}

/* ------------------------------------------------------------------ activation quantization */

#ifdef AIPC_X86
#define MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MULTIVERSION
#endif

/* Row of x in float32 (vectorised per ISA by target_clones; fp16 through the scalar converter). */
MULTIVERSION static void row_to_f32(const void *x, int dt, int64_t K, float *out) {
    if (dt == DT_F32) {
        memcpy(out, x, sizeof(float) * (size_t)K);
    } else if (dt == DT_BF16) {
        const uint16_t *p = (const uint16_t *)x;
        uint32_t *o = (uint32_t *)out;
        for (int64_t k = 0; k < K; k++) o[k] = (uint32_t)p[k] << 16;
    } else {
        const uint16_t *p = (const uint16_t *)x;
        for (int64_t k = 0; k < K; k++) out[k] = f16_to_f32(p[k]);
    }
}

/* int8 absmax quantization of one span; returns its scale. Rounds half to even like rintf: adding
 * and removing 1.5 * 2^23 leaves the nearest integer for |v| <= 127 (no libm call, vectorises). */
MULTIVERSION static float quantize_span(const float *v, int64_t n, int8_t *q) {
    /* |v| as bit patterns: for non-negative floats integer order is value order, and an integer
     * max-reduction vectorises where a float one may not (without fast-math) */
    uint32_t abits = 0;
    const uint32_t *u = (const uint32_t *)v;
    for (int64_t k = 0; k < n; k++) {
        const uint32_t a = u[k] & 0x7fffffffu;
        abits = a > abits ? a : abits;
    }
    float amax;
    memcpy(&amax, &abits, 4);
    /* |v * inv| <= 127 up to one rounding, which the rounding to an integer absorbs: no clamp */
    const float inv = amax > 0.f ? 127.f / amax : 0.f, magic = 12582912.f;
    for (int64_t k = 0; k < n; k++) q[k] = (int8_t)(int32_t)((v[k] * inv + magic) - magic);
    return amax / 127.f;
}

#ifdef AIPC_X86
static void quantize_row512(const void *x, int dt, int64_t K, int64_t G, int64_t act_group, int8_t *q, float *sx,
                            int32_t *gsum);
#endif

/* Row m of quantize_activations; `row` is a float scratch of K values (unused with AVX-512). */
static void quantize_row(const void *x, int dt, int64_t m, int64_t K, int64_t G, int64_t act_group, int isa, float *row,
                         int8_t *xq, float *sx, int32_t *gsum) {
    const int64_t ng = K / G, nag = K / act_group;
    const void *xm = (const char *)x + m * K * (dt == DT_F32 ? 4 : 2);
    int8_t *qm = xq + m * K;
    sx += m * ng, gsum += m * ng;
#ifdef AIPC_X86
    if (isa >= ISA_AVX512_VNNI) {
        quantize_row512(xm, dt, K, G, act_group, qm, sx, gsum);
        return;
    }
#endif
    (void)isa;
    row_to_f32(xm, dt, K, row);
    for (int64_t a = 0; a < nag; a++) {
        const float scale = quantize_span(row + a * act_group, act_group, qm + a * act_group);
        for (int64_t g = a * act_group / G; g < (a + 1) * act_group / G; g++) sx[g] = scale;
    }
    for (int64_t g = 0; g < ng; g++) {
        int32_t sum = 0;
        for (int64_t k = g * G; k < (g + 1) * G; k++) sum += qm[k];
        gsum[g] = sum;
    }
}

/* Quantizes x[M, K] to int8 with absmax scales per token (act_group == K) or per K-group.
 * xq: [M][K]; sx: [M][K/G] scale of each weight group; gsum: [M][K/G] group sums of xq.
 * With AVX-512 one fused pass per span (no float copy of the row).
 * One row (decode) is quantized by the calling thread: a parallel region, even an inactive one,
 * costs about half as much as the row itself (0.35 us of 0.6 us at K=4096). */
static int quantize_activations(const void *x, int dt, int64_t M, int64_t K, int64_t G, int64_t act_group, int isa,
                                int8_t *xq, float *sx, int32_t *gsum, int nthreads) {
    const int need_row = isa < ISA_AVX512_VNNI;
    if (M == 1) {
        float *row = need_row ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;
        if (need_row && !row) return ERR_NOMEM;
        quantize_row(x, dt, 0, K, G, act_group, isa, row, xq, sx, gsum);
        free(row);
        return OK;
    }
    int status = OK;
#pragma omp parallel num_threads(nthreads)
    {
        float *row = need_row ? (float *)malloc(sizeof(float) * (size_t)K) : NULL;
        if (need_row && !row) {
#pragma omp atomic write
            status = ERR_NOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            if (row || !need_row) quantize_row(x, dt, m, K, G, act_group, isa, row, xq, sx, gsum);
        free(row);
    }
    return status;
}

/* ------------------------------------------------------------------ shared kernel arguments */

typedef struct {
    const uint8_t *w;   /* packed codes, [N/16][K/kc][64] */
    const void *scales; /* [N/16][K/G][16] */
    const void *zeros;  /* same layout, or NULL: then zero_const */
    int scale_dt;
    int bits;
    int64_t M, N, K, G;
    float cmul, zero_const;
    const int8_t *xq;   /* [M][K] */
    const int32_t *xt;  /* AVX-512 paths: [ceil(M/T)][K/4][T] quads, tokens of a tile interleaved */
    int64_t T;          /* tokens per tile of xt */
    /* The one epilogue every kernel computes (batch invariance: a row's bits do not depend on M, the
     * tile or the ISA), per token m, output n and group g, in group order, with fused multiply-adds:
     *   u = dot - z * zq[m,g];  acc = fma(s * ws[m,g], u, acc);  y = acc * outs[m] + bias
     * zq = (group sum of xq) / cmul is the zero term in code units; ws is the group's activation
     * scale (NULL with one scale per token: 1); outs[m] = cmul times the token's scale (per token) or
     * cmul (per group). */
    const float *zq;    /* [M][K/G] */
    const float *ws;    /* [M][K/G], or NULL */
    const float *outs;  /* [M] */
    const void *bias; /* [N] in out_dt, or NULL */
    void *y;          /* [M][N] */
    int out_dt;
} lowbit_args;

static inline int64_t chunk_k(int bits) { return CHUNK_BYTES * 8 / bits / BLOCK_N; }

/* Writes 16 outputs of token m: acc * outs[m] + bias, in the output dtype. */
static void store_block(const lowbit_args *a, int64_t m, int64_t n0, const float *acc16) {
    const int64_t nn = a->N - n0 < BLOCK_N ? a->N - n0 : BLOCK_N;
    for (int64_t j = 0; j < nn; j++) {
        float v = acc16[j] * a->outs[m];
        if (a->bias) v += load_f(a->bias, n0 + j, a->out_dt);
        store_f(a->y, m * a->N + n0 + j, a->out_dt, v);
    }
}

/* ------------------------------------------------------------------ portable C */

static void block_scalar(const lowbit_args *a, int64_t nb) {
    const int64_t kc = chunk_k(a->bits), ng = a->K / a->G, nq = kc / 4;
    const uint8_t *wb = a->w + nb * (a->K / kc) * CHUNK_BYTES;
    const int mask = (1 << a->bits) - 1;
    for (int64_t m = 0; m < a->M; m++) {
        float acc[BLOCK_N] = {0};
        for (int64_t g = 0; g < ng; g++) {
            int32_t dot[BLOCK_N] = {0};
            for (int64_t c = g * a->G / kc; c < (g + 1) * a->G / kc; c++) {
                const uint8_t *wc = wb + c * CHUNK_BYTES;
                for (int64_t q = 0; q < nq; q++) {
                    const int8_t *xp = a->xq + m * a->K + c * kc + q * 4;
                    for (int n = 0; n < BLOCK_N; n++)
                        for (int kk = 0; kk < 4; kk++)
                            dot[n] += ((wc[n * 4 + kk] >> (q * a->bits)) & mask) * xp[kk];
                }
            }
            const int64_t si = (nb * ng + g) * BLOCK_N, mg = m * ng + g;
            const float w = a->ws ? a->ws[mg] : 1.f;
            for (int n = 0; n < BLOCK_N; n++) {
                const float s = load_f(a->scales, si + n, a->scale_dt);
                const float z = a->zeros ? load_f(a->zeros, si + n, a->scale_dt) : a->zero_const;
                acc[n] = fmaf(s * w, fmaf(-z, a->zq[mg], (float)dot[n]), acc[n]);
            }
        }
        store_block(a, m, nb * BLOCK_N, acc);
    }
}

#ifdef AIPC_X86
/* ------------------------------------------------------------------ AVX-512 VNNI */

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

/* acc += u8(a) . s8(b) per 32-bit lane. GCC 12 allocates the _mm512_dpbusd_epi32 builtin with a
 * register copy around every accumulate; this ties the accumulator in place. */
static inline T512 __m512i dpbusd512(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

static inline T512 __m512 half16_to_ps(__m256i h, int dt) {
    if (dt == DT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 activations x[i..i+15] (fp32, bf16 or fp16) as float32. */
static inline T512 __m512 load16_act(const void *x, int64_t i, int dt) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)x + i);
    return half16_to_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i)), dt);
}

/* quantize_span + group sums for one row, fused: per span an absmax pass over x, then one pass that
 * rounds (same arithmetic as quantize_span: bit-identical codes and scales), stores the int8 codes and
 * sums them per weight group. G is a multiple of 16 (the 2-bit chunk). */
static T512 void quantize_row512(const void *x, int dt, int64_t K, int64_t G, int64_t act_group, int8_t *q, float *sx,
                                 int32_t *gsum) {
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    for (int64_t a0 = 0; a0 < K; a0 += act_group) {
        __m512i mx = _mm512_setzero_si512(); /* max of |x| bit patterns, as quantize_span */
        for (int64_t k = a0; k < a0 + act_group; k += 16)
            mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_castps_si512(load16_act(x, k, dt)), absmask));
        const uint32_t abits = (uint32_t)_mm512_reduce_max_epu32(mx);
        float amax;
        memcpy(&amax, &abits, 4);
        const float inv_s = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
        const __m512 inv = _mm512_set1_ps(inv_s);
        for (int64_t g = a0 / G; g < (a0 + act_group) / G; g++) {
            __m512i sum = _mm512_setzero_si512();
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                /* round to nearest even, as the magic-number rounding of quantize_span: same codes */
                const __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(load16_act(x, k, dt), inv),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(v));
                sum = _mm512_add_epi32(sum, v);
            }
            sx[g] = scale;
            gsum[g] = _mm512_reduce_add_epi32(sum);
        }
    }
}

/* 16 fp16/bf16 values at p[i..i+15] as float32. */
static inline T512 __m512 load16_scales(const void *p, int64_t i, int dt) {
    return half16_to_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)), dt);
}

static inline T512 __m512 load16_scales_masked(const void *p, int64_t i, int dt, __mmask16 k) {
    return half16_to_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i), dt);
}

/* Up-converts plane q of a 64-byte chunk to 16 rows x 4 k of u8 codes. */
static inline T512 __m512i plane512(__m512i w, int q, int bits) {
    const __m512i mask = _mm512_set1_epi8((char)((1 << bits) - 1));
    return _mm512_and_si512(q ? _mm512_srli_epi16(w, (unsigned)(q * bits)) : w, mask);
}

/* The epilogue of group g for MT tokens (see lowbit_args): u = dot - z * zq; acc += s * ws * u. */
static inline T512 void group_epilogue512(const lowbit_args *a, int64_t nb, int64_t g, int64_t m0, int mt,
                                          const __m512i *dot, __m512 *acc) {
    const int64_t ng = a->K / a->G, si = (nb * ng + g) * BLOCK_N;
    const __m512 s = load16_scales(a->scales, si, a->scale_dt);
    const __m512 z = a->zeros ? load16_scales(a->zeros, si, a->scale_dt) : _mm512_set1_ps(a->zero_const);
    for (int i = 0; i < mt; i++) {
        const int64_t mg = (m0 + i) * ng + g;
        const __m512 u = _mm512_fnmadd_ps(z, _mm512_set1_ps(a->zq[mg]), _mm512_cvtepi32_ps(dot[i]));
        acc[i] = _mm512_fmadd_ps(a->ws ? _mm512_mul_ps(s, _mm512_set1_ps(a->ws[mg])) : s, u, acc[i]);
    }
}

/* Writes 16 outputs of row block nb for MT tokens: acc * outs[m] + bias, in the output dtype. */
static inline T512 void store512(const lowbit_args *a, int64_t m0, int mt, int64_t nb, const __m512 *acc) {
    const int64_t n0 = nb * BLOCK_N, nn = a->N - n0 < BLOCK_N ? a->N - n0 : BLOCK_N;
    const __mmask16 k = (__mmask16)((1u << nn) - 1u);
    __m512 bias = _mm512_setzero_ps();
    if (a->bias) {
        if (a->out_dt == DT_F32) bias = _mm512_maskz_loadu_ps(k, (const float *)a->bias + n0);
        else bias = load16_scales_masked(a->bias, n0, a->out_dt, k);
    }
    for (int i = 0; i < mt; i++) {
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(acc[i], _mm512_set1_ps(a->outs[m0 + i])), bias);
        const int64_t off = (m0 + i) * a->N + n0;
        if (a->out_dt == DT_F32) {
            _mm512_mask_storeu_ps((float *)a->y + off, k, v);
        } else {
            __m256i h;
            if (a->out_dt == DT_F16) {
                h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            } else { /* bf16, round to nearest even; NaN stays NaN */
                const __m512i u = _mm512_castps_si512(v);
                const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
                const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
                h = _mm512_cvtepi32_epi16(r);
            }
            _mm256_mask_storeu_epi16((uint16_t *)a->y + off, k, h);
        }
    }
}

/* Up-convert on the fly, MT tokens share each up-converted vector (decode / small M).
 * Plane q is masked in place (w & (mask << q*bits) = 2^(q*bits) * c_q), so no shift sits beside the
 * VNNI op on its port; each plane has its own int32 sums, shifted back once per group (exact: they
 * are multiples of 2^(q*bits)). */
static inline T512 __attribute__((always_inline)) void tile_otf512(const lowbit_args *a, int64_t nb, int64_t m0,
                                                                    const int MT, const int bits) {
    const int nq = 8 / bits;
    const int64_t kc = chunk_k(bits), ng = a->K / a->G, cpg = a->G / kc;
    const uint8_t *wb = a->w + nb * (a->K / kc) * CHUNK_BYTES;
    const int32_t *xt = a->xt + m0 * (a->K / 4); /* m0 is a multiple of T = MT's tile */
    __m512i pmask[8];
    for (int q = 0; q < nq; q++) pmask[q] = _mm512_set1_epi8((char)(((1 << bits) - 1) << (q * bits)));
    __m512 acc[4];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i dq[4][8];
        for (int i = 0; i < MT; i++)
            for (int q = 0; q < nq; q++) dq[i][q] = _mm512_setzero_si512();
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            const __m512i w = _mm512_loadu_si512((const void *)(wb + c * CHUNK_BYTES));
            _mm_prefetch((const char *)(wb + c * CHUNK_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(wb + c * CHUNK_BYTES);
            for (int q = 0; q < nq; q++) {
                const __m512i wq = _mm512_and_si512(w, pmask[q]);
                for (int i = 0; i < MT; i++)
                    dq[i][q] = dpbusd512(dq[i][q], wq, _mm512_set1_epi32(xt[(c * nq + q) * a->T + i]));
            }
        }
        __m512i dot[4];
        for (int i = 0; i < MT; i++) {
            dot[i] = dq[i][0];
            for (int q = 1; q < nq; q++) dot[i] = _mm512_add_epi32(dot[i], _mm512_srai_epi32(dq[i][q], (unsigned)(q * bits)));
        }
        group_epilogue512(a, nb, g, m0, MT, dot, acc);
    }
    store512(a, m0, MT, nb, acc);
}

/* Decode (one token): explicit accumulators, one per bit-plane. */
#define PLANE_DOT(d, q) d = dpbusd512(d, _mm512_and_si512(w, m##q), _mm512_set1_epi32(xp[c * NQ + q]))

static T512 __attribute__((noinline)) void gemv512_2b(const lowbit_args *a, int64_t nb, int64_t m) {
    enum { NQ = 4 };
    const int64_t kc = chunk_k(2), ng = a->K / a->G, cpg = a->G / kc;
    const uint8_t *wb = a->w + nb * (a->K / kc) * CHUNK_BYTES;
    const __m512i m0 = _mm512_set1_epi8(0x03), m1 = _mm512_set1_epi8(0x0c), m2 = _mm512_set1_epi8(0x30),
                  m3 = _mm512_set1_epi8((char)0xc0);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wp = wb + g * cpg * CHUNK_BYTES;
        const int32_t *xp = (const int32_t *)(a->xq + m * a->K) + g * cpg * NQ;
        /* four chains: a chunk takes longer to issue than the VNNI latency (a second set of chains, to
         * be merged per group, measured 3% slower) */
        __m512i d0 = _mm512_setzero_si512(), d1 = d0, d2 = d0, d3 = d0;
        for (int64_t c = 0; c < cpg; c++) {
            _mm_prefetch((const char *)(wp + c * CHUNK_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(wp + c * CHUNK_BYTES);
            const __m512i w = _mm512_loadu_si512((const void *)(wp + c * CHUNK_BYTES));
            PLANE_DOT(d0, 0);
            PLANE_DOT(d1, 1);
            PLANE_DOT(d2, 2);
            PLANE_DOT(d3, 3);
        }
        __m512i dot = _mm512_add_epi32(_mm512_add_epi32(d0, _mm512_srai_epi32(d1, 2)),
                                       _mm512_add_epi32(_mm512_srai_epi32(d2, 4), _mm512_srai_epi32(d3, 6)));
        group_epilogue512(a, nb, g, m, 1, &dot, &acc);
    }
    store512(a, m, 1, nb, &acc);
}

static T512 __attribute__((noinline)) void gemv512_1b(const lowbit_args *a, int64_t nb, int64_t m) {
    enum { NQ = 8 };
    const int64_t kc = chunk_k(1), ng = a->K / a->G, cpg = a->G / kc;
    const uint8_t *wb = a->w + nb * (a->K / kc) * CHUNK_BYTES;
    const __m512i m0 = _mm512_set1_epi8(0x01), m1 = _mm512_set1_epi8(0x02), m2 = _mm512_set1_epi8(0x04),
                  m3 = _mm512_set1_epi8(0x08), m4 = _mm512_set1_epi8(0x10), m5 = _mm512_set1_epi8(0x20),
                  m6 = _mm512_set1_epi8(0x40), m7 = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wp = wb + g * cpg * CHUNK_BYTES;
        const int32_t *xp = (const int32_t *)(a->xq + m * a->K) + g * cpg * NQ;
        __m512i d0 = _mm512_setzero_si512(), d1 = d0, d2 = d0, d3 = d0, d4 = d0, d5 = d0, d6 = d0, d7 = d0;
        for (int64_t c = 0; c < cpg; c++) {
            _mm_prefetch((const char *)(wp + c * CHUNK_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(wp + c * CHUNK_BYTES);
            const __m512i w = _mm512_loadu_si512((const void *)(wp + c * CHUNK_BYTES));
            PLANE_DOT(d0, 0);
            PLANE_DOT(d1, 1);
            PLANE_DOT(d2, 2);
            PLANE_DOT(d3, 3);
            PLANE_DOT(d4, 4);
            PLANE_DOT(d5, 5);
            PLANE_DOT(d6, 6);
            PLANE_DOT(d7, 7);
        }
        __m512i lo = _mm512_add_epi32(_mm512_add_epi32(d0, _mm512_srai_epi32(d1, 1)),
                                      _mm512_add_epi32(_mm512_srai_epi32(d2, 2), _mm512_srai_epi32(d3, 3)));
        __m512i hi = _mm512_add_epi32(_mm512_add_epi32(_mm512_srai_epi32(d4, 4), _mm512_srai_epi32(d5, 5)),
                                      _mm512_add_epi32(_mm512_srai_epi32(d6, 6), _mm512_srai_epi32(d7, 7)));
        __m512i dot = _mm512_add_epi32(lo, hi);
        group_epilogue512(a, nb, g, m, 1, &dot, &acc);
    }
    store512(a, m, 1, nb, &acc);
}
#undef PLANE_DOT

/* Block already up-converted to int8 planes in `up` ([K/4][64] bytes): reused by every token tile. */
static inline T512 __attribute__((always_inline)) void tile_up512(const lowbit_args *a, int64_t nb, int64_t m0,
                                                                   const int MT, const uint8_t *up) {
    const int64_t ng = a->K / a->G, qpg = a->G / 4;
    const int32_t *xt = a->xt + m0 * (a->K / 4);
    __m512 acc[8];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i dot[8];
        for (int i = 0; i < MT; i++) dot[i] = _mm512_setzero_si512();
        for (int64_t kq = g * qpg; kq < (g + 1) * qpg; kq++) {
            const __m512i wq = _mm512_load_si512((const void *)(up + kq * CHUNK_BYTES));
            for (int i = 0; i < MT; i++) dot[i] = dpbusd512(dot[i], wq, _mm512_set1_epi32(xt[kq * UP_M + i]));
        }
        group_epilogue512(a, nb, g, m0, MT, dot, acc);
    }
    store512(a, m0, MT, nb, acc);
}

static T512 void upconvert_block512(const lowbit_args *a, int64_t nb, uint8_t *up) {
    const int64_t kc = chunk_k(a->bits), nq = kc / 4, nchunks = a->K / kc;
    const uint8_t *wb = a->w + nb * nchunks * CHUNK_BYTES;
    for (int64_t c = 0; c < nchunks; c++) {
        const __m512i w = _mm512_loadu_si512((const void *)(wb + c * CHUNK_BYTES));
        for (int q = 0; q < nq; q++) _mm512_store_si512((void *)(up + (c * nq + q) * CHUNK_BYTES), plane512(w, q, a->bits));
    }
}


static T512 void block_avx512(const lowbit_args *a, int64_t nb, uint8_t *up) {
    if (a->M >= UP_MIN_M) {
        upconvert_block512(a, nb, up);
        int64_t m0 = 0;
        for (; m0 + UP_M <= a->M; m0 += UP_M) tile_up512(a, nb, m0, UP_M, up);
        switch (a->M - m0) {
        case 7: tile_up512(a, nb, m0, 7, up); break;
        case 6: tile_up512(a, nb, m0, 6, up); break;
        case 5: tile_up512(a, nb, m0, 5, up); break;
        case 4: tile_up512(a, nb, m0, 4, up); break;
        case 3: tile_up512(a, nb, m0, 3, up); break;
        case 2: tile_up512(a, nb, m0, 2, up); break;
        case 1: tile_up512(a, nb, m0, 1, up); break;
        default: break;
        }
        return;
    }
    if (a->M == 1) {
        if (a->bits == 2) gemv512_2b(a, nb, 0);
        else gemv512_1b(a, nb, 0);
        return;
    }
    const int64_t tile = a->bits == 2 ? OTF_M : OTF_M / 2;
    for (int64_t m0 = 0; m0 < a->M; m0 += tile) {
        const int64_t mt = a->M - m0 < tile ? a->M - m0 : tile;
        if (a->bits == 1) {
            if (mt == 2) tile_otf512(a, nb, m0, 2, 1);
            else tile_otf512(a, nb, m0, 1, 1);
            continue;
        }
        switch (mt) {
        case 4: tile_otf512(a, nb, m0, 4, 2); break;
        case 3: tile_otf512(a, nb, m0, 3, 2); break;
        case 2: tile_otf512(a, nb, m0, 2, 2); break;
        default: tile_otf512(a, nb, m0, 1, 2);
        }
    }
}

#ifdef AIPC_AMX
/* ------------------------------------------------------------------ AMX int8 (large M) */
/* Each row block is up-converted once per pass to an AMX B tile stream in VNNI order ([K/4][16 rows]
 * [4 k] int8): ks/4 consecutive 64-byte rows cover ks k for 16 outputs. For code books with a fixed
 * zero point the up-converted bytes are the signed levels r*(cmul*c - z) (r = 1 or 2 makes them
 * integers), so no zero correction is needed; the affine code book keeps the codes and subtracts
 * z * s * (group sum of xq). Activations are re-laid out once per call as A tiles ([M/16][K/ks][16
 * tokens][ks] int8, rows padded with zeros): each tile load is one contiguous 1 KB read. C tiles are 16
 * tokens x 16 outputs int32 (tdpbssd). Blocking: 2 token tiles x 2 row blocks = 4 C tiles per k step
 * (each A and B tile used twice). Per-token activation scales are applied once at the end. */

#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8")))
#define AMX_MB 256 /* tokens per pass over the weights: their A tiles stay in L2 */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

typedef struct {
    const int8_t *xa;  /* A tiles */
    int64_t ks;        /* k per tile step */
    int level_mul;     /* fixed zero: up-converted byte = level_mul * c - level_sub; 0: affine (codes) */
    int level_sub;
    float level_scale; /* 1 / (r * cmul), 1 or 1/2: a dot of levels times it is exactly u = dot - z * zq */
    int64_t nblocks;
} amx_plan;

/* k per tile step: 64, or 32 where the group size is an odd multiple of 32 */
static inline int64_t amx_kstep(int64_t G) { return G % 64 ? 32 : 64; }

static TAMX void amx_configure(int64_t ks) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = AMX_M, cfg.colsb[t] = 64;              /* C */
    for (int t = 4; t < 6; t++) cfg.rows[t] = AMX_M, cfg.colsb[t] = (uint16_t)ks;    /* A0, A1 */
    for (int t = 6; t < 8; t++) cfg.rows[t] = (uint8_t)(ks / 4), cfg.colsb[t] = 64;  /* B0, B1 */
    /* not _tile_loadconfig: GCC 12's version declares an 8-byte operand, so the stores of the
     * other 56 bytes are dropped as dead */
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

static TAMX void amx_release(void) { _tile_release(); }

/* Activations as A tiles: xa[(t * K/ks + s) * 16 * ks + i * ks + j] = xq[(16t + i) * K + s * ks + j]. */
static void amx_tile_activations(const int8_t *xq, int64_t Mp, int64_t K, int64_t ks, int8_t *xa) {
    const int64_t steps = K / ks;
    for (int64_t t = 0; t < Mp / AMX_M; t++)
        for (int64_t st = 0; st < steps; st++)
            for (int64_t i = 0; i < AMX_M; i++)
                memcpy(xa + ((t * steps + st) * AMX_M + i) * ks, xq + (t * AMX_M + i) * K + st * ks, (size_t)ks);
}

/* Row block nb as B tiles; signed levels for fixed-zero code books. */
static TAMX void amx_upconvert(const lowbit_args *a, const amx_plan *pl, int64_t nb, uint8_t *up) {
    if (!pl->level_mul) {
        upconvert_block512(a, nb, up);
        return;
    }
    const int64_t kc = chunk_k(a->bits), nq = kc / 4, nchunks = a->K / kc;
    const uint8_t *wb = a->w + nb * nchunks * CHUNK_BYTES;
    const __m512i sub = _mm512_set1_epi8((char)pl->level_sub);
    for (int64_t c = 0; c < nchunks; c++) {
        const __m512i w = _mm512_loadu_si512((const void *)(wb + c * CHUNK_BYTES));
        for (int q = 0; q < nq; q++) {
            __m512i v = plane512(w, q, a->bits);
            if (pl->level_mul == 2) v = _mm512_add_epi8(v, v);
            _mm512_store_si512((void *)(up + (c * nq + q) * CHUNK_BYTES), _mm512_sub_epi8(v, sub));
        }
    }
}

/* acc[i][:] (tokens m0 + i, row block nb) += group g's contribution from the int32 dots c[i][:], the
 * epilogue of lowbit_args bit for bit: with fixed-zero levels c is r * cmul * u exactly, else the dot of
 * the codes (zq, ws: padded to whole tiles). */
static inline TAMX void amx_epilogue(const lowbit_args *a, const amx_plan *pl, int64_t nb, int64_t g, int64_t m0,
                                     const int32_t *__restrict c, float *__restrict acc) {
    const int64_t ng = a->K / a->G, si = (nb * ng + g) * BLOCK_N;
    const __m512 s = load16_scales(a->scales, si, a->scale_dt);
    const __m512 z = a->zeros ? load16_scales(a->zeros, si, a->scale_dt) : _mm512_set1_ps(a->zero_const);
    const __m512 ls = _mm512_set1_ps(pl->level_scale);
    for (int i = 0; i < AMX_M; i++) {
        const int64_t mg = (m0 + i) * ng + g;
        const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512(c + i * BLOCK_N));
        const __m512 u = pl->level_mul ? _mm512_mul_ps(d, ls) : _mm512_fnmadd_ps(z, _mm512_set1_ps(a->zq[mg]), d);
        const __m512 sw = a->ws ? _mm512_mul_ps(s, _mm512_set1_ps(a->ws[mg])) : s;
        _mm512_store_ps(acc + i * BLOCK_N, _mm512_fmadd_ps(sw, u, _mm512_load_ps(acc + i * BLOCK_N)));
    }
}

/* Row blocks 2*pr and 2*pr + 1 (if it exists) for tokens [mb0, mb0 + mbt). up: 2 x [K/4][64] bytes,
 * acc: 2 x [AMX_MB][16] floats, cbuf: [4][16][16] int32. */
static TAMX void amx_block_pair(const lowbit_args *a, const amx_plan *pl, int64_t pr, int64_t mb0, int64_t mbt,
                                uint8_t *up, int32_t *cbuf, float *acc) {
    const int64_t nb = 2 * pr, ublock = a->K / 4 * CHUNK_BYTES;
    const int64_t K = a->K, G = a->G, ng = K / G, ks = pl->ks, spg = G / ks, steps = K / ks;
    const int two_n = nb + 1 < pl->nblocks;
    const uint8_t *up0 = up, *up1 = up + ublock;
    float *acc0 = acc, *acc1 = acc + AMX_MB * BLOCK_N;
    const int64_t nt = (mbt + AMX_M - 1) / AMX_M, rows = nt * AMX_M;
    amx_upconvert(a, pl, nb, up);
    if (two_n) amx_upconvert(a, pl, nb + 1, up + ublock);
    memset(acc0, 0, sizeof(float) * (size_t)(rows * BLOCK_N));
    memset(acc1, 0, sizeof(float) * (size_t)(rows * BLOCK_N));
    for (int64_t g = 0; g < ng; g++) {
        for (int64_t j = 0; j < nt; j += 2) {
            const int two_m = j + 1 < nt;
            const int8_t *x0 = pl->xa + ((mb0 / AMX_M + j) * steps + g * spg) * AMX_M * ks, *x1 = x0 + steps * AMX_M * ks;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t st = 0; st < spg; st++) {
                const int64_t kq = (g * G + st * ks) / 4;
                _tile_loadd(6, up0 + kq * CHUNK_BYTES, CHUNK_BYTES);
                _tile_loadd(4, x0 + st * AMX_M * ks, ks);
                _tile_dpbssd(0, 4, 6);
                if (two_n) {
                    _tile_loadd(7, up1 + kq * CHUNK_BYTES, CHUNK_BYTES);
                    _tile_dpbssd(1, 4, 7);
                }
                if (two_m) {
                    _tile_loadd(5, x1 + st * AMX_M * ks, ks);
                    _tile_dpbssd(2, 5, 6);
                    if (two_n) _tile_dpbssd(3, 5, 7);
                }
            }
            const int64_t m0 = j * AMX_M;
            _tile_stored(0, cbuf, 64);
            if (two_n) _tile_stored(1, cbuf + 256, 64);
            if (two_m) _tile_stored(2, cbuf + 512, 64);
            if (two_m && two_n) _tile_stored(3, cbuf + 768, 64);
            amx_epilogue(a, pl, nb, g, mb0 + m0, cbuf, acc0 + m0 * BLOCK_N);
            if (two_n) amx_epilogue(a, pl, nb + 1, g, mb0 + m0, cbuf + 256, acc1 + m0 * BLOCK_N);
            if (two_m) amx_epilogue(a, pl, nb, g, mb0 + m0 + AMX_M, cbuf + 512, acc0 + (m0 + AMX_M) * BLOCK_N);
            if (two_m && two_n) amx_epilogue(a, pl, nb + 1, g, mb0 + m0 + AMX_M, cbuf + 768, acc1 + (m0 + AMX_M) * BLOCK_N);
        }
    }
    store512(a, mb0, (int)mbt, nb, (const __m512 *)acc0);
    if (two_n) store512(a, mb0, (int)mbt, nb + 1, (const __m512 *)acc1);
}

/* How the up-converted bytes encode the levels: signed r*(cmul*c - z) when those are small integers. */
static void amx_levels(const lowbit_args *a, amx_plan *pl) {
    pl->level_mul = 0, pl->level_sub = 0, pl->level_scale = 1.f;
    if (a->zeros) return;
    for (int r = 1; r <= 2; r++) {
        const float m = a->cmul * (float)r, z = a->zero_const * (float)r;
        if (m == (float)(int)m && z == (float)(int)z && (m == 1.f || m == 2.f) && fabsf(z) <= 64.f) {
            pl->level_mul = (int)m, pl->level_sub = (int)z, pl->level_scale = 1.f / m;
            return;
        }
    }
}

/* AMX-INT8 on the CPU, enabled by the OS (XCR0 tile state) and permitted for this process. */
static int amx_usable(void) {
    static int usable = -1;
    if (usable >= 0) return usable;
    unsigned eax, ebx, ecx, edx;
    usable = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return 0;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & (3u << 17)) != (3u << 17)) return 0;
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18); succeeds again if already granted */
    usable = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return usable;
}
#endif /* AIPC_AMX */

/* ------------------------------------------------------------------ 256-bit: AVX-VNNI and AVX2 */

/* 8 fp16/bf16 scales at p[i..i+7] as float32. */
#define LOAD8_SCALES(p, i, dt)                                                                                \
    ((dt) == DT_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(p) + (i))))       \
                    : _mm256_castsi256_ps(_mm256_slli_epi32(                                                  \
                          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)(p) + (i)))), 16)))

/* The 256-bit kernels (AVX-VNNI, AVX2: the widest ISAs of client CPUs such as Core Ultra), decode
 * included. The 64-byte chunk is processed as two 32-byte halves: rows 0-7 and rows 8-15. A tile of
 * MT <= 4 tokens shares each up-converted plane; MT and BITS are compile-time constants of each instance
 * (switch in NAME), so the accumulators live in registers and the plane / token loops unroll: one token
 * streams as fast as a dedicated decode kernel with 8 chains did (A/B, 1024-14336 x 4096, within 2%). */
#define DEFINE_BLOCK256(NAME, TARGET, DOT)                                                                    \
    static inline TARGET __attribute__((always_inline)) void NAME##_tile(const lowbit_args *a, int64_t nb,   \
                                                                          int64_t m0, const int MT,          \
                                                                          const int BITS) {                  \
        const int64_t kc = chunk_k(BITS), ng = a->K / a->G, cpg = a->G / kc;                                 \
        const int nq = kc / 4;                                                                               \
        const uint8_t *wb = a->w + nb * (a->K / kc) * CHUNK_BYTES;                                           \
        const __m256i mask = _mm256_set1_epi8((char)((1 << BITS) - 1));                                     \
        const __m256i ones16 = _mm256_set1_epi16(1);                                                         \
        (void)ones16;                                                                                        \
        const int32_t *xr[4];                                                                                \
        for (int i = 0; i < MT; i++) xr[i] = (const int32_t *)(a->xq + (m0 + i) * a->K);                     \
        __m256 acc[4][2];                                                                                    \
        for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();                            \
        for (int64_t g = 0; g < ng; g++) {                                                                   \
            __m256i dot[4][2];                                                                               \
            for (int i = 0; i < MT; i++) dot[i][0] = dot[i][1] = _mm256_setzero_si256();                     \
            for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {                                              \
                _mm_prefetch((const char *)(wb + c * CHUNK_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);             \
                PREFETCH_L2(wb + c * CHUNK_BYTES);                                                           \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + c * CHUNK_BYTES));              \
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + c * CHUNK_BYTES + 32));         \
                for (int q = 0; q < nq; q++) {                                                               \
                    const __m256i p0 = _mm256_and_si256(q ? _mm256_srli_epi16(w0, q * BITS) : w0, mask);     \
                    const __m256i p1 = _mm256_and_si256(q ? _mm256_srli_epi16(w1, q * BITS) : w1, mask);     \
                    for (int i = 0; i < MT; i++) {                                                           \
                        const __m256i xb = _mm256_set1_epi32(xr[i][c * nq + q]);                             \
                        dot[i][0] = DOT(dot[i][0], p0, xb);                                                  \
                        dot[i][1] = DOT(dot[i][1], p1, xb);                                                  \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
            const int64_t si = (nb * ng + g) * BLOCK_N;                                                      \
            for (int h = 0; h < 2; h++) {                                                                    \
                const __m256 s = LOAD8_SCALES(a->scales, si + 8 * h, a->scale_dt);                           \
                const __m256 z = a->zeros ? LOAD8_SCALES(a->zeros, si + 8 * h, a->scale_dt)                  \
                                          : _mm256_set1_ps(a->zero_const);                                   \
                for (int i = 0; i < MT; i++) {                                                           \
                    const int64_t mg = (m0 + i) * ng + g;                                                \
                    const __m256 u = _mm256_fnmadd_ps(z, _mm256_set1_ps(a->zq[mg]),                      \
                                                      _mm256_cvtepi32_ps(dot[i][h]));                    \
                    const __m256 sw = a->ws ? _mm256_mul_ps(s, _mm256_set1_ps(a->ws[mg])) : s;           \
                    acc[i][h] = _mm256_fmadd_ps(sw, u, acc[i][h]);                                       \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int i = 0; i < MT; i++) {                                                                       \
            float buf[BLOCK_N];                                                                              \
            _mm256_storeu_ps(buf, acc[i][0]);                                                                \
            _mm256_storeu_ps(buf + 8, acc[i][1]);                                                            \
            store_block(a, m0 + i, nb * BLOCK_N, buf);                                                       \
        }                                                                                                    \
    }                                                                                                        \
    static TARGET void NAME(const lowbit_args *a, int64_t nb) {                                              \
        for (int64_t m0 = 0; m0 < a->M; m0 += 4) {                                                           \
            const int mt = a->M - m0 < 4 ? (int)(a->M - m0) : 4;                                             \
            if (a->bits == 2) {                                                                              \
                switch (mt) {                                                                                \
                case 4: NAME##_tile(a, nb, m0, 4, 2); break;                                                 \
                case 3: NAME##_tile(a, nb, m0, 3, 2); break;                                                 \
                case 2: NAME##_tile(a, nb, m0, 2, 2); break;                                                 \
                default: NAME##_tile(a, nb, m0, 1, 2);                                                       \
                }                                                                                            \
            } else {                                                                                         \
                switch (mt) {                                                                                \
                case 4: NAME##_tile(a, nb, m0, 4, 1); break;                                                 \
                case 3: NAME##_tile(a, nb, m0, 3, 1); break;                                                 \
                case 2: NAME##_tile(a, nb, m0, 2, 1); break;                                                 \
                default: NAME##_tile(a, nb, m0, 1, 1);                                                       \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }

#define DOT_AVXVNNI(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define DOT_AVX2(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones16))

DEFINE_BLOCK256(block_avxvnni, __attribute__((target("avx2,avxvnni,f16c,fma"))), DOT_AVXVNNI)
DEFINE_BLOCK256(block_avx2, __attribute__((target("avx2,f16c,fma"))), DOT_AVX2)
#endif /* AIPC_X86 */

/* ------------------------------------------------------------------ dispatch */

static int detect_isa(void) {
#ifdef AIPC_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
#ifdef AIPC_AMX
        if (amx_usable()) return ISA_AMX_INT8;
#endif
        return ISA_AVX512_VNNI;
    }
    if (__builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2")) return ISA_AVX_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

static int g_isa = -1;

/* Best ISA this CPU supports (the one used unless overridden). */
API int aipc_best_isa(void) { return detect_isa(); }

/* ISA used by the kernels. */
API int aipc_get_isa(void) {
    if (g_isa < 0) g_isa = detect_isa();
    return g_isa;
}

/* Forces an ISA (for tests and benchmarks); refuses one the CPU lacks. */
API int aipc_set_isa(int isa) {
    if (isa < ISA_SCALAR || isa > detect_isa()) return ERR_ISA;
#ifdef AIPC_X86
    if (isa == ISA_AVX_VNNI && !__builtin_cpu_supports("avxvnni")) return ERR_ISA;
#endif
    g_isa = isa;
    return OK;
}

/*
 * y[M][N] = x[M][K] @ dequant(w)^T + bias. x and y (and bias) share `dt` (DT_F32/BF16/F16); scales and
 * zeros use `scale_dt` (DT_BF16 or DT_F16). Levels are cmul * code - zero point: zero_const for a code
 * book with a fixed zero point (zeros NULL, or ignored), NaN for one with per-group zero points (then
 * zeros is required). act_group: K for per-token activation scales, or the weight group size (or a
 * multiple of it dividing K) for per-group ones. nthreads: 0 for OpenMP's default. bias may be NULL.
 * Returns 0 or a negative error (the ERR_ values; native.ERRORS words them).
 */
API int aipc_lowbit_linear(const void *x, int dt, int64_t M, int64_t K, const uint8_t *w, int bits, int64_t N,
                           const void *scales, const void *zeros, int scale_dt, int64_t G, float cmul,
                           float zero_const, const void *bias, void *y, int64_t act_group, int nthreads) {
    if (bits != 1 && bits != 2) return ERR_BITS;
    /* sizes: every index (m * K + k, block offsets, scratch) stays far from int64 / size_t overflow */
    if (M < 0 || N <= 0 || K <= 0 || K % chunk_k(bits) || K > (INT64_C(1) << 40) / (M > N ? M : N)) return ERR_SHAPE;
    if (G <= 0 || K % G || G % chunk_k(bits) || act_group <= 0 || K % act_group || act_group % G) return ERR_GROUP;
    if (dt < DT_F32 || dt > DT_F16 || (scale_dt != DT_BF16 && scale_dt != DT_F16)) return ERR_DTYPE;
    if (!(isfinite(cmul) && cmul > 0.f) || isinf(zero_const)) return ERR_CODEBOOK;
    if (isnan(zero_const)) { /* per-group zero points: the kernels read zeros, never zero_const */
        if (!zeros) return ERR_ZEROS;
        zero_const = 0.f;
    }
    if (nthreads < 0 || nthreads > MAX_THREADS) return ERR_THREADS;
    if (M == 0) return OK;
    if (!x || !w || !scales || !y) return ERR_NULL;
    if (nthreads == 0) nthreads = omp_get_max_threads();
    const int64_t ng = K / G, nblocks = (N + BLOCK_N - 1) / BLOCK_N;
    const int isa = aipc_get_isa();
    const int use_amx = isa == ISA_AMX_INT8 && M >= AMX_MIN_M;
    /* AMX tiles read 16 token rows: pad xq with zero rows (their outputs are never stored) */
    const int64_t Mp = use_amx ? (M + AMX_M - 1) / AMX_M * AMX_M : M;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((Mp * K + 63) / 64 * 64));
    /* scratch, zeroed: [Mp][K/G] each (AMX reads whole tiles of rows) sx and zq (float), gsum (int32);
     * outs [Mp] */
    float *sx = (float *)calloc((size_t)(3 * Mp * ng + Mp), sizeof(float));
    if (!xq || !sx) {
        free(xq); free(sx);
        return ERR_NOMEM;
    }
    float *zq = sx + Mp * ng, *outs = sx + 3 * Mp * ng;
    int32_t *gsum = (int32_t *)(sx + 2 * Mp * ng);
    if (Mp > M) memset(xq + M * K, 0, (size_t)((Mp - M) * K));
    if (quantize_activations(x, dt, M, K, G, act_group, isa, xq, sx, gsum, nthreads) != OK) {
        free(xq); free(sx);
        return ERR_NOMEM;
    }
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < ng; g++) zq[m * ng + g] = (float)gsum[m * ng + g] / cmul;
        outs[m] = act_group == K ? sx[m * ng] * cmul : cmul;
    }
    /* AVX-512 tiles read the quads of their T tokens side by side: one pointer, constant offsets */
    const int64_t T = M == 1 ? 1 : M >= UP_MIN_M ? UP_M : bits == 2 ? OTF_M : OTF_M / 2, K4 = K / 4;
    int32_t *xt = (int32_t *)xq;
    if (isa >= ISA_AVX512_VNNI && T > 1 && !use_amx) {
        const int64_t tiles = (M + T - 1) / T;
        xt = (int32_t *)aligned_alloc(64, (size_t)(tiles * T * K4 * 4 + 63) / 64 * 64);
        if (!xt) {
            free(xq); free(sx);
            return ERR_NOMEM;
        }
        const int32_t *rows = (const int32_t *)xq;
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t kq = 0; kq < K4; kq++)
                for (int64_t i = 0; i < T; i++)
                    xt[(t * K4 + kq) * T + i] = t * T + i < M ? rows[(t * T + i) * K4 + kq] : 0;
    }
    const lowbit_args a = {w, scales, zeros, scale_dt, bits, M, N, K, G, cmul, zero_const, xq, xt, T, zq,
                           act_group == K ? NULL : sx, outs, bias, y, dt};
    int status = OK;
#ifdef AIPC_AMX
    if (use_amx) {
        const int64_t ublock = K / 4 * CHUNK_BYTES;
        amx_plan pl;
        amx_levels(&a, &pl);
        pl.ks = amx_kstep(G), pl.nblocks = nblocks;
        const int64_t npairs = (nblocks + 1) / 2;
        int8_t *xa = (int8_t *)aligned_alloc(64, (size_t)((Mp * K + 63) / 64 * 64));
        if (!xa) {
            free(xq); free(sx);
            return ERR_NOMEM;
        }
        amx_tile_activations(xq, Mp, K, pl.ks, xa);
        pl.xa = xa;
        if (npairs < nthreads) nthreads = (int)npairs;
#pragma omp parallel num_threads(nthreads)
        {
            uint8_t *up = (uint8_t *)aligned_alloc(64, (size_t)(2 * ublock));
            float *acc = (float *)aligned_alloc(64, sizeof(float) * 2 * AMX_MB * BLOCK_N);
            int32_t cbuf[4 * AMX_M * BLOCK_N] __attribute__((aligned(64)));
            const int ok = up && acc;
            if (!ok) {
#pragma omp atomic write
                status = ERR_NOMEM;
            } else {
                amx_configure(pl.ks); /* tile configuration is per thread */
            }
            for (int64_t mb0 = 0; mb0 < M; mb0 += AMX_MB) {
                const int64_t mbt = M - mb0 < AMX_MB ? M - mb0 : AMX_MB;
#pragma omp for schedule(static)
                for (int64_t pr = 0; pr < npairs; pr++)
                    if (ok) amx_block_pair(&a, &pl, pr, mb0, mbt, up, cbuf, acc);
            }
            if (ok) amx_release();
            free(up);
            free(acc);
        }
        free(xa);
        free(xq); free(sx);
        return status;
    }
#endif
    if (nblocks < nthreads) nthreads = (int)nblocks;
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *up = NULL;
#ifdef AIPC_X86
        if (isa >= ISA_AVX512_VNNI && M >= UP_MIN_M) {
            up = (uint8_t *)aligned_alloc(64, (size_t)(K / 4 * CHUNK_BYTES));
            if (!up) {
#pragma omp atomic write
                status = ERR_NOMEM;
            }
        }
#endif
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            switch (isa) {
#ifdef AIPC_X86
            case ISA_AMX_INT8: /* fewer tokens than an AMX tile: the AVX-512 kernels */
            case ISA_AVX512_VNNI:
                if (up || M < UP_MIN_M) block_avx512(&a, nb, up);
                break;
            case ISA_AVX_VNNI: block_avxvnni(&a, nb); break;
            case ISA_AVX2: block_avx2(&a, nb); break;
#endif
            default: block_scalar(&a, nb);
            }
        }
        free(up);
    }
    if (xt != (int32_t *)xq) free(xt);
    free(xq);
    free(sx);
    return status;
}

/* aipc_lowbit_linear with its 17 arguments in one int64 vector, in the same order (pointers as
 * addresses, 0 for NULL; cmul and zero_const as float32 bit patterns). For ctypes: converting 17
 * arguments costs ~2 us per call, one pointer ~0.2 us, and decode makes a call per linear layer. */
API int aipc_lowbit_linear_v(const int64_t *v) {
    float cmul, zero_const;
    const int32_t cbits = (int32_t)v[11], zbits = (int32_t)v[12];
    memcpy(&cmul, &cbits, 4);
    memcpy(&zero_const, &zbits, 4);
    return aipc_lowbit_linear((const void *)v[0], (int)v[1], v[2], v[3], (const uint8_t *)v[4], (int)v[5], v[6],
                              (const void *)v[7], (const void *)v[8], (int)v[9], v[10], cmul, zero_const,
                              (const void *)v[13], (void *)v[14], v[15], (int)v[16]);
}

/* One thread's share of aipc_stream_read: 64-byte lines, four independent accumulators, and the same
 * software prefetch as the weight stream (without it this probe read ~10% less than torch's fp32 GEMV). */
MULTIVERSION static uint64_t read_span(const uint64_t *p, int64_t n) {
    uint64_t a[4][8] = {{0}};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
#ifdef AIPC_X86
        for (int j = 0; j < 4; j++) { /* the weight stream's two prefetch distances */
            _mm_prefetch((const char *)(p + i + 8 * j) + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(p + i + 8 * j);
        }
#endif
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 8; l++) a[j][l] ^= p[i + 8 * j + l];
    }
    uint64_t t = 0;
    for (; i < n; i++) t ^= p[i];
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 8; l++) t ^= a[j][l];
    return t;
}

/* Reads `bytes` of `buf` with `nthreads` threads, each a contiguous share (for measuring read
 * bandwidth); returns a checksum so the reads cannot be elided. */
API uint64_t aipc_stream_read(const void *buf, int64_t bytes, int nthreads) {
    const uint64_t *p = (const uint64_t *)buf;
    const int64_t n = bytes / 8;
    uint64_t total = 0;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
#pragma omp parallel num_threads(nthreads) reduction(^ : total)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = n * t / nt / 8 * 8, hi = t == nt - 1 ? n : n * (t + 1) / nt / 8 * 8;
        total ^= read_span(p + lo, hi - lo);
    }
    return total;
}

/* ------------------------------------------------------------------ benchmark timing */

/* A call the timing loop repeats: call i of a round uses operand set i % n. Returns 0 or an error. */
typedef int (*timed_call)(const void *ctx, int64_t i);

typedef struct {
    const int64_t *const *vectors;
} linear_calls;

typedef struct {
    const void *const *bufs;
    int64_t bytes;
    int nthreads;
    volatile uint64_t sink;
} read_calls;

static int call_linear(const void *ctx, int64_t i) {
    return aipc_lowbit_linear_v(((const linear_calls *)ctx)->vectors[i]);
}

static int call_read(const void *ctx, int64_t i) {
    read_calls *r = (read_calls *)ctx;
    r->sink ^= aipc_stream_read(r->bufs[i], r->bytes, r->nthreads);
    return OK;
}

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Rounds of max(calls, n) calls over the n operand sets in turn, until two rounds and min_seconds have
 * passed; the best round's seconds per call, or the first error status (negative). The first two sets
 * are called once before (first-touch, thread start). */
static double time_rounds(timed_call f, const void *ctx, int64_t n, int64_t calls, double min_seconds) {
    if (n <= 0) return ERR_SHAPE;
    for (int64_t i = 0; i < (n < 2 ? n : 2); i++) {
        const int status = f(ctx, i);
        if (status != OK) return status;
    }
    if (calls < n) calls = n;
    double best = 1e30;
    const double end = seconds_now() + min_seconds;
    for (int rounds = 0; rounds < 2 || seconds_now() < end; rounds++) {
        const double t0 = seconds_now();
        for (int64_t i = 0; i < calls; i++) {
            const int status = f(ctx, i % n);
            if (status != OK) return status;
        }
        const double per_call = (seconds_now() - t0) / (double)calls;
        if (per_call < best) best = per_call;
    }
    return best;
}

/* For benchmarks: the seconds per call of aipc_lowbit_linear_v over the n argument vectors in turn
 * (rotating weights), timed here so that no interpreter runs between the calls, as in the read probe;
 * negative: a call's error status. */
API double aipc_time_lowbit_linear_v(const int64_t *const *vectors, int64_t n, int64_t calls, double min_seconds) {
    const linear_calls ctx = {vectors};
    return time_rounds(call_linear, &ctx, n, calls, min_seconds);
}

/* The same for aipc_stream_read of `bytes` from each of the n buffers in turn. */
API double aipc_time_stream_read(const void *const *bufs, int64_t n, int64_t bytes, int nthreads, int64_t calls,
                                 double min_seconds) {
    read_calls ctx = {bufs, bytes, nthreads, 0};
    return time_rounds(call_read, &ctx, n, calls, min_seconds);
}
