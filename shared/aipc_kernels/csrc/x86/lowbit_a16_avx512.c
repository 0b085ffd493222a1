/*
 * AVX-512 kernel of the activation-exact W4A16 linear (generic/lowbit_a16.c says the formula and layout):
 * rows in the 16 float lanes; bf16 activations on a CPU with AVX512-BF16: a lane holds the bf16 pair
 * (k = 8c + kk, 8c + 4 + kk) of its row and vdpbf16ps multiplies it by the broadcast pair of x (exact:
 * bf16 products fit float32); other dtypes (and CPUs without it): x in float32, one FMA per k.
 */
#include <string.h>

#include "lowbit_a16.h"
#ifdef AIPC_X86
#include "lowbit_avx512.h"
#include "prefetch.h"
/* ---------------------------------------------------------------------------------- AVX-512 */

#define T512BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,f16c,fma")))

/* E0M4, float32: the code at nibble offset OFF of each lane moved to bits 19..22, OR 1.0f. */
#define E0M4_F32(w, OFF)                                                                                              \
    _mm512_castsi512_ps(_mm512_ternarylogic_epi32(                                                                 \
        (OFF) <= 19 ? _mm512_slli_epi32(w, 19 - (OFF) < 0 ? 0 : 19 - (OFF)) : _mm512_srli_epi32(w, (OFF) - 19 < 0 ? 0 : (OFF) - 19), \
        m_e0, one, 0xEA)) /* (t & m_e0) | one */
/* int: the code at nibble offset OFF as a float32 (shift, mask, convert). */
#define INT_F32(w, OFF)                                                                                               \
    _mm512_cvtepi32_ps((OFF) == 28 ? _mm512_srli_epi32(w, 28) : _mm512_and_si512(_mm512_srli_epi32(w, OFF), m_nib))

/* The group epilogue and the store (A, B per row of the block; acc += A dot + B xs). */
static inline T512 __attribute__((always_inline)) void a16_epilogue512(const a16_args *a, int64_t nb, int64_t g,
                                                                        int64_t m0, const int MT, const __m512 *dot,
                                                                        __m512 *acc) {
    const int64_t ng = a->K / a->G, si = (nb * ng + g) * BLOCK_N;
    const __m512 s = load16_scales(a->scales, si, a->scale_dt);
    const __m512 z = a->zeros ? load16_scales(a->zeros, si, a->scale_dt) : _mm512_set1_ps(a->zero_const);
    const __m512 A = a->dequant == AIPC_DEQUANT_INT ? s : _mm512_mul_ps(_mm512_set1_ps(16.f), s);
    const __m512 B = _mm512_sub_ps(_mm512_setzero_ps(),
                                   _mm512_mul_ps(s, a->dequant == AIPC_DEQUANT_INT ? z : _mm512_add_ps(_mm512_set1_ps(16.f), z)));
    for (int i = 0; i < MT; i++) {
        acc[i] = _mm512_fmadd_ps(A, dot[i], acc[i]);
        acc[i] = _mm512_fmadd_ps(B, _mm512_set1_ps(a->xs[(m0 + i) * ng + g]), acc[i]);
    }
}

static inline T512 __attribute__((always_inline)) void a16_store512(const a16_args *a, int64_t nb, int64_t m0,
                                                                     const int MT, const __m512 *acc) {
    lowbit_args s = {0}; /* store512 of the W*A8 kernels, outs NULL */
    s.N = a->N;
    s.bias = a->bias;
    s.y = a->y;
    s.out_dt = a->out_dt;
    store512(&s, m0, MT, nb, acc);
}

/* float32 activations: per chunk 8 dequantized vectors, each times MT broadcast activations. */
static inline T512 __attribute__((always_inline)) void a16_tile_fma(const a16_args *a, int64_t nb, int64_t m0,
                                                                     const int MT, const int E0M4) {
    const int64_t ng = a->K / a->G, cpg = a->G / 8, K = a->K;
    const uint8_t *wb = a->w + nb * (K / 8) * CHUNK_BYTES;
    const __m512i m_e0 = _mm512_set1_epi32(0x00780000), one = _mm512_set1_epi32(0x3F800000), m_nib = _mm512_set1_epi32(0xF);
    __m512 acc[A16_M];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 d0[A16_M], d1[A16_M]; /* two chains per token */
        for (int i = 0; i < MT; i++) d0[i] = d1[i] = _mm512_setzero_ps();
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            _mm_prefetch((const char *)(wb + c * CHUNK_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(wb + c * CHUNK_BYTES);
            const __m512i w = _mm512_loadu_si512((const void *)(wb + c * CHUNK_BYTES));
            const float *xc = a->xf + m0 * K + c * 8;
#define A16_FMA(P, OFF, D)                                                                                            \
    do {                                                                                                              \
        const __m512 v = E0M4 ? E0M4_F32(w, OFF) : INT_F32(w, OFF);                                                   \
        for (int i = 0; i < MT; i++) D[i] = _mm512_fmadd_ps(_mm512_set1_ps(xc[i * K + (P)]), v, D[i]);                \
    } while (0)
            /* k = 8c + P: byte kk = P & 3, nibble q = P >> 2, bit offset 8 kk + 4 q */
            A16_FMA(0, 0, d0);
            A16_FMA(1, 8, d1);
            A16_FMA(2, 16, d0);
            A16_FMA(3, 24, d1);
            A16_FMA(4, 4, d0);
            A16_FMA(5, 12, d1);
            A16_FMA(6, 20, d0);
            A16_FMA(7, 28, d1);
#undef A16_FMA
        }
        __m512 dot[A16_M];
        for (int i = 0; i < MT; i++) dot[i] = _mm512_add_ps(d0[i], d1[i]);
        a16_epilogue512(a, nb, g, m0, MT, dot, acc);
    }
    a16_store512(a, nb, m0, MT, acc);
}

