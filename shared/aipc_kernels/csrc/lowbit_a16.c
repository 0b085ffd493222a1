/*
 * The activation-exact W4A16 linear (aipc_lowbit_linear_a16, see aipc_native.h): 4-bit weight codes in the
 * cpu_vnni16 layout times float activations that are never quantized,
 *
 *   y[m, n] = sum_g  A[n,g] * dot_g(v[n,:], x[m,:]) + B[n,g] * xs[m,g] + bias[n]
 *
 * where v is the float each code dequantizes to, dot_g a float32 dot product over group g and xs[m,g]
 * the group sum of x. Two dequantizations of the same codes, on the same skeleton (Transformer-Lite,
 * Li et al., table "FP4 vs INT4 dequantization"):
 *   e0m4: v = as_float(0x3F800000 | c << 19) = 1 + c/16 (bf16: 0x3F80 | c << 3), a shift and one
 *         ternary-logic op; A = 16 s, B = -s (16 + z)   (w = s (c - z) = 16 s v - s (16 + z))
 *   int:  v = (float)c, a shift, a mask and an int-to-float conversion; A = s, B = -s z.
 * Both are exact for every 4-bit code book (fixed zero_const or stored integer/float zeros).
 *
 * Layout: a 64-byte chunk of a row block holds 16 rows x 8 k: lane n (32 bits) byte kk has the code of
 * k = 8c + kk in its low nibble and of k = 8c + 4 + kk in its high nibble (packing.pack_cpu_codes).
 * AVX-512: rows in the 16 float lanes. bf16 activations on a CPU with AVX512-BF16: a lane holds the bf16
 * pair (k = 8c + kk, 8c + 4 + kk) of its row and vdpbf16ps multiplies it by the broadcast pair of x
 * (exact: bf16 products fit float32); other dtypes (and CPUs without it): x in float32, one FMA per k.
 * AVX2 (+ FMA, F16C; also the AVX-VNNI CPUs, which have no wider float unit): the 16 rows in two halves
 * of 8 float lanes, x in float32, one FMA per k and half; e0m4 dequantizes with a shift, an AND and an OR.
 * No x86 ISA: portable C on the same formula.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "lowbit_kernels.h"
#ifdef AIPC_X86
#include "lowbit_avx512.h"
#include "prefetch.h"
#endif

#define A16_M 4 /* tokens per tile: each dequantized vector feeds that many FMAs / dot products */

typedef struct {
    const uint8_t *w;
    const void *scales, *zeros;
    int scale_dt;
    int64_t M, N, K, G;
    float zero_const;
    const float *xf;     /* [M][K] float32 activations (FMA paths) */
    const uint32_t *xp;  /* [M][K/2] bf16 pairs (k = 8c + kk, 8c + 4 + kk) at [m][4c + kk] (bf16 path) */
    const float *xs;     /* [M][K/G] group sums of x */
    const void *bias;
    void *y;
    int out_dt;
    int dequant;         /* AIPC_DEQUANT_E0M4 or AIPC_DEQUANT_INT */
} a16_args;

/* --------------------------------------------------------------------------------- portable C */

