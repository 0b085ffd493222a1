/*
 * Entry point of the small-M dense linear (see aipc_native.h): y[M][N] = x[M][K] @ w[N][K]^T + bias for
 * float32 / bf16 / fp16 weights in the model's own [N][K] layout, every weight row streamed from memory
 * once for all M tokens (the decode step of beam search or a small batch: M = beams x batch). Threads
 * split the weight rows in contiguous ranges of tiles; the dispatch table's tile for the ISA chosen at run
 * time (dispatch.h; x86/dense_linear_avx512.c, x86/dense_linear_avx2.c) accumulates in float32, so each
 * output is the same for any M and any thread count.
 * bf16 x and weights on a CPU with AVX512-BF16 take vdpbf16ps (exact bf16 products, float32 sums; bf16
 * subnormal inputs read as zero), twice the products of an FMA: decode of several beams is
 * compute-bound in float32 from about 8 rows on.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "dense_linear.h"
#include "dispatch.h"

/* One row of x after the prologue, from element `row` (K values; 2K read for silu_mul): float32 to df, or
 * bf16 to db, or float16 to dh (exactly one non-NULL). inv of the RMSNorm from the dispatch table's sum of
 * squares; the values from its prologue, or from dense_prologue_value where it has none (the portable
 * build) or for float16. */
static void prologue_row(float *df, uint16_t *db, uint16_t *dh, const void *x, int dt, int64_t row, int64_t K, int pro,
                         const void *gamma, float eps, const aipc_kernel_set *ks) {
    float inv = 1.f;
    if (pro == AIPC_PRO_RMSNORM) {
        float ss = 0.f;
        if (ks->dense_sumsq)
            ss = ks->dense_sumsq(x, dt, row, K);
        else
            for (int64_t k = 0; k < K; k++) {
                const float v = dense_load_f32(x, dt, row + k);
                ss += v * v;
            }
        inv = 1.f / sqrtf(ss / (float)K + eps);
    }
    if (pro == AIPC_PRO_NONE && !dh && (db || dt == AIPC_DT_F32)) { /* x as it is: bf16 onto bf16, f32 onto f32 */
        memcpy(db ? (void *)db : (void *)df, (const char *)x + row * (db ? 2 : 4), (size_t)K * (db ? 2 : 4));
    } else if (ks->dense_prologue && pro != AIPC_PRO_NONE && !dh) {
        ks->dense_prologue(df, db, x, dt, row, K, pro, gamma, inv);
    } else {
        for (int64_t k = 0; k < K; k++) {
            const float v = dense_prologue_value(x, dt, row, k, K, pro, gamma, inv);
            if (dh)
                dh[k] = f32_to_f16(v);
            else if (db)
                db[k] = f32_to_bf16(v);
            else
                df[k] = v;
        }
    }
}

/* x after the prologue, once: [M][Kp] float32 (xf) or [M][Kb] bf16 (xb), zero padded; the tiles read it
 * from L1/L2 for every weight row. */
