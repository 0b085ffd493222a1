/*
 * 256-bit kernels of the low-bit linear layer, decode included: AVX-VNNI (vpdpbusd) and AVX2 (vpmaddubsw
 * + vpmaddwd), the widest ISAs of client CPUs such as Core Ultra. One body (lowbit_avx256_tile.inc)
 * instantiated per ISA.
 *
 * 8-bit codes: vpmaddubsw saturates a pair of u8 x s8 products at 32767 (255 * 127 * 2 would overflow),
 * so AVX2 multiplies the signed levels c - 128 = c ^ 0x80 instead, as |level| (u8) times x with the
 * level's sign (vpsignb; |x| <= 127): a pair stays within 128 * 127 * 2, and the dot is u itself
 * (DOT8_LEVELS). AVX-VNNI accumulates in 32 bits and takes the codes like the 2-bit kernels.
 */
#include "lowbit_kernels.h"
#ifdef AIPC_X86
#include <immintrin.h>

#include "prefetch.h"

/* 8 fp16/bf16/fp32 scales at p[i..i+7] as float32. */
#define LOAD8_SCALES(p, i, dt)                                                                                \
    ((dt) == AIPC_DT_F32   ? _mm256_loadu_ps((const float *)(p) + (i))                                          \
     : (dt) == AIPC_DT_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(p) + (i))))     \
                           : _mm256_castsi256_ps(_mm256_slli_epi32(                                            \
                                 _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)(p) + (i)))), 16)))

/* 8 scales (sup: super_scales) or mins (super_mins) of half h of row block nb's group g at p[si..si+7] as
 * float32: stored, or in the two-level form super-block float32 times int8 sub-block value (group_value). */
#define LOAD8_GROUP(a, p, sup, si, nb, g, h)                                                                   \
    ((a)->scale_dt == AIPC_SCALE_I8                                                                          \
         ? _mm256_mul_ps(_mm256_loadu_ps((sup) + super_at((a), (nb), (g)) + 8 * (h)),                         \
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)(p) + (si)))))) \
         : LOAD8_SCALES((p), (si), (a)->scale_dt))

/* Writes 16 outputs of token m from two 8-lane halves: acc * outs[m] + bias, in the output dtype, as
 * store_block does it lane by lane (bf16 rounded to nearest even, NaN kept; fp16 by F16C, as the AVX-512
 * kernels); a tail block of fewer than 16 rows goes through store_block. */
static inline __attribute__((target("avx2,f16c,fma"), always_inline)) void store_block256(const lowbit_args *a,
                                                                                       int64_t m, int64_t nb,
                                                                                       const __m256 *acc,
                                                                                       const int int_acc) {
    const int64_t n0 = nb * BLOCK_N;
    __m256 r[2] = {acc[0], acc[1]};
    if (int_acc) /* int32 bits: float(acc) * s0 (prog_scale) */
        for (int h = 0; h < 2; h++)
            r[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_castps_si256(acc[h])), _mm256_loadu_ps(a->super_scales + n0 + 8 * h));
    if (a->N - n0 < BLOCK_N) {
        float buf[BLOCK_N];
        _mm256_storeu_ps(buf, r[0]);
        _mm256_storeu_ps(buf + 8, r[1]);
        store_block(a, m, n0, buf);
        return;
    }
    const __m256 o = _mm256_set1_ps(a->outs[m]);
    for (int h = 0; h < 2; h++) {
        __m256 v = _mm256_mul_ps(r[h], o);
        if (a->bias) v = _mm256_add_ps(v, LOAD8_SCALES(a->bias, n0 + 8 * h, a->out_dt));
        const int64_t off = m * a->N + n0 + 8 * h;
        if (a->out_dt == AIPC_DT_F32) {
            _mm256_storeu_ps((float *)a->y + off, v);
        } else if (a->out_dt == AIPC_DT_F16) {
            _mm_storeu_si128((__m128i *)((uint16_t *)a->y + off), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {
            const __m256i u = _mm256_castps_si256(v);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
            const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
            r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* the 8 low halves in order */
            _mm_storeu_si128((__m128i *)((uint16_t *)a->y + off), _mm256_castsi256_si128(r));
        }
    }
}

#define TILE_M 8 /* tokens per tile: 8 accumulators + the planes of one half fit the 16 ymm registers */
#define TARGET __attribute__((target("avx2,avxvnni,f16c,fma")))
#define DOT(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define DOT8(acc, w, x) DOT(acc, w, x)
#define DOT8_LEVELS 0
#define SUM16 0
#define BLOCK_FN block_avxvnni
#define INT_ACC 0
#include "lowbit_avx256_tile.inc"
#define BLOCK_FN block_avxvnni_prog /* the progressive form's instance (lowbit_block_kernel.run_prog) */
#define INT_ACC 1
#include "lowbit_avx256_tile.inc"
#undef TARGET
#undef DOT
#undef DOT8
#undef DOT8_LEVELS
#undef SUM16

#define TARGET __attribute__((target("avx2,f16c,fma")))
#define DOT8(acc, w, x)                                                                                       \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(_mm256_xor_si256(w, sign8)), \
                                                                 _mm256_sign_epi8(x, _mm256_xor_si256(w, sign8))), \
                                            ones16))
#define DOT8_LEVELS 1
#define SUM16 1
#define BLOCK_FN block_avx2
#define INT_ACC 0
#include "lowbit_avx256_tile.inc"
#define BLOCK_FN block_avx2_prog /* the progressive form's instance */
#define INT_ACC 1
#include "lowbit_avx256_tile.inc"
#undef TARGET
#undef DOT8
#undef DOT8_LEVELS
#undef SUM16
#endif /* AIPC_X86 */
