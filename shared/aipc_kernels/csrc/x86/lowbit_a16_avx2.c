/*
 * AVX2 (+ FMA, F16C) kernel of the activation-exact W4A16 linear (generic/lowbit_a16.c says the formula
 * and layout), also the AVX-VNNI CPUs' (VNNI adds nothing to float products): the 16 rows in two halves
 * of 8 float lanes, x in float32, one FMA per k and half. e0m4 dequantizes with a shift, an AND and an OR
 * (AVX2 has no ternary-logic op); int with an AND and a conversion: the code stays where the lane holds
 * it, c << OFF, and x comes scaled by 2^-OFF (A16_INT_SCALE), so each product is x c exactly.
 */
#include <immintrin.h>

#include "lowbit_a16.h"
#ifdef AIPC_X86
#include "prefetch.h"

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
/* c << OFF as float (x scaled by 2^-OFF makes the product x c); the top nibble shifted down (a mask would
 * leave it signed) */
#define INT_F32_256(w, OFF)                                                                                           \
    _mm256_cvtepi32_ps((OFF) == 28 ? _mm256_srli_epi32(w, 28) : _mm256_and_si256(w, _mm256_set1_epi32(0xF << (OFF))))

/* float32 activations: per chunk the two 32-byte halves (rows 0-7, 8-15), 8 dequantized vectors each, each
 * times MT broadcast activations. CH chains per half and token: 8 chains in all while few tokens leave the
 * FMA latency exposed (4 cycles, two FMA units), 1 per half and token from MT = 3. */
static inline T256 __attribute__((always_inline)) void a16_tile_fma256(const a16_args *a, int64_t nb, int64_t m0,
                                                                        const int MT, const int E0M4) {
    const int64_t ng = a->K / a->G, cpg = a->G / 8, K = a->K;
    const int CH = MT == 1 ? 4 : MT == 2 ? 2 : 1;
    const uint8_t *wb = a->w + nb * (K / 8) * CHUNK_BYTES;
    const __m256i m_e0 = _mm256_set1_epi32(0x00780000), one = _mm256_set1_epi32(0x3F800000);
    __m256 acc[A16_M][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256 d[A16_M][2]; /* [chain * MT + token][half]: CH * MT <= A16_M, small enough to stay in registers */
        for (int j = 0; j < CH * MT; j++) d[j][0] = d[j][1] = _mm256_setzero_ps();
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            _mm_prefetch((const char *)(wb + c * CHUNK_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(wb + c * CHUNK_BYTES);
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + c * CHUNK_BYTES));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + c * CHUNK_BYTES + 32));
            const float *xc = a->xf + m0 * K + c * 8;
#define A16_FMA256(P, OFF)                                                                                            \
    do {                                                                                                              \
        const int ch = (P) & (CH - 1);                                                                         \
        const __m256 v0 = E0M4 ? E0M4_F32_256(w0, OFF) : INT_F32_256(w0, OFF);                                       \
        const __m256 v1 = E0M4 ? E0M4_F32_256(w1, OFF) : INT_F32_256(w1, OFF);                                       \
        for (int i = 0; i < MT; i++) {                                                                                \
            const __m256 xb = _mm256_broadcast_ss(xc + i * K + (P));                                                  \
            d[ch * MT + i][0] = _mm256_fmadd_ps(xb, v0, d[ch * MT + i][0]);                                           \
            d[ch * MT + i][1] = _mm256_fmadd_ps(xb, v1, d[ch * MT + i][1]);                                           \
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
                const __m256 dot = CH == 4   ? _mm256_add_ps(_mm256_add_ps(d[i][h], d[MT + i][h]),
                                                             _mm256_add_ps(d[2 * MT + i][h], d[3 * MT + i][h]))
                                   : CH == 2 ? _mm256_add_ps(d[i][h], d[MT + i][h])
                                             : d[i][h];
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

void a16_block_avx2(const a16_args *a, int64_t nb, int use_bf16) {
    (void)use_bf16; /* float32 activations only: the table never pairs bf16 products with this kernel */
    const int e0m4 = a->dequant == AIPC_DEQUANT_E0M4;
    for (int64_t m0 = 0; m0 < a->M; m0 += A16_M) {
        const int mt = a->M - m0 < A16_M ? (int)(a->M - m0) : A16_M;
        a16_fma256(a, nb, m0, mt, e0m4);
    }
}
#endif /* AIPC_X86 */
