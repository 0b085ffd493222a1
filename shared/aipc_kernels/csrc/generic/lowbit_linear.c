/*
 * Entry point of the low-bit linear layer (see aipc_native.h): argument checks, activation quantization,
 * scratch, and the dispatch table's kernels for the ISA chosen at run time (dispatch.h).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "lowbit_kernels.h"

/* Every check of aipc_lowbit_linear before it touches memory; may set *zero_const to 0 (per-group zeros).
 * zeros with a finite zero_const: the min form (zeros are per-group mins). */
static int check_args(const void *x, int dt, int64_t M, int64_t K, const uint8_t *w, int bits, int64_t N,
                      const void *scales, const void *zeros, int scale_dt, int64_t G, float cmul, float *zero_const,
                      const void *y, int64_t act_group, int nthreads, const float *act_amax, const float *supers,
                      int64_t SB) {
    if (bits != 1 && bits != 2 && bits != 4 && bits != 6 && bits != 8) return AIPC_ERR_BITS;
    /* sizes: every index (m * K + k, block offsets, scratch) stays far from int64 / size_t overflow */
    if (M < 0 || N <= 0 || K <= 0 || K % chunk_k(bits) || K > (INT64_C(1) << 40) / (M > N ? M : N)) return AIPC_ERR_SHAPE;
    if (G <= 0 || K % G || G % chunk_k(bits) || act_group <= 0 || K % act_group || act_group % G) return AIPC_ERR_GROUP;
    if ((bits >= 6 && G > MAX_G_8BIT) || (bits == 4 && zeros && G > MAX_G_4BIT_ZEROS) ||
        (bits == 6 && zeros && G > MAX_G_6BIT_ZEROS))
        return AIPC_ERR_GROUP;
    if (act_amax && act_group != K) return AIPC_ERR_AMAX;
    if (dt < AIPC_DT_F32 || dt > AIPC_DT_F16 || scale_dt < AIPC_DT_F32 || scale_dt > AIPC_SCALE_I8_PROG) return AIPC_ERR_DTYPE;
    if (scale_dt == AIPC_SCALE_I8_PROG) { /* the progressive form: the min form, one super-block a row */
        if (!supers || SB != K || !zeros || isnan(*zero_const) || *zero_const != 0.f || cmul != 1.f || K > AIPC_PROG_MAX_K)
            return AIPC_ERR_SUPERS;
    } else if (scale_dt == AIPC_SCALE_I8) { /* the two-level form: SB / G a power of two, no stored zero points */
        if (!supers || SB <= 0 || SB % G || K % SB || ((SB / G) & (SB / G - 1)) || (zeros && isnan(*zero_const)))
            return AIPC_ERR_SUPERS;
    } else if (supers) {
        return AIPC_ERR_SUPERS;
    }
    if (!(isfinite(cmul) && cmul > 0.f) || isinf(*zero_const)) return AIPC_ERR_CODEBOOK;
    /* 8 bits, and 4 bits with a fixed zero: the integer zero correction (group_u_int) needs cmul 1 and an
     * integer zero point within the codes; 8 bits have no stored zeros */
    if (bits >= 4 && (cmul != 1.f || (bits == 8 && isnan(*zero_const)) ||
                      (!isnan(*zero_const) && (!(*zero_const >= 0.f && *zero_const <= (float)((1 << bits) - 1)) ||
                                               *zero_const != floorf(*zero_const)))))
        return AIPC_ERR_CODEBOOK;
    if (isnan(*zero_const)) { /* per-group zero points: the kernels read zeros, never zero_const */
        if (!zeros) return AIPC_ERR_ZEROS;
        *zero_const = 0.f;
    } else if (zeros && cmul != 1.f) {
        return AIPC_ERR_CODEBOOK; /* the min form: its term m * zq needs zq = the group sum (cmul 1) */
    }
    if (nthreads < 0 || nthreads > AIPC_MAX_THREADS) return AIPC_ERR_THREADS;
    if (M == 0) return AIPC_OK;
    if (!x || !w || !scales || !y) return AIPC_ERR_NULL;
    return AIPC_OK;
}

/* The row-block kernel over every row block, threads splitting the blocks. */
static int run_blocks(const lowbit_args *a, const lowbit_block_kernel *kernel, int nthreads) {
    const int64_t M = a->M, K = a->K, nblocks = (a->N + BLOCK_N - 1) / BLOCK_N;
    const int need_up = kernel->up_converts && M >= up_min_m(a->bits);
    const lowbit_block_fn run = a->int_acc && kernel->run_prog ? kernel->run_prog : kernel->run;
    int status = AIPC_OK;
    if (nblocks < nthreads) nthreads = (int)nblocks;
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *up = need_up ? (uint8_t *)aligned_alloc(64, (size_t)(K / 4 * CHUNK_BYTES)) : NULL;
        if (need_up && !up) {
#pragma omp atomic write
            status = AIPC_ERR_NOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++)
            if (up || !need_up) run(a, nb, up);
        free(up);
    }
    return status;
}