static float a16_code_value(uint32_t c, int dequant) {
    if (dequant == AIPC_DEQUANT_INT) return (float)c;
    const uint32_t u = 0x3F800000u | (c << 19); /* 1 + c/16 */
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void a16_group_coefs(const a16_args *a, int64_t si, float *A, float *B) {
    const float s = load_f(a->scales, si, a->scale_dt), z = a->zeros ? load_f(a->zeros, si, a->scale_dt) : a->zero_const;
    if (a->dequant == AIPC_DEQUANT_INT) {
        *A = s;
        *B = -s * z;
    } else {
        *A = 16.f * s;
        *B = -s * (16.f + z);
    }
}

static void a16_block_scalar(const a16_args *a, int64_t nb) {
    const int64_t ng = a->K / a->G, nchunks = a->K / 8, n0 = nb * BLOCK_N;
    const int64_t nn = a->N - n0 < BLOCK_N ? a->N - n0 : BLOCK_N;
    const uint8_t *wb = a->w + nb * nchunks * CHUNK_BYTES;
    for (int64_t m = 0; m < a->M; m++) {
        const float *x = a->xf + m * a->K;
        for (int64_t j = 0; j < nn; j++) {
            float acc = 0.f;
            for (int64_t g = 0; g < ng; g++) {
                float dot = 0.f, A, B;
                for (int64_t c = g * a->G / 8; c < (g + 1) * a->G / 8; c++)
                    for (int p = 0; p < 8; p++) { /* p = 4 q + kk */
                        const uint8_t byte = wb[c * CHUNK_BYTES + j * 4 + (p & 3)];
                        dot = fmaf(x[c * 8 + p], a16_code_value((byte >> (4 * (p >> 2))) & 0xF, a->dequant), dot);
                    }
                a16_group_coefs(a, (nb * ng + g) * BLOCK_N + j, &A, &B);
                acc = fmaf(A, dot, acc);
                acc = fmaf(B, a->xs[m * ng + g], acc);
            }
            if (a->bias) acc += load_f(a->bias, n0 + j, a->out_dt);
            store_f(a->y, m * a->N + n0 + j, a->out_dt, acc);
        }
    }
}

#ifdef AIPC_X86
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

/* Constant-MT instances (the tiles keep MT accumulators in registers). */
#define A16_INSTANCES(NAME, TILE, ATTR)                                                                               \
    static ATTR __attribute__((noinline)) void NAME(const a16_args *a, int64_t nb, int64_t m0, int mt, int e0m4) {    \
        switch (mt * 2 + (e0m4 != 0)) {                                                                               \
        case 2: TILE(a, nb, m0, 1, 0); break;                                                                         \
        case 3: TILE(a, nb, m0, 1, 1); break;                                                                         \
        case 4: TILE(a, nb, m0, 2, 0); break;                                                                         \
        case 5: TILE(a, nb, m0, 2, 1); break;                                                                         \
        case 6: TILE(a, nb, m0, 3, 0); break;                                                                         \
        case 7: TILE(a, nb, m0, 3, 1); break;                                                                         \
        case 8: TILE(a, nb, m0, 4, 0); break;                                                                         \
        default: TILE(a, nb, m0, 4, 1); break;                                                                        \
        }                                                                                                             \
    }
A16_INSTANCES(a16_fma512, a16_tile_fma, T512)
A16_INSTANCES(a16_bf16_512, a16_tile_bf16, T512BF)

/* ------------------------------------------------------------------------------------- AVX2 */

#define T256 __attribute__((target("avx2,f16c,fma")))

/* 8 scales (fp16 or bf16) from p[i..i+8) as float32. */
static inline T256 __m256 load8_scales(const void *p, int64_t i, int dt) {
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return dt == AIPC_DT_F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The code at nibble offset OFF of each 32-bit lane: as 1 + c/16 (e0m4) or as (float)c (int). */
#define E0M4_F32_256(w, OFF)                                                                                          \
    _mm256_castsi256_ps(_mm256_or_si256(                                                                           \
        _mm256_and_si256((OFF) <= 19 ? _mm256_slli_epi32(w, 19 - (OFF) < 0 ? 0 : 19 - (OFF))                      \
                                     : _mm256_srli_epi32(w, (OFF) - 19 < 0 ? 0 : (OFF) - 19), m_e0),              \
        one))
#define INT_F32_256(w, OFF)                                                                                           \
    _mm256_cvtepi32_ps((OFF) == 28 ? _mm256_srli_epi32(w, 28) : _mm256_and_si256(_mm256_srli_epi32(w, OFF), m_nib))

/* float32 activations: per chunk the two 32-byte halves (rows 0-7, 8-15), 8 dequantized vectors each, each
 * times MT broadcast activations. CH chains per half and token (2 while few tokens leave the FMA latency
 * exposed, 1 once MT tokens give enough independent chains in 16 registers). */
static inline T256 __attribute__((always_inline)) void a16_tile_fma256(const a16_args *a, int64_t nb, int64_t m0,
                                                                        const int MT, const int E0M4) {
    const int64_t ng = a->K / a->G, cpg = a->G / 8, K = a->K;
    const int CH = MT <= 2 ? 2 : 1;
    const uint8_t *wb = a->w + nb * (K / 8) * CHUNK_BYTES;
    const __m256i m_e0 = _mm256_set1_epi32(0x00780000), one = _mm256_set1_epi32(0x3F800000), m_nib = _mm256_set1_epi32(0xF);
    __m256 acc[A16_M][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256 d[2][A16_M][2]; /* [chain][token][half] */
        for (int ch = 0; ch < CH; ch++)
            for (int i = 0; i < MT; i++) d[ch][i][0] = d[ch][i][1] = _mm256_setzero_ps();
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            _mm_prefetch((const char *)(wb + c * CHUNK_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(wb + c * CHUNK_BYTES);
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + c * CHUNK_BYTES));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + c * CHUNK_BYTES + 32));
            const float *xc = a->xf + m0 * K + c * 8;
#define A16_FMA256(P, OFF)                                                                                            \
    do {                                                                                                              \
        const int ch = CH == 2 ? (P) & 1 : 0;                                                                         \
        const __m256 v0 = E0M4 ? E0M4_F32_256(w0, OFF) : INT_F32_256(w0, OFF);                                       \
        const __m256 v1 = E0M4 ? E0M4_F32_256(w1, OFF) : INT_F32_256(w1, OFF);                                       \
        for (int i = 0; i < MT; i++) {                                                                                \
            const __m256 xb = _mm256_broadcast_ss(xc + i * K + (P));                                                  \
            d[ch][i][0] = _mm256_fmadd_ps(xb, v0, d[ch][i][0]);                                                       \
            d[ch][i][1] = _mm256_fmadd_ps(xb, v1, d[ch][i][1]);                                                       \
        }                                                                                                             \
    } while (0)
            /* k = 8c + P: byte kk = P & 3, nibble q = P >> 2, bit offset 8 kk + 4 q */
            A16_FMA256(0, 0);
            A16_FMA256(1, 8);
            A16_FMA256(2, 16);
            A16_FMA256(3, 24);
            A16_FMA256(4, 4);
            A16_FMA256(5, 12);
            A16_FMA256(6, 20);
            A16_FMA256(7, 28);
#undef A16_FMA256
        }
        const int64_t si = (nb * ng + g) * BLOCK_N;
        for (int h = 0; h < 2; h++) {
            const __m256 s = load8_scales(a->scales, si + 8 * h, a->scale_dt);
            const __m256 z = a->zeros ? load8_scales(a->zeros, si + 8 * h, a->scale_dt) : _mm256_set1_ps(a->zero_const);
            const __m256 A = a->dequant == AIPC_DEQUANT_INT ? s : _mm256_mul_ps(_mm256_set1_ps(16.f), s);
            const __m256 B = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(s, a->dequant == AIPC_DEQUANT_INT
                                                                                     ? z : _mm256_add_ps(_mm256_set1_ps(16.f), z)));
            for (int i = 0; i < MT; i++) {
                const __m256 dot = CH == 2 ? _mm256_add_ps(d[0][i][h], d[1][i][h]) : d[0][i][h];
                acc[i][h] = _mm256_fmadd_ps(A, dot, acc[i][h]);
                acc[i][h] = _mm256_fmadd_ps(B, _mm256_set1_ps(a->xs[(m0 + i) * ng + g]), acc[i][h]);
            }
        }
    }
    const int64_t n0 = nb * BLOCK_N, nn = a->N - n0 < BLOCK_N ? a->N - n0 : BLOCK_N;
    for (int i = 0; i < MT; i++) {
        float out[BLOCK_N];
        _mm256_storeu_ps(out, acc[i][0]);
        _mm256_storeu_ps(out + 8, acc[i][1]);
        for (int64_t j = 0; j < nn; j++) {
            const float v = a->bias ? out[j] + load_f(a->bias, n0 + j, a->out_dt) : out[j];
            store_f(a->y, (m0 + i) * a->N + n0 + j, a->out_dt, v);
        }
    }
}

