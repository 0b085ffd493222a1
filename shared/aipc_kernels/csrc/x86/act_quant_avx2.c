/*
 * The portable activation quantization of one token (act_quant.h) compiled for AVX2: its loops vectorise to
 * 256-bit vectors; the same codes as every other instance.
 */
#include "act_quant.h"
#ifdef AIPC_X86

__attribute__((target("avx2"))) void act_row_avx2(const void *x, int dt, int64_t K, int64_t G, int64_t act_group,
                                                   const float *given, float *row, int8_t *q, float *sx,
                                                   int32_t *gsum) {
    act_row_portable(x, dt, K, G, act_group, given, row, q, sx, gsum);
}
#endif /* AIPC_X86 */
