/*
 * Internals shared by the low-bit linear units (not part of the C API, see aipc_native.h):
 *
 *   y[m, n] = sum_g  sx[m,g] * ( s[n,g] * cmul * dot_g(c[n,:], xq[m,:]) - s[n,g] * z[n,g] * sum_g(xq[m,:]) ) + bias[n]
 *
 * (Georganas et al., "Pushing the Envelope of LLM Inference on AI-PC and Intel GPUs", III-B..D) where c
 * are the unsigned weight codes (0..2^bits - 1; 1, 2, 4, 6 or 8 bits), w = s * (cmul * c - z), xq = round(x /
 * sx) the int8 activations (absmax per token, or per K-group: generic/act_quant.c), and dot_g an int32 dot
 * product over group g. The zero correction uses the group sum of the quantized activations, so the
 * inner loop is a pure u8 x s8 -> s32 dot product: vpdpbusd (AVX-512 VNNI: x86/lowbit_avx512.c, AVX-VNNI:
 * x86/lowbit_avx256.c), vpmaddubsw + vpmaddwd (AVX2: x86/lowbit_avx256.c), tdpbssd (AMX: x86/lowbit_amx.c),
 * and a portable C loop on the same layout (generic/lowbit_scalar.c). generic/lowbit_linear.c checks the
 * arguments and runs the dispatch table's kernels for the ISA chosen at run time (dispatch.h).
 *
 * Weight layout ("cpu_vnni16", produced by aipc_kernels.lowbit.packing): rows in blocks of 16; per block the
 * K axis in chunks of 64 bytes. A chunk holds, at byte [n][kk] (n < 16, kk < 4), the codes of
 * k = kc*chunk + 4*q + kk for every bit-plane q (2 bits: q < 4 at bits 2q; 1 bit: q < 8 at bit q; 4 bits:
 * q < 2 at bits 4q; 8 bits: the one plane q = 0, so a chunk is already the [16 rows][4 k] operand; 6 bits:
 * 192 bytes per 16 k, see six_bit_code).
 * So one 64-byte load and a shift + mask per plane yield a [16 rows][4 k] u8 vector, exactly the
 * operand vpdpbusd wants against a broadcast of 4 consecutive int8 activations.
 * Scales (and affine zeros) are [N/16][K/G][16] in fp16 or bf16.
 *
 * Each unit's SIMD code carries its own target attribute (the build has no -m flags), so one build
 * serves every x86-64 CPU.
 */
#ifndef AIPC_LOWBIT_KERNELS_H
#define AIPC_LOWBIT_KERNELS_H

#include <math.h>
#include <stdint.h>

#include "aipc_native.h"
#include "half_float.h"

#if defined(__x86_64__) || defined(_M_X64)
#define AIPC_X86 1
#endif
#if defined(AIPC_X86) && defined(__linux__)
#define AIPC_AMX 1 /* AMX needs the kernel's permission (arch_prctl), asked for once */
#endif

#define BLOCK_N 16
#define CHUNK_BYTES 64
#define OTF_MAX 8  /* the most tokens of an on-the-fly tile (otf_m) */
#define OTF_MASKED_M 4 /* on-the-fly tiles of up to this many tokens keep one int32 chain per plane and token (planes
                        * masked in place); larger ones one chain per token (planes shifted down): at 8 tokens of 4-bit
                        * codes 0.92-0.98x the time of a chain per plane (scratch A/B), and 2-bit codes' 8 x 4 chains
                        * would not fit the registers */
#define UP_M 8     /* tokens per tile once a row block is up-converted */
#define AMX_M 16   /* tokens per AMX tile (tile rows); two tiles share each weight tile */
#define AMX_MIN_M 16 /* from this many tokens on, AMX (where available) does the int8 dot products */
/* the same for groups of 16 k (e.g. GGUF's Q6_K; a tile step of 16 k): at 16 tokens the tiles took 1.08-1.16x
 * the AVX-512 VNNI tiles' time (bench/results/cpu/ab_native_amx_g16_threshold_xeon.md), from 32 on 0.82-1.02x
 * (ab_native_amx_epilogue_xeon_q4_k_m*.md) */
#ifndef AMX_MIN_M_G16
#define AMX_MIN_M_G16 32
#endif

