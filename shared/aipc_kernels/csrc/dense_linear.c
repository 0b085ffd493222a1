/*
 * Entry point of the small-M dense linear (see aipc_native.h): y[M][N] = x[M][K] @ w[N][K]^T + bias for
 * float32 / bf16 / fp16 weights in the model's own [N][K] layout, every weight row streamed from memory
 * once for all M tokens (the decode step of beam search or a small batch: M = beams x batch). Threads
 * split the weight rows in contiguous ranges of tiles; the tile for the ISA chosen at run time
 * (aipc_get_isa) accumulates in float32, so each output is the same for any M and any thread count.
 * bf16 x and weights on a CPU with AVX512-BF16 take vdpbf16ps (exact bf16 products, float32 sums; bf16
 * subnormal inputs read as zero), twice the products of an FMA: decode of several beams is
 * compute-bound in float32 from about 8 rows on.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "dense_linear.h"

/* x converted to float32 once, [M][Kp], zero padded: the tiles read it from L1/L2 for every weight row. */
static void x_to_f32(float *xf, const void *x, int dt, int64_t M, int64_t K, int64_t Kp) {
    for (int64_t m = 0; m < M; m++) {
        float *dst = xf + m * Kp;
        if (dt == AIPC_DT_F32) {
            memcpy(dst, (const float *)x + m * K, (size_t)K * sizeof(float));
        } else {
            for (int64_t k = 0; k < K; k++) dst[k] = dense_load_f32(x, dt, m * K + k);
        }
        for (int64_t k = K; k < Kp; k++) dst[k] = 0.f;
    }
}

/* Portable tile: one float32 accumulator per output, k in order (as the SIMD tiles' lanes are not). */
void dense_tile_scalar(const dense_args *a, int64_t n0, int nb, float *wtile) {
    (void)wtile;
    for (int j = 0; j < nb; j++) {
        const int64_t n = n0 + j;
        for (int64_t m = 0; m < a->M; m++) {
            const float *xr = a->xf + m * a->Kp;
            float acc = 0.f;
            for (int64_t k = 0; k < a->K; k++) acc += xr[k] * dense_load_f32(a->w, a->wdt, n * a->K + k);
            dense_store(a, m, n, acc);
        }
    }
}

static dense_tile_fn tile_for(int isa) {
#ifdef DENSE_X86
    if (isa >= AIPC_ISA_AVX512_VNNI) return dense_tile_avx512;
    if (isa >= AIPC_ISA_AVX2) return dense_tile_avx2;
#endif
    (void)isa;
    return dense_tile_scalar;
}

AIPC_API int aipc_dense_linear(const void *x, int dt, int64_t M, int64_t K, const void *w, int wdt, int64_t N,
                               const void *bias, void *y, int nthreads) {
    if (dt < AIPC_DT_F32 || dt >= AIPC_DT_COUNT || wdt < AIPC_DT_F32 || wdt >= AIPC_DT_COUNT) return AIPC_ERR_DTYPE;
    if (M < 0 || N <= 0 || K <= 0 || K > (INT64_C(1) << 40) / (M > N ? M : N)) return AIPC_ERR_SHAPE;
    if (nthreads < 0 || nthreads > AIPC_MAX_THREADS) return AIPC_ERR_THREADS;
    if (M == 0) return AIPC_OK;
    if (!x || !w || !y) return AIPC_ERR_NULL;
    if (nthreads == 0) nthreads = omp_get_max_threads();
    const int isa = aipc_get_isa();
    const int use_bf16 = dt == AIPC_DT_BF16 && wdt == AIPC_DT_BF16 && aipc_bf16_dot_products();
    const int64_t Kp = (K + DENSE_KPAD - 1) / DENSE_KPAD * DENSE_KPAD;
    const int64_t Kb = (K + DENSE_KPAD_BF16 - 1) / DENSE_KPAD_BF16 * DENSE_KPAD_BF16;
    float *xf = NULL;
    uint16_t *xb = NULL;
    if (use_bf16) {
        xb = (uint16_t *)aligned_alloc(64, (size_t)(M * Kb) * sizeof(uint16_t));
        if (!xb) return AIPC_ERR_NOMEM;
        for (int64_t m = 0; m < M; m++) {
            memcpy(xb + m * Kb, (const uint16_t *)x + m * K, (size_t)K * sizeof(uint16_t));
            memset(xb + m * Kb + K, 0, (size_t)(Kb - K) * sizeof(uint16_t));
        }
    } else {
        xf = (float *)aligned_alloc(64, (size_t)(M * Kp) * sizeof(float));
        if (!xf) return AIPC_ERR_NOMEM;
        x_to_f32(xf, x, dt, M, K, Kp);
    }
    const dense_args a = {xf, xb, w, bias, y, M, K, Kp, Kb, N, dt, wdt};
    const dense_tile_fn tile = tile_for(isa);
    const int64_t tiles = (N + DENSE_NB - 1) / DENSE_NB;
    if (tiles < nthreads) nthreads = (int)tiles;
    int status = AIPC_OK;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        /* contiguous tiles per thread: each thread streams one range of the weights */
        const int64_t t0 = tiles * t / nt, t1 = tiles * (t + 1) / nt;
        float *wtile = (float *)aligned_alloc(64, (size_t)(DENSE_NB * Kp) * sizeof(float));
        if (!wtile) {
#pragma omp atomic write
            status = AIPC_ERR_NOMEM;
        } else {
            for (int64_t i = t0; i < t1; i++) {
                const int64_t n0 = i * DENSE_NB;
                tile(&a, n0, (int)(N - n0 < DENSE_NB ? N - n0 : DENSE_NB), wtile);
            }
        }
        free(wtile);
    }
    free(xf);
    free(xb);
    return status;
}

AIPC_API int aipc_dense_linear_v(const int64_t *v) {
    return aipc_dense_linear((const void *)v[0], (int)v[1], v[2], v[3], (const void *)v[4], (int)v[5], v[6],
                             (const void *)v[7], (void *)v[8], (int)v[9]);
}
