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
 *   int:  v = (float)c, a shift, a mask and an int-to-float conversion (the AVX2 kernel: a mask in place and
 *         the conversion, x scaled instead; lowbit_a16.h); A = s, B = -s z.
 * Both are exact for every 4-bit code book (fixed zero_const or stored integer/float zeros).
 *
 * Layout: a 64-byte chunk of a row block holds 16 rows x 8 k: lane n (32 bits) byte kk has the code of
 * k = 8c + kk in its low nibble and of k = 8c + 4 + kk in its high nibble (packing.pack_cpu_codes).
 * The row-block kernel is the dispatch table's (dispatch.h): x86/lowbit_a16_avx512.c (with vdpbf16ps for
 * bf16 activations on AVX512-BF16), x86/lowbit_a16_avx2.c (AVX2 and AVX-VNNI CPUs), or the portable C
 * one here, on the same formula.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "lowbit_a16.h"

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

void a16_block_scalar(const a16_args *a, int64_t nb, int use_bf16) {
    (void)use_bf16; /* float32 activations only: the table never pairs bf16 products with this kernel */
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


/* ------------------------------------------------------------------------------------ entry */

static const float A16_NO_SCALE[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};

/* Whether `kernel` reads int codes in place (the AVX2 kernel: x scaled by A16_INT_SCALE, a mask and a conversion
 * per 8 codes, which makes int its fastest dequantization). */
static int a16_int_in_place(a16_block_fn kernel) {
#ifdef AIPC_X86
    return kernel == a16_block_avx2;
#else
    (void)kernel;
    return 0;
#endif
}

/* One row of x (elements at..at+K of x): xf (float32, element k times scale[k % 8]; NULL: not wanted) and xs,
 * each group's sum of the unscaled values in 8 partial sums (k % 8) added in a fixed order: no float add
 * waits on the one before it, and the loops vectorize. */
static void a16_prepare_row(const void *x, int dt, int64_t at, int64_t K, int64_t G, const float *scale, float *xf,
                            float *xs) {
    for (int64_t g = 0; g < K / G; g++) {
        float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
            float v[8];
            switch (dt) {
            case AIPC_DT_BF16:
                for (int j = 0; j < 8; j++) v[j] = bf16_to_f32(((const uint16_t *)x)[at + k + j]);
                break;
            case AIPC_DT_F16:
                for (int j = 0; j < 8; j++) v[j] = f16_to_f32(((const uint16_t *)x)[at + k + j]);
                break;
            default:
                for (int j = 0; j < 8; j++) v[j] = ((const float *)x)[at + k + j];
            }
            for (int j = 0; j < 8; j++) part[j] += v[j];
            if (xf)
                for (int j = 0; j < 8; j++) xf[k + j] = v[j] * scale[j];
        }
        xs[g] = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    }
}

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
    const a16_block_fn kernel = aipc_kernels()->a16_block;
    /* bf16 products (vdpbf16ps) only where the table's kernel is the AVX-512 one */
    const int use_bf16 =
        dt == AIPC_DT_BF16 && aipc_bf16_dot_products() && aipc_kernel_isa(AIPC_OP_A16) == AIPC_ISA_AVX512_VNNI;
    const int prescale = dequant == AIPC_DEQUANT_INT && a16_int_in_place(kernel);
    /* float32 activations of their own: converted from bf16 / fp16, or scaled for the in-place int codes */
    const int want_xf = !use_bf16 && (dt != AIPC_DT_F32 || prescale);
    const int64_t ng = K / G;
    float *xs = (float *)malloc((size_t)(M * ng) * sizeof(float));
    float *xf = NULL;
    uint32_t *xp = NULL;
    if (use_bf16) xp = (uint32_t *)malloc((size_t)(M * K / 2) * sizeof(uint32_t));
    else if (want_xf) xf = (float *)malloc((size_t)(M * K) * sizeof(float));
    if (!xs || (use_bf16 && !xp) || (want_xf && !xf)) {
        status = AIPC_ERR_NOMEM;
        goto cleanup;
    }
    /* the activations as the kernel reads them, and their group sums */
    for (int64_t m = 0; m < M; m++) {
        a16_prepare_row(x, dt, m * K, K, G, prescale ? A16_INT_SCALE : A16_NO_SCALE, xf ? xf + m * K : NULL,
                        xs + m * ng);
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
    for (int64_t nb = 0; nb < nblocks; nb++) kernel(&a, nb, use_bf16);
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

AIPC_API int aipc_lowbit_a16_fastest_dequant(void) {
    return a16_int_in_place(aipc_kernels()->a16_block) ? AIPC_DEQUANT_INT : AIPC_DEQUANT_E0M4;
}