static void prepare_x(float *xf, uint16_t *xb, const void *x, int dt, int64_t M, int64_t K, int64_t ldx,
                      int64_t Kp, int64_t Kb, int pro, const void *gamma, float eps, const aipc_kernel_set *ks) {
    for (int64_t m = 0; m < M; m++) {
        float *df = xb ? NULL : xf + m * Kp;
        uint16_t *db = xb ? xb + m * Kb : NULL;
        prologue_row(df, db, NULL, x, dt, m * ldx, K, pro, gamma, eps, ks);
        if (db)
            memset(db + K, 0, (size_t)(Kb - K) * sizeof(uint16_t));
        else
            for (int64_t k = K; k < Kp; k++) df[k] = 0.f;
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


/* The arguments of aipc_dense_linear_fused (see aipc_native.h). */
typedef struct {
    const void *x, *gamma, *res;
    void *y;
    int64_t M, K, ldx, ldy;
    int dt, pro, nthreads, nseg;
    float eps;
    const void *w[AIPC_DENSE_MAX_SEGMENTS], *bias[AIPC_DENSE_MAX_SEGMENTS];
    int wdt[AIPC_DENSE_MAX_SEGMENTS];
    int64_t N[AIPC_DENSE_MAX_SEGMENTS];
} fused_call;

static int dense_linear_fused(const fused_call *c) {
    const int dt = c->dt;
    const int64_t M = c->M, K = c->K;
    if (dt < AIPC_DT_F32 || dt >= AIPC_DT_COUNT) return AIPC_ERR_DTYPE;
    if (c->nseg < 1 || c->nseg > AIPC_DENSE_MAX_SEGMENTS || c->pro < AIPC_PRO_NONE || c->pro >= AIPC_PRO_COUNT)
        return AIPC_ERR_SHAPE;
    int64_t total = 0;
    for (int s = 0; s < c->nseg; s++) {
        if (c->wdt[s] < AIPC_DT_F32 || c->wdt[s] >= AIPC_DT_COUNT) return AIPC_ERR_DTYPE;
        if (c->N[s] <= 0) return AIPC_ERR_SHAPE;
        if (!c->w[s]) return AIPC_ERR_NULL;
        total += c->N[s];
    }
    const int64_t in_cols = c->pro == AIPC_PRO_SILU_MUL ? 2 * K : K;
    if (M < 0 || K <= 0 || c->ldy != total || c->ldx < in_cols || K > (INT64_C(1) << 40) / (M > total ? M : total))
        return AIPC_ERR_SHAPE;
    int nthreads = c->nthreads;
    if (nthreads < 0 || nthreads > AIPC_MAX_THREADS) return AIPC_ERR_THREADS;
    if (M == 0) return AIPC_OK;
    if (!c->x || !c->y || (c->pro == AIPC_PRO_RMSNORM && !c->gamma)) return AIPC_ERR_NULL;
    if (nthreads == 0) nthreads = omp_get_max_threads();
    int use_bf16 = dt == AIPC_DT_BF16 && aipc_bf16_dot_products();
    for (int s = 0; s < c->nseg; s++) use_bf16 = use_bf16 && c->wdt[s] == AIPC_DT_BF16;
    const int64_t Kp = (K + DENSE_KPAD - 1) / DENSE_KPAD * DENSE_KPAD;
    const int64_t Kb = (K + DENSE_KPAD_BF16 - 1) / DENSE_KPAD_BF16 * DENSE_KPAD_BF16;
    float *xf = NULL;
    uint16_t *xb = NULL;
    if (use_bf16)
        xb = (uint16_t *)aligned_alloc(64, (size_t)(M * Kb) * sizeof(uint16_t));
    else
        xf = (float *)aligned_alloc(64, (size_t)(M * Kp) * sizeof(float));
    if (!xf && !xb) return AIPC_ERR_NOMEM;
    const aipc_kernel_set *ks = aipc_kernels();
    prepare_x(xf, xb, c->x, dt, M, K, c->ldx, Kp, Kb, c->pro, c->gamma, c->eps, ks);
    /* one dense_args per weight, its y and residual starting at the weight's first column */
    dense_args a[AIPC_DENSE_MAX_SEGMENTS];
    int64_t first_tile[AIPC_DENSE_MAX_SEGMENTS + 1];
    const int64_t es = dt == AIPC_DT_F32 ? 4 : 2;
    int64_t col = 0;
    first_tile[0] = 0;
    for (int s = 0; s < c->nseg; s++) {
        const dense_args as = {xf, xb, c->w[s], c->bias[s], (char *)c->y + col * es,
                               c->res ? (const char *)c->res + col * es : NULL,
                               M, K, Kp, Kb, c->N[s], c->ldy, dt, c->wdt[s]};
        a[s] = as;
        col += c->N[s];
        first_tile[s + 1] = first_tile[s] + (c->N[s] + DENSE_NB - 1) / DENSE_NB;
    }
    const dense_tile_fn tile = ks->dense_tile;
    const int64_t tiles = first_tile[c->nseg];
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
            int s = 0;
            for (int64_t i = t0; i < t1; i++) {
                while (i >= first_tile[s + 1]) s++;
                const int64_t n0 = (i - first_tile[s]) * DENSE_NB, N = a[s].N;
                tile(&a[s], n0, (int)(N - n0 < DENSE_NB ? N - n0 : DENSE_NB), wtile);
            }
        }
        free(wtile);
    }
    free(xf);
    free(xb);
    return status;
}