typedef struct {
    const uint8_t *w;   /* packed codes, [N/16][K/kc][64] */
    const void *scales; /* [N/16][K/G][16] */
    const void *zeros;  /* same layout, or NULL: then zero_const */
    const void *mins;   /* same layout, or NULL: the min form's per-group mins m (then zeros is NULL) */
    int scale_dt;       /* aipc_dtype, or AIPC_SCALE_I8: the two-level form (scales and mins int8) */
    const float *super_scales, *super_mins; /* two-level: [N/16][K/SB][16] float32 each (mins: min form only) */
    int64_t nsb;        /* two-level: super-blocks per row, K / SB */
    int gps_shift;      /* two-level: log2 of the groups per super-block */
    int bits;
    int64_t M, N, K, G;
    float cmul, zero_const;
    const int8_t *xq;   /* [M][K] */
    const int32_t *xt;  /* AVX-512 paths: [ceil(M/T)][K/4][T] quads, tokens of a tile interleaved */
    int64_t T;          /* tokens per tile of xt */
    /* The one epilogue every kernel computes (batch invariance: a row's bits do not depend on M, the
     * tile or the ISA), per token m, output n and group g, in group order, with fused multiply-adds:
     *   u = dot - z * zq[m,g];  acc = fma(s * ws[m,g], u, acc);  y = acc * outs[m] + bias
     * and in the min form (w = s * (cmul * c - z) + m) one more term after it: acc = fma(m * ws[m,g], zq[m,g], acc)
     * (zq = group sum of xq when cmul is 1, which the min form requires).
     * zq = (group sum of xq) / cmul is the zero term in code units; ws is the group's activation
     * scale (NULL with one scale per token: 1); outs[m] = cmul times the token's scale (per token) or
     * cmul (per group).
     * 4- and 8-bit codes with a fixed zero (int_epilogue): dot reaches 2^24 and beyond, where the
     * float32 of dot - z * zq would round, so u is taken in integers, u = dot - int(z * zq) (z * zq =
     * z * group sum, an integer exact in float32), then converted: every kernel (AMX's dots of signed
     * levels included) gets the same exact u (group_u_int). 4 bits with stored zeros keep the float
     * form, exact while |dot| < 2^24 (groups of at most MAX_G_4BIT_ZEROS). */
    const float *zq;    /* [M][K/G] */
    const int32_t *zero_start; /* [M][K/G] where int_epilogue: -int(z * zq) (z = zero_const), once per call, where
                                * an int32 dot may start to end as u (or be added to it); else NULL */
    const float *ws;    /* [M][K/G], or NULL */
    const float *outs;  /* [M] */
    const void *bias; /* [N] in out_dt, or NULL */
    void *y;          /* [M][N] */
    int out_dt;
    /* The progressive form with one activation scale per token (aipc_lowbit_linear's AIPC_SCALE_I8_PROG; scale_dt
     * is then AIPC_SCALE_I8, super_mins == super_scales, nsb 1): instead of the epilogue above, every kernel adds
     * each group's s1 * dot + m * gsum (gsum = zq, the group sum of xq) to an int32 accumulator per token and
     * output (exact), and converts once: y = float(acc) * s0 * outs[m] + bias (prog_scale). The float
     * accumulators of the SIMD kernels carry those int32 bits until the store. */
    int int_acc;
    const int32_t *prog_sums; /* [M][K/G] where int_acc: the group sums of xq, shifted left by 16 where prog_dots16 (the
                               * high half of a 16-bit pair), read as broadcasts from memory */
} lowbit_args;

/* 6-bit codes (GGUF's Q6_K) take three 64-byte units per chunk of 16 k: the low nibbles of k 0-7 and of
 * k 8-15 in the 4-bit layout, then the high two bits of k 0-15 in the 2-bit layout (six_bit_code) */
#define SIX_BIT_UNITS 3
static inline int64_t chunk_k(int bits) { return bits == 6 ? 16 : CHUNK_BYTES * 8 / bits / BLOCK_N; }
static inline int64_t chunk_bytes(int bits) { return bits == 6 ? SIX_BIT_UNITS * CHUNK_BYTES : CHUNK_BYTES; }

/* The AVX-512 VNNI kernels' token tiles (2-core Xeon, forced avx512_vnni, Llama-3.2-1B GGUF layers, interleaved
 * A/Bs, outputs bit-identical):
 * - otf_m: tokens per on-the-fly tile, each tile re-reading its row block from cache and up-converting it in registers:
 *   8 (1-bit codes: 2). Against tiles of 4 up to 16 / 32 / 48 tokens (2- / 4- / 8-bit) and 6-bit codes up-converted
 *   from 2 tokens on (23f17e0): 0.69-0.88x the time at 8-32 tokens, 0.82-0.97x at 64-128; 6-bit codes (Q6_K
 *   ffn_down and output projection) 0.53-0.83x at 2-24 tokens (bench/results/cpu/ab_native_otf8_xeon_*.md).
 * - up_min_m: tokens from which a kernel that up-converts (lowbit_block_kernel.up_converts) does so instead, each
 *   row block once, reused by tiles of UP_M tokens: where that stopped losing to tiles of 8 on the fly (scratch A/Bs
 *   of 16-512 tokens: on the fly 0.92-0.99x the time at 128-256 tokens, up-converted 0.97-0.99x at 512 for 2- and
 *   4-bit codes and 0.92-0.98x from 80 for 6-bit; for 8-bit codes, the operand as stored, it lost at every M up to 512). */