A16_INSTANCES(a16_fma256, a16_tile_fma256, T256)

#endif /* AIPC_X86 */

/* ------------------------------------------------------------------------------------ entry */

static int a16_check(const void *x, int dt, int64_t M, int64_t K, const uint8_t *w, int bits, int64_t N,
                     const void *scales, const void *zeros, int scale_dt, int64_t G, float zero_const, const void *y,
                     int dequant, int nthreads) {
    if (bits != 4) return AIPC_ERR_BITS;
    if (M < 0 || N <= 0 || K <= 0 || K % 8 || K > (INT64_C(1) << 40) / (M > N ? M : N)) return AIPC_ERR_SHAPE;
    if (G <= 0 || K % G || G % 8) return AIPC_ERR_GROUP;
    if (dt < AIPC_DT_F32 || dt > AIPC_DT_F16 || (scale_dt != AIPC_DT_BF16 && scale_dt != AIPC_DT_F16)) return AIPC_ERR_DTYPE;
    if (isinf(zero_const)) return AIPC_ERR_CODEBOOK;
    if (isnan(zero_const) && !zeros) return AIPC_ERR_ZEROS;
    if (zeros && !isnan(zero_const)) return AIPC_ERR_CODEBOOK; /* the min form: W*A8 kernels only */
    if (dequant != AIPC_DEQUANT_E0M4 && dequant != AIPC_DEQUANT_INT) return AIPC_ERR_DEQUANT;
    if (nthreads < 0 || nthreads > AIPC_MAX_THREADS) return AIPC_ERR_THREADS;
    if (M == 0) return AIPC_OK;
    if (!x || !w || !scales || !y) return AIPC_ERR_NULL;
    return AIPC_OK;
}

