/*
 * 256-bit kernels of the low-bit linear layer, decode included: AVX-VNNI (vpdpbusd) and AVX2 (vpmaddubsw
 * + vpmaddwd), the widest ISAs of client CPUs such as Core Ultra. One body (lowbit_avx256_tile.inc)
 * instantiated per ISA.
 */
#include "lowbit_kernels.h"
#ifdef AIPC_X86
#include <immintrin.h>

#include "prefetch.h"

/* 8 fp16/bf16 scales at p[i..i+7] as float32. */
#define LOAD8_SCALES(p, i, dt)                                                                                \
    ((dt) == AIPC_DT_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(p) + (i))))       \
                    : _mm256_castsi256_ps(_mm256_slli_epi32(                                                  \
                          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)(p) + (i)))), 16)))

#define TILE_FN block_avxvnni_tile
#define BLOCK_FN block_avxvnni
#define TARGET __attribute__((target("avx2,avxvnni,f16c,fma")))
#define DOT(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#include "lowbit_avx256_tile.inc"
#undef TILE_FN
#undef BLOCK_FN
#undef TARGET
#undef DOT

#define TILE_FN block_avx2_tile
#define BLOCK_FN block_avx2
#define TARGET __attribute__((target("avx2,f16c,fma")))
#define DOT(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones16))
#include "lowbit_avx256_tile.inc"
#undef TILE_FN
#undef BLOCK_FN
#undef TARGET
#undef DOT
#endif /* AIPC_X86 */