static inline int64_t otf_m(int bits) { return bits == 1 ? 2 : OTF_MAX; }
static inline int64_t up_min_m(int bits) {
    return bits == 1 ? 8 : bits == 6 ? 80 : bits == 8 ? INT64_MAX : 512;
}

/* The u8 code (0..63) of a 6-bit chunk's byte i (n * 4 + kk, i < 64) in quad q (k = 4q + kk). */
static inline int six_bit_code(const uint8_t *chunk, int i, int q) {
    return ((chunk[(q >> 1) * CHUNK_BYTES + i] >> (4 * (q & 1))) & 15) | (((chunk[2 * CHUNK_BYTES + i] >> (2 * q)) & 3) << 4);
}

/* 8-bit codes: |dot| <= G * 255 * 127 must stay below 2^31 */
#define MAX_G_8BIT 65536
/* 4-bit codes with stored zeros: |dot| <= G * 15 * 127 stays below 2^24 (the float epilogue is exact) */
#define MAX_G_4BIT_ZEROS 8192
/* 6-bit codes: G * 63 * 127 below 2^31 (MAX_G_8BIT holds that too), and below 2^24 with stored zeros */
#define MAX_G_6BIT_ZEROS 2048

/* Whether the epilogue takes u in integers (see lowbit_args): 4, 6 and 8 bits with a fixed zero (zeros: the
 * stored per-group zero points, as lowbit_args.zeros; NULL for a fixed zero or the min form). */
static inline int int_epilogue_for(int bits, const void *zeros) { return bits >= 4 && !zeros; }
static inline int int_epilogue(const lowbit_args *a) { return int_epilogue_for(a->bits, a->zeros); }

/* The zero term int(z * zq) of the integer epilogue (z * zq is an integer there, see lowbit_args). */
static inline int32_t int_zero_term(float z, float zq) { return (int32_t)(z * zq); }

/* u of the epilogue in integers, exact (see lowbit_args). */
static inline float group_u_int(int32_t dot, float z, float zq) { return (float)(dot - int_zero_term(z, zq)); }

/* Whether the progressive form's group dots and group sums fit int16 (|dot| <= G * max code * 127, |gsum| <= G * 127),
 * so one 16-bit multiply-add pair takes s1 * dot + m * gsum (2-bit codes: G <= 86). */
static inline int prog_dots16(int64_t G, int bits) { return G * ((1 << bits) - 1) * 127 <= 32767; }

/* The progressive form's int32 accumulator of row n of block nb as the float the store takes: float(acc) * s0. */
static inline float prog_scale(const lowbit_args *a, int64_t nb, int n, int32_t acc) {
    return (float)acc * a->super_scales[nb * BLOCK_N + n];
}

/* ------------------------------------------------------------------ scalar conversions */