AIPC_API int aipc_lowbit_linear(const void *x, int dt, int64_t M, int64_t K, const uint8_t *w, int bits, int64_t N,
                                const void *scales, const void *zeros, int scale_dt, int64_t G, float cmul,
                                float zero_const, const void *bias, void *y, int64_t act_group, int nthreads,
                                const float *act_amax, const float *supers, int64_t SB) {
    const int min_form = zeros && !isnan(zero_const); /* zeros are per-group mins (see aipc_native.h) */
    int status = check_args(x, dt, M, K, w, bits, N, scales, zeros, scale_dt, G, cmul, &zero_const, y, act_group,
                            nthreads, act_amax, supers, SB);
    if (status != AIPC_OK || M == 0) return status;
    if (nthreads == 0) nthreads = omp_get_max_threads();
    const int64_t ng = K / G;
    const aipc_kernel_set *ks = aipc_kernels();
    /* a tile step spans 64, 32 or 16 k; with 16 (G an odd multiple of 16) the tiles win from more tokens on */
    const int int_acc = scale_dt == AIPC_SCALE_I8_PROG && act_group == K; /* lowbit_args.int_acc */
    const int use_amx = ks->lowbit_tiles && G % 16 == 0 && M >= (G % 32 ? AMX_MIN_M_G16 : AMX_MIN_M);
    /* AMX tiles read 16 token rows: pad xq with zero rows (their outputs are never stored) */
    const int64_t Mp = use_amx ? (M + AMX_M - 1) / AMX_M * AMX_M : M;
    /* AVX-512 tiles read the quads of their T tokens side by side: one pointer, constant offsets */
    const int64_t T = M == 1 ? 1 : M >= up_min_m(bits) ? UP_M : otf_m(bits), K4 = K / 4;
    const int interleave = ks->lowbit_block->interleaved && T > 1 && !use_amx;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((Mp * K + 63) / 64 * 64));
    /* scratch, zeroed: [Mp][K/G] each (AMX reads whole tiles of rows) sx and zq (float), gsum (int32);
     * outs [Mp] */
    float *sx = (float *)calloc((size_t)((3 + int_acc) * Mp * ng + Mp), sizeof(float));
    int32_t *xt = NULL; /* the interleaved copy of xq, or NULL: the kernels read xq */
    status = AIPC_ERR_NOMEM;
    if (!xq || !sx) goto cleanup;
    float *zq = sx + Mp * ng, *outs = sx + 3 * Mp * ng;
    int32_t *gsum = (int32_t *)(sx + 2 * Mp * ng), *prog_sums = int_acc ? (int32_t *)(outs + Mp) : NULL;
    const int pairs = int_acc && prog_dots16(G, bits);
    if (Mp > M) memset(xq + M * K, 0, (size_t)((Mp - M) * K));
    if (quantize_activations(x, dt, M, K, G, act_group, act_amax, xq, sx, gsum, nthreads) != AIPC_OK) goto cleanup;
    const void *group_zeros = min_form ? NULL : zeros; /* lowbit_args.zeros: stored zero points, not mins */
    /* minus the integer zero terms of int_epilogue (lowbit_args.zero_start), in gsum's place (the kernels read zq,
     * not gsum) */
    const int int_zero_terms = int_epilogue_for(bits, group_zeros);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < ng; g++) {
            zq[m * ng + g] = (float)gsum[m * ng + g] / cmul;
            if (prog_sums) prog_sums[m * ng + g] = pairs ? (int32_t)((uint32_t)gsum[m * ng + g] << 16) : gsum[m * ng + g];
            if (int_zero_terms) gsum[m * ng + g] = -int_zero_term(zero_const, zq[m * ng + g]);
        }
        outs[m] = act_group == K ? sx[m * ng] * cmul : cmul;
    }
    if (interleave) {
        const int64_t tiles = (M + T - 1) / T;
        xt = (int32_t *)aligned_alloc(64, (size_t)(tiles * T * K4 * 4 + 63) / 64 * 64);
        if (!xt) goto cleanup;
        const int32_t *rows = (const int32_t *)xq;
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t kq = 0; kq < K4; kq++)
                for (int64_t i = 0; i < T; i++)
                    xt[(t * K4 + kq) * T + i] = t * T + i < M ? rows[(t * T + i) * K4 + kq] : 0;
    }
    /* two-level: the super-block scales of the mins follow those of the scales */
    const int64_t nsb = supers ? K / SB : 0, nblocks = (N + BLOCK_N - 1) / BLOCK_N;
    int gps_shift = 0;
    while (supers && (G << gps_shift) < SB) gps_shift++;
    /* the progressive form: its mins share the scales' super-block scales; with one activation scale per token
     * the integer accumulation (lowbit_args.int_acc) */
    const int prog = scale_dt == AIPC_SCALE_I8_PROG;
    const lowbit_args a = {w, scales, group_zeros, min_form ? zeros : NULL, prog ? AIPC_SCALE_I8 : scale_dt, supers,
                           supers && min_form ? (prog ? supers : supers + nblocks * nsb * BLOCK_N) : NULL, nsb, gps_shift,
                           bits, M, N, K, G, cmul, zero_const, xq, xt ? xt : (const int32_t *)xq, T, zq,
                           int_zero_terms ? gsum : NULL, act_group == K ? NULL : sx, outs, bias, y, dt,
                           int_acc, prog_sums};
    status = use_amx ? ks->lowbit_tiles(&a, xq, Mp, nthreads) : run_blocks(&a, ks->lowbit_block, nthreads);
cleanup:
    free(xt);
    free(xq);
    free(sx);
    return status;
}

AIPC_API int aipc_lowbit_linear_v(const int64_t *v) {
    float cmul, zero_const;
    const int32_t cbits = (int32_t)v[11], zbits = (int32_t)v[12];
    memcpy(&cmul, &cbits, 4);
    memcpy(&zero_const, &zbits, 4);
    return aipc_lowbit_linear((const void *)v[0], (int)v[1], v[2], v[3], (const uint8_t *)v[4], (int)v[5], v[6],
                              (const void *)v[7], (const void *)v[8], (int)v[9], v[10], cmul, zero_const,
                              (const void *)v[13], (void *)v[14], v[15], (int)v[16], (const float *)v[17],
                              (const float *)v[18], v[19]);
}
