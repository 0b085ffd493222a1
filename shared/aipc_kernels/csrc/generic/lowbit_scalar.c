/*
 * Portable C kernel of the low-bit linear layer (any CPU; the reference every SIMD kernel matches bit for
 * bit).
 */
#include <math.h>

#include "lowbit_kernels.h"

void block_scalar(const lowbit_args *a, int64_t nb, uint8_t *up) {
    (void)up; /* up-converted scratch: the AVX-512 kernels only */
    const int64_t kc = chunk_k(a->bits), ng = a->K / a->G, nq = kc / 4;
    const uint8_t *wb = a->w + nb * (a->K / kc) * chunk_bytes(a->bits);
    const int mask = (1 << a->bits) - 1;
    for (int64_t m = 0; m < a->M; m++) {
        float acc[BLOCK_N] = {0};
        int32_t iacc[BLOCK_N] = {0}; /* int_acc */
        for (int64_t g = 0; g < ng; g++) {
            int32_t dot[BLOCK_N] = {0};
            for (int64_t c = g * a->G / kc; c < (g + 1) * a->G / kc; c++) {
                const uint8_t *wc = wb + c * chunk_bytes(a->bits);
                for (int64_t q = 0; q < nq; q++) {
                    const int8_t *xp = a->xq + m * a->K + c * kc + q * 4;
                    for (int n = 0; n < BLOCK_N; n++)
                        for (int kk = 0; kk < 4; kk++)
                            dot[n] += (a->bits == 6 ? six_bit_code(wc, n * 4 + kk, (int)q)
                                                    : (wc[n * 4 + kk] >> (q * a->bits)) & mask) * xp[kk];
                }
            }
            const int64_t si = (nb * ng + g) * BLOCK_N, mg = m * ng + g;
            if (a->int_acc) {
                const int32_t gsum = (int32_t)a->zq[mg];
                for (int n = 0; n < BLOCK_N; n++)
                    iacc[n] += ((const int8_t *)a->scales)[si + n] * dot[n] + ((const int8_t *)a->mins)[si + n] * gsum;
                continue;
            }
            const float w = a->ws ? a->ws[mg] : 1.f;
            for (int n = 0; n < BLOCK_N; n++) {
                const float s = group_value(a, a->scales, a->super_scales, nb, g, si, n);
                const float z = a->zeros ? load_f(a->zeros, si + n, a->scale_dt) : a->zero_const;
                const float u = int_epilogue(a) ? group_u_int(dot[n], z, a->zq[mg]) : fmaf(-z, a->zq[mg], (float)dot[n]);
                acc[n] = min_term(a, nb, g, si, n, w, a->zq[mg], fmaf(s * w, u, acc[n]));
            }
        }
        if (a->int_acc)
            for (int n = 0; n < BLOCK_N; n++) acc[n] = prog_scale(a, nb, n, iacc[n]);
        store_block(a, m, nb * BLOCK_N, acc);
    }
}