static inline float load_f(const void *p, int64_t i, int dt) {
    switch (dt) {
    case AIPC_DT_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case AIPC_DT_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline void store_f(void *p, int64_t i, int dt, float v) {
    switch (dt) {
    case AIPC_DT_BF16: ((uint16_t *)p)[i] = f32_to_bf16(v); break;
    case AIPC_DT_F16: ((uint16_t *)p)[i] = f32_to_f16(v); break;
    default: ((float *)p)[i] = v;
    }
}

/* Index into super_scales / super_mins of lane 0 of row block nb's group g (two-level form). */
static inline int64_t super_at(const lowbit_args *a, int64_t nb, int64_t g) {
    return (nb * a->nsb + (g >> a->gps_shift)) * BLOCK_N;
}

/* The scale (p = scales, sup = super_scales) or min (mins, super_mins) of row n of block nb in group g, at
 * p[si]: stored, or in the two-level form the super-block's float32 times the int8 sub-block value. */
static inline float group_value(const lowbit_args *a, const void *p, const float *sup, int64_t nb, int64_t g,
                                int64_t si, int n) {
    if (a->scale_dt != AIPC_SCALE_I8) return load_f(p, si + n, a->scale_dt);
    return sup[super_at(a, nb, g) + n] * (float)((const int8_t *)p)[si + n];
}

/* The min form's term of group g (see lowbit_args), scalar. */
static inline float min_term(const lowbit_args *a, int64_t nb, int64_t g, int64_t si, int n, float w, float zq,
                             float acc) {
    return a->mins ? fmaf(group_value(a, a->mins, a->super_mins, nb, g, si, n) * w, zq, acc) : acc;
}

/* Writes 16 outputs of token m: acc * outs[m] + bias, in the output dtype (portable and 256-bit kernels).
 * A static copy per unit, not an extern function: GCC then knows which registers the call clobbers
 * (IPA register allocation), and the 256-bit tiles keep their accumulators in registers across it. */
static __attribute__((unused)) void store_block(const lowbit_args *a, int64_t m, int64_t n0, const float *acc16) {
    const int64_t nn = a->N - n0 < BLOCK_N ? a->N - n0 : BLOCK_N;
    for (int64_t j = 0; j < nn; j++) {
        float v = acc16[j] * a->outs[m];
        if (a->bias) v += load_f(a->bias, n0 + j, a->out_dt);
        store_f(a->y, m * a->N + n0 + j, a->out_dt, v);
    }
}

/* ------------------------------------------------------------------ the units' entry points */

/* generic/act_quant.c: x[M, K] to int8 with absmax scales per token (act_group == K) or per K-group; amax: NULL or
 * [M] given per-token absmax values (act_group == K). xq: [M][K]; sx: [M][K/G] scale of each weight
 * group; gsum: [M][K/G] group sums of xq. */
int quantize_activations(const void *x, int dt, int64_t M, int64_t K, int64_t G, int64_t act_group, const float *amax,
                         int8_t *xq, float *sx, int32_t *gsum, int nthreads);

/* Row block nb for every token; `up`: [K/4][64] bytes of scratch for a kernel that up-converts a row block
 * once from up_min_m tokens on (lowbit_block_kernel.up_converts), else unused. Entries of the dispatch
 * table (dispatch.h): generic/lowbit_scalar.c (portable C), x86/lowbit_avx256.c (AVX2, AVX-VNNI),
 * x86/lowbit_avx512.c (AVX-512 VNNI). */
typedef void (*lowbit_block_fn)(const lowbit_args *a, int64_t nb, uint8_t *up);
/* A row-block kernel and how the entry point feeds it. */
typedef struct {
    lowbit_block_fn run;
    int interleaved; /* reads xt: the quads of a tile's T tokens side by side (else xq) */
    int up_converts; /* up-converts each row block once from up_min_m tokens on: needs `up` (not for 8 bits) */
    lowbit_block_fn run_prog; /* the progressive form's (lowbit_args.int_acc) where apart from run, else NULL */
} lowbit_block_kernel;
void block_scalar(const lowbit_args *a, int64_t nb, uint8_t *up);
#ifdef AIPC_X86
void block_avxvnni(const lowbit_args *a, int64_t nb, uint8_t *up);
void block_avxvnni_prog(const lowbit_args *a, int64_t nb, uint8_t *up);
void block_avx2(const lowbit_args *a, int64_t nb, uint8_t *up);
void block_avx2_prog(const lowbit_args *a, int64_t nb, uint8_t *up);
void block_avx512(const lowbit_args *a, int64_t nb, uint8_t *up);
void block_avx512_prog(const lowbit_args *a, int64_t nb, uint8_t *up);
#endif
/* Every row block at once, for M >= AMX_MIN_M (AMX_MIN_M_G16) and G a multiple of 32 (16) (x86/lowbit_amx.c); xq padded with zero rows to
 * Mp = whole tiles. Returns AIPC_OK or AIPC_ERR_NOMEM. */
typedef int (*lowbit_tiles_fn)(const lowbit_args *a, const int8_t *xq, int64_t Mp, int nthreads);
#ifdef AIPC_AMX
int amx_linear(const lowbit_args *a, const int8_t *xq, int64_t Mp, int nthreads);
/* cpu_features.c: AMX-INT8 on the CPU, enabled by the OS and permitted for this process. */
int amx_usable(void);
#endif

/* One token's int8 quantization: x its row, given NULL or its absmax; q its K codes; sx, gsum its [K/G]
 * scales and group sums; row a float32 scratch of K values where the kernel needs one (else NULL).
 * Entries of the dispatch table: generic/act_quant.c and x86/act_quant_avx2.c (the portable body of
 * act_quant.h), x86/act_quant_avx512.c (one fused pass, no scratch). */
typedef void (*act_row_fn)(const void *x, int dt, int64_t K, int64_t G, int64_t act_group, const float *given,
                           float *row, int8_t *q, float *sx, int32_t *gsum);
typedef struct {
    act_row_fn run;
    int needs_row; /* takes the float32 scratch row */
} act_row_kernel;
void act_row_scalar(const void *x, int dt, int64_t K, int64_t G, int64_t act_group, const float *given, float *row,
                    int8_t *q, float *sx, int32_t *gsum);
#ifdef AIPC_X86
void act_row_avx2(const void *x, int dt, int64_t K, int64_t G, int64_t act_group, const float *given, float *row,
                  int8_t *q, float *sx, int32_t *gsum);
void act_row_avx512(const void *x, int dt, int64_t K, int64_t G, int64_t act_group, const float *given, float *row,
                    int8_t *q, float *sx, int32_t *gsum);
#endif

#endif /* AIPC_LOWBIT_KERNELS_H */