AIPC_API int aipc_dense_linear(const void *x, int dt, int64_t M, int64_t K, const void *w, int wdt, int64_t N,
                               const void *bias, void *y, int nthreads) {
    if (N <= 0 || K <= 0) return AIPC_ERR_SHAPE;
    fused_call c = {x, NULL, NULL, y, M, K, K, N, dt, AIPC_PRO_NONE, nthreads, 1, 0.f, {w}, {bias}, {wdt}, {N}};
    return dense_linear_fused(&c);
}

AIPC_API int aipc_dense_linear_v(const int64_t *v) {
    return aipc_dense_linear((const void *)v[0], (int)v[1], v[2], v[3], (const void *)v[4], (int)v[5], v[6],
                             (const void *)v[7], (void *)v[8], (int)v[9]);
}

AIPC_API int aipc_dense_linear_fused_v(const int64_t *v) {
    fused_call c;
    memset(&c, 0, sizeof c);
    c.x = (const void *)v[0];
    c.dt = (int)v[1];
    c.M = v[2];
    c.K = v[3];
    c.ldx = v[4];
    c.pro = (int)v[5];
    c.gamma = (const void *)v[6];
    const uint32_t bits = (uint32_t)v[7];
    memcpy(&c.eps, &bits, sizeof c.eps);
    c.y = (void *)v[8];
    c.ldy = v[9];
    c.res = (const void *)v[10];
    c.nthreads = (int)v[11];
    c.nseg = (int)v[12];
    if (c.nseg < 1 || c.nseg > AIPC_DENSE_MAX_SEGMENTS) return AIPC_ERR_SHAPE;
    for (int s = 0; s < c.nseg; s++) {
        c.w[s] = (const void *)v[13 + 4 * s];
        c.wdt[s] = (int)v[14 + 4 * s];
        c.N[s] = v[15 + 4 * s];
        c.bias[s] = (const void *)v[16 + 4 * s];
    }
    return dense_linear_fused(&c);
}

#define PROLOGUE_MIN_PARALLEL (1 << 15) /* elements below which one thread does the whole call (decode) */

AIPC_API int aipc_dense_prologue(const void *x, int dt, int64_t M, int64_t K, int64_t ldx, int pro, const void *gamma,
                                 float eps, void *out, int nthreads) {
    if (dt < AIPC_DT_F32 || dt >= AIPC_DT_COUNT) return AIPC_ERR_DTYPE;
    if (pro < AIPC_PRO_NONE || pro >= AIPC_PRO_COUNT || M < 0 || K <= 0 ||
        ldx < (pro == AIPC_PRO_SILU_MUL ? 2 * K : K))
        return AIPC_ERR_SHAPE;
    if (nthreads < 0 || nthreads > AIPC_MAX_THREADS) return AIPC_ERR_THREADS;
    if (M == 0) return AIPC_OK;
    if (!x || !out || (pro == AIPC_PRO_RMSNORM && !gamma)) return AIPC_ERR_NULL;
    const int nt = M * K < PROLOGUE_MIN_PARALLEL ? 1 : nthreads > 0 ? nthreads : omp_get_max_threads();
    const aipc_kernel_set *ks = aipc_kernels();
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t m = 0; m < M; m++) {
        float *df = dt == AIPC_DT_F32 ? (float *)out + m * K : NULL;
        uint16_t *db = dt == AIPC_DT_BF16 ? (uint16_t *)out + m * K : NULL;
        uint16_t *dh = dt == AIPC_DT_F16 ? (uint16_t *)out + m * K : NULL;
        prologue_row(df, db, dh, x, dt, m * ldx, K, pro, gamma, eps, ks);
    }
    return AIPC_OK;
}