/* bf16 activations with AVX512-BF16: per chunk 4 lanes of bf16 pairs, each one vdpbf16ps per token. */
static inline T512BF __attribute__((always_inline)) void a16_tile_bf16(const a16_args *a, int64_t nb, int64_t m0,
                                                                        const int MT, const int E0M4) {
    const int64_t ng = a->K / a->G, cpg = a->G / 8, K2 = a->K / 2;
    const uint8_t *wb = a->w + nb * (a->K / 8) * CHUNK_BYTES;
    const __m512i m_lo = _mm512_set1_epi32(0x78), m_hi = _mm512_set1_epi32(0x00780000),
                  ones = _mm512_set1_epi32(0x3F803F80), m_nib = _mm512_set1_epi32(0xF);
    /* int: the two converted halves (lo: elements 0..15, hi: 16..31 of cvtne2ps) interleaved into pairs */
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 acc[A16_M];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512 d0[A16_M], d1[A16_M];
        for (int i = 0; i < MT; i++) d0[i] = d1[i] = _mm512_setzero_ps();
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            _mm_prefetch((const char *)(wb + c * CHUNK_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(wb + c * CHUNK_BYTES);
            const __m512i w = _mm512_loadu_si512((const void *)(wb + c * CHUNK_BYTES));
            const uint32_t *xc = a->xp + m0 * K2 + c * 4;
/* the pair (k = 8c + KK: low nibble of byte KK -> bits 3..6; k = 8c + 4 + KK: high nibble -> bits 19..22) */
#define A16_PAIR_E0M4(LO, HI)                                                                                         \
    _mm512_ternarylogic_epi32(HI, m_hi, _mm512_ternarylogic_epi32(LO, m_lo, ones, 0xEA), 0xEA)
#define A16_DP(KK, LO, HI, D)                                                                                         \
    do {                                                                                                              \
        __m512i v;                                                                                                    \
        if (E0M4) {                                                                                                   \
            v = A16_PAIR_E0M4(LO, HI);                                                                                \
        } else {                                                                                                      \
            const __m512 flo = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 8 * (KK)), m_nib));        \
            const __m512 fhi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, 8 * (KK) + 4), m_nib));    \
            v = _mm512_permutexvar_epi16(pair_idx, (__m512i)_mm512_cvtne2ps_pbh(fhi, flo));                          \
        }                                                                                                             \
        for (int i = 0; i < MT; i++)                                                                                  \
            D[i] = _mm512_dpbf16_ps(D[i], (__m512bh)v, (__m512bh)_mm512_set1_epi32((int)xc[i * K2 + (KK)]));         \
    } while (0)
            A16_DP(0, _mm512_slli_epi32(w, 3), _mm512_slli_epi32(w, 15), d0);
            A16_DP(1, _mm512_srli_epi32(w, 5), _mm512_slli_epi32(w, 7), d1);
            A16_DP(2, _mm512_srli_epi32(w, 13), _mm512_srli_epi32(w, 1), d0);
            A16_DP(3, _mm512_srli_epi32(w, 21), _mm512_srli_epi32(w, 9), d1);
#undef A16_DP
#undef A16_PAIR_E0M4
        }
        __m512 dot[A16_M];
        for (int i = 0; i < MT; i++) dot[i] = _mm512_add_ps(d0[i], d1[i]);
        a16_epilogue512(a, nb, g, m0, MT, dot, acc);
    }
    a16_store512(a, nb, m0, MT, acc);
}

A16_INSTANCES(a16_fma512, a16_tile_fma, T512)
A16_INSTANCES(a16_bf16_512, a16_tile_bf16, T512BF)

void a16_block_avx512(const a16_args *a, int64_t nb, int use_bf16) {
    const int e0m4 = a->dequant == AIPC_DEQUANT_E0M4;
    for (int64_t m0 = 0; m0 < a->M; m0 += A16_M) {
        const int mt = a->M - m0 < A16_M ? (int)(a->M - m0) : A16_M;
        if (use_bf16) a16_bf16_512(a, nb, m0, mt, e0m4);
        else a16_fma512(a, nb, m0, mt, e0m4);
    }
}
#endif /* AIPC_X86 */