AIPC_API int aipc_lowbit_linear_a16(const void *x, int dt, int64_t M, int64_t K, const uint8_t *w, int bits, int64_t N,
                                    const void *scales, const void *zeros, int scale_dt, int64_t G, float zero_const,
                                    const void *bias, void *y, int dequant, int nthreads) {
    int status = a16_check(x, dt, M, K, w, bits, N, scales, zeros, scale_dt, G, zero_const, y, dequant, nthreads);
    if (status != AIPC_OK || M == 0) return status;
    if (nthreads == 0) nthreads = omp_get_max_threads();
    const int isa = aipc_get_isa();
    int use_bf16 = 0;
#ifdef AIPC_X86
    use_bf16 = dt == AIPC_DT_BF16 && aipc_bf16_dot_products();
#endif
    const int64_t ng = K / G;
    float *xs = (float *)malloc((size_t)(M * ng) * sizeof(float));
    float *xf = NULL;
    uint32_t *xp = NULL;
    if (use_bf16) xp = (uint32_t *)malloc((size_t)(M * K / 2) * sizeof(uint32_t));
    else if (dt != AIPC_DT_F32) xf = (float *)malloc((size_t)(M * K) * sizeof(float));
    if (!xs || (use_bf16 && !xp) || (!use_bf16 && dt != AIPC_DT_F32 && !xf)) {
        status = AIPC_ERR_NOMEM;
        goto cleanup;
    }
    /* the activations as the kernel reads them, and their group sums (float32, in k order) */
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < ng; g++) {
            float sum = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) {
                const float v = load_f(x, m * K + k, dt);
                sum += v;
                if (xf) xf[m * K + k] = v;
            }
            xs[m * ng + g] = sum;
        }
        if (xp) {
            const uint16_t *xb = (const uint16_t *)x + m * K;
            for (int64_t c = 0; c < K / 8; c++)
                for (int kk = 0; kk < 4; kk++)
                    xp[m * (K / 2) + c * 4 + kk] = (uint32_t)xb[c * 8 + kk] | (uint32_t)xb[c * 8 + 4 + kk] << 16;
        }
    }
    const a16_args a = {w, scales, zeros, scale_dt, M, N, K, G, isnan(zero_const) ? 0.f : zero_const,
                        xf ? xf : (const float *)x, xp, xs, bias, y, dt, dequant};
    const int64_t nblocks = (N + BLOCK_N - 1) / BLOCK_N;
    if (nblocks < nthreads) nthreads = (int)nblocks;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t nb = 0; nb < nblocks; nb++) {
#ifdef AIPC_X86
        if (isa >= AIPC_ISA_AVX512_VNNI) {
            for (int64_t m0 = 0; m0 < M; m0 += A16_M) {
                const int mt = M - m0 < A16_M ? (int)(M - m0) : A16_M;
                if (use_bf16) a16_bf16_512(&a, nb, m0, mt, dequant == AIPC_DEQUANT_E0M4);
                else a16_fma512(&a, nb, m0, mt, dequant == AIPC_DEQUANT_E0M4);
            }
            continue;
        }
        if (isa == AIPC_ISA_AVX2 || isa == AIPC_ISA_AVX_VNNI) { /* VNNI adds nothing to float dot products */
            for (int64_t m0 = 0; m0 < M; m0 += A16_M) {
                const int mt = M - m0 < A16_M ? (int)(M - m0) : A16_M;
                a16_fma256(&a, nb, m0, mt, dequant == AIPC_DEQUANT_E0M4);
            }
            continue;
        }
#endif
        a16_block_scalar(&a, nb);
    }
cleanup:
    free(xs);
    free(xf);
    free(xp);
    return status;
}

AIPC_API int aipc_lowbit_linear_a16_v(const int64_t *v) {
    float zero_const;
    const int32_t zbits = (int32_t)v[11];
    memcpy(&zero_const, &zbits, 4);
    return aipc_lowbit_linear_a16((const void *)v[0], (int)v[1], v[2], v[3], (const uint8_t *)v[4], (int)v[5], v[6],
                                  (const void *)v[7], (const void *)v[8], (int)v[9], v[10], zero_const,
                                  (const void *)v[12], (void *)v[13], (int)v[14], (int)v[15]);
}
