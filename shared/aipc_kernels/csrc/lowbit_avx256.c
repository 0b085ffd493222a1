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

#define TILE_FN block_avxvnni_tile
#define BLOCK_FN block_avxvnni
#define TARGET __attribute__((target("avx2,avxvnni,f16c,fma")))
#define DOT(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define DOT8(acc, w, x) DOT(acc, w, x)
#define DOT8_LEVELS 0
#include "lowbit_avx256_tile.inc"
#undef TILE_FN
#undef BLOCK_FN
#undef TARGET
#undef DOT
#undef DOT8
#undef DOT8_LEVELS

#define TILE_FN block_avx2_tile
#define BLOCK_FN block_avx2
#define TARGET __attribute__((target("avx2,f16c,fma")))
#define DOT(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones16))
#define DOT8(acc, w, x)                                                                                       \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(_mm256_xor_si256(w, sign8)), \
                                                                 _mm256_sign_epi8(x, _mm256_xor_si256(w, sign8))), \
                                            ones16))
#define DOT8_LEVELS 1
#include "lowbit_avx256_tile.inc"
#undef TILE_FN
#undef BLOCK_FN
#undef TARGET
#undef DOT
#undef DOT8
#undef DOT8_LEVELS
#endif /* AIPC_X86 */
