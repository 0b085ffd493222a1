/*
 * C API of the native kernel library (_aipc_native): the entry points and every code they exchange with
 * their callers (status, dtype, ISA). This header is the one definition; aipc_kernels.core.native reads the
 * names and values back through the query functions below at load and refuses a library whose tables
 * differ from its own (so a stale build fails loudly instead of misreading a code).
 */
#ifndef AIPC_NATIVE_H
#define AIPC_NATIVE_H

#include <stdint.h>

#define AIPC_API __attribute__((visibility("default")))

/* Raised on any change of an entry point's arguments or of a code below. */
#define AIPC_ABI_VERSION 10

/* Element types of activations, outputs, scales and K/V (names as torch's dtypes). */
typedef enum {
    AIPC_DT_F32 = 0,
    AIPC_DT_BF16 = 1,
    AIPC_DT_F16 = 2,
    AIPC_DT_COUNT
} aipc_dtype;

/* Instruction sets. Not a total order: a CPU with one has every one before it except avx_vnni (client
 * CPUs have it without AVX-512, server CPUs AVX-512 VNNI without it), so no kernel compares them: the
 * dispatch table (dispatch.h) names each one's kernels and its fallback. */
typedef enum {
    AIPC_ISA_SCALAR = 0,
    AIPC_ISA_AVX2 = 1,
    AIPC_ISA_AVX_VNNI = 2,
    AIPC_ISA_AVX512_VNNI = 3,
    AIPC_ISA_AMX_INT8 = 4,
    AIPC_ISA_COUNT
} aipc_isa;

/* Return codes of every entry point: 0 or one of the negative errors (aipc_status_message words them). */
typedef enum {
    AIPC_OK = 0,
    AIPC_ERR_BITS = -1,
    AIPC_ERR_SHAPE = -2,
    AIPC_ERR_GROUP = -3,
    AIPC_ERR_DTYPE = -4,
    AIPC_ERR_ISA = -5,
    AIPC_ERR_NOMEM = -6,
    AIPC_ERR_CODEBOOK = -7, /* cmul not finite and positive, or zero_const infinite */
    AIPC_ERR_ZEROS = -8,    /* zero_const NaN (per-group zero points) without zeros */
    AIPC_ERR_NULL = -9,     /* a pointer the call reads or writes is NULL */
    AIPC_ERR_THREADS = -10, /* nthreads outside [0, AIPC_MAX_THREADS] */
    AIPC_ERR_PATH = -11,    /* segment_sdpa: a path entry outside [0, N) */
    AIPC_ERR_AMAX = -12,    /* lowbit_linear: act_amax given with per-group activation scales */
    AIPC_ERR_DEQUANT = -13, /* lowbit_linear_a16: dequant not one of aipc_dequant */
    AIPC_ERR_SUPERS = -14,  /* lowbit_linear: the two-level form's super-block scales missing or misshapen */
    AIPC_ERR_LAST = AIPC_ERR_SUPERS
} aipc_status;

#define AIPC_MAX_THREADS 4096

/* scale_dt of aipc_lowbit_linear only (no element type of activations): the two-level form, int8 sub-block
 * scales (and mins) times float32 super-block scales (see aipc_lowbit_linear). */
#define AIPC_SCALE_I8 3
/* scale_dt of aipc_lowbit_linear only: the progressive form (see aipc_lowbit_linear), int8 sub-block scales and mins
 * sharing one set of float32 super-block scales, one super-block a row. */
#define AIPC_SCALE_I8_PROG 4

/* ---------------------------------------------------------------- codes (cpu_features.c, abi.c) */

AIPC_API int aipc_abi_version(void);
/* The message of a status code ("unknown status" for one outside the enum). */
AIPC_API const char *aipc_status_message(int status);
/* The name of a dtype / ISA code (torch's dtype name; "avx512_vnni", ...), NULL outside the enum. */
AIPC_API const char *aipc_dtype_name(int dt);
AIPC_API const char *aipc_isa_name(int isa);

/* ---------------------------------------------------------------- ISA choice (cpu_features.c) */

/* Best ISA this CPU (and OS) supports: the one used unless overridden. */
AIPC_API int aipc_best_isa(void);
/* ISA the kernels use now (process-wide). */
AIPC_API int aipc_get_isa(void);
/* Forces an ISA (tests, benchmarks, AIPC_ISA); AIPC_ERR_ISA for one the CPU lacks. */
AIPC_API int aipc_set_isa(int isa);
/* 1 when the kernels take bf16 x bf16 products through vdpbf16ps (AVX512-BF16) under the current ISA:
 * the W4A16 kernel with bf16 activations, the dense kernel with bf16 activations and weights. */
AIPC_API int aipc_bf16_dot_products(void);

/* ---------------------------------------------------------------- low-bit linear (generic/lowbit_linear.c) */

/*
 * y[M][N] = x[M][K] @ dequant(w)^T + bias. x and y (and bias) share `dt`; scales and zeros use
 * `scale_dt` (AIPC_DT_BF16, AIPC_DT_F16, or AIPC_DT_F32: GGUF's K-quants, whose d * sub-block scale no
 * 16-bit float holds). bits: 1, 2, 4, 6 or 8 (6: GGUF's Q5 / Q6_K codes, 192 bytes per 16 rows x 16 k).
 * G: a multiple of the code's chunk (16 k for 2 and 6 bits, 8 for 4, 4 for 8; GGUF's 16-element
 * sub-blocks included) dividing K. Levels are cmul * code - zero point: zero_const for a code
 * book with a fixed zero point (zeros NULL), NaN for one with per-group zero points (then zeros is
 * required). zeros given with a finite zero_const is the min form: zeros holds a min m per group and
 * w = s * (cmul * code - zero_const) + m (GGUF's Q4_1 / Q5_1 blocks, exactly). act_group: K for per-token activation scales, or the weight group size (or a
 * multiple of it dividing K) for per-group ones. nthreads: 0 for OpenMP's default. bias may be NULL.
 * act_amax: NULL, or float32 [M] per-token activation absmax values used instead of each token's own
 * (act_group == K only): scale act_amax / 127, codes round(x * 127 / act_amax) clamped to [-127, 127];
 * a tensor-parallel rank passes the absmax of the whole row, of which x holds a slice.
 */
AIPC_API int aipc_lowbit_linear(const void *x, int dt, int64_t M, int64_t K, const uint8_t *w, int bits, int64_t N,
                                const void *scales, const void *zeros, int scale_dt, int64_t G, float cmul,
                                float zero_const, const void *bias, void *y, int64_t act_group, int nthreads,
                                const float *act_amax, const float *supers, int64_t SB);
/*
 * The two-level form (scale_dt AIPC_SCALE_I8; GGUF's K-quants as the file stores them: a float super-block
 * scale d times small integer sub-block scales): scales (and, in the min form, the mins in zeros) are int8
 * in the layout above, and supers holds float32 [S][N/16][K/SB][16] super-block scales, S = 1, or 2 in the
 * min form (the mins' super-block scales second). A group's scale is supers[0] * scale and its min
 * supers[1] * min, each one float32 product (exact for the K-quants' fp16 d times a 6- or 8-bit integer),
 * then the epilogue as with float32 scales, so the outputs are those of the same weight with those
 * products stored as float32 scales, bit for bit. SB: a multiple of G dividing K with SB / G a power of
 * two. Stored zero points are not taken in this form. supers NULL (SB ignored) for every other scale_dt.
 * The progressive form (scale_dt AIPC_SCALE_I8_PROG; QServe's, aipc_kernels.lowbit.progressive): the two-level min
 * form (zero_const 0, cmul 1) whose scales and mins share one set of super-block scales, supers float32
 * [1][N/16][1][16], SB = K: w = s0 * (s1 * c + m) with the caller's promise that every level s1 * c + m is an
 * int8 (the AMX kernel checks it and falls back where one is not). With one activation scale per token
 * (act_group == K) every kernel accumulates the integer dot of the int8 activations with the levels over the
 * whole K in int32 (exact, K <= AIPC_PROG_MAX_K) and rescales once per output, y = float(dot) * s0 * sx (+ bias);
 * with per-group activation scales it runs as the two-level form with its super scales read twice.
 */
#define AIPC_PROG_MAX_K 131072 /* K * 128 * 127 below 2^31 */

/* aipc_lowbit_linear with its 20 arguments in one int64 vector, in the same order (pointers as
 * addresses, 0 for NULL; cmul and zero_const as float32 bit patterns). For ctypes: converting 19
 * arguments costs ~2 us per call, one pointer ~0.2 us, and decode makes a call per linear layer. */
AIPC_API int aipc_lowbit_linear_v(const int64_t *v);

/* ---------------------------------------------------------------- W4A16 linear (generic/lowbit_a16.c) */

/* How the activation-exact kernel turns a 4-bit code into a float (Transformer-Lite's comparison). */
typedef enum {
    AIPC_DEQUANT_E0M4 = 0, /* as_float(0x3F800000 | c << 19) = 1 + c/16: two bit operations */
    AIPC_DEQUANT_INT = 1,  /* (float)c: mask and int-to-float conversion */
} aipc_dequant;

/*
 * y[M][N] = x[M][K] @ dequant(w)^T + bias with the activations unquantized (float32 accumulation; bf16
 * activations on a CPU with AVX512-BF16 through vdpbf16ps, exact products). w: 4-bit codes (bits must be
 * 4) in the cpu_vnni16 layout; scales, zeros, zero_const, G as aipc_lowbit_linear (zeros may be any
 * float), except the min form (zeros with a finite zero_const), which it refuses (AIPC_ERR_CODEBOOK). dequant: an aipc_dequant. nthreads: 0 for OpenMP's default.
 */
AIPC_API int aipc_lowbit_linear_a16(const void *x, int dt, int64_t M, int64_t K, const uint8_t *w, int bits, int64_t N,
                                    const void *scales, const void *zeros, int scale_dt, int64_t G, float zero_const,
                                    const void *bias, void *y, int dequant, int nthreads);
/* The same with its 16 arguments in one int64 vector (zero_const as a float32 bit pattern). */
AIPC_API int aipc_lowbit_linear_a16_v(const int64_t *v);
/* The aipc_dequant the W4A16 kernel of the ISA in use runs fastest: int on the AVX2 kernel (a mask and a
 * conversion per 8 codes, e0m4 three bit operations there), e0m4 elsewhere (one ternary-logic op on AVX-512). */
AIPC_API int aipc_lowbit_a16_fastest_dequant(void);

/* ---------------------------------------------------------------- small-M dense linear (generic/dense_linear.c) */

/*
 * y[M][N] = x[M][K] @ w[N][K]^T + bias for float weights in the model's own row-major [N][K] layout:
 * every weight row is streamed once for all M tokens (decode of beams x batch; meant for M <= 32, correct
 * for any M). x, bias and y share `dt`; w is in `wdt` (float32, bf16 or fp16, not necessarily dt).
 * float32 accumulation; each output is the same for any M and thread count. bias may be NULL.
 * nthreads: 0 for OpenMP's default.
 */
AIPC_API int aipc_dense_linear(const void *x, int dt, int64_t M, int64_t K, const void *w, int wdt, int64_t N,
                               const void *bias, void *y, int nthreads);
/* The same with its 10 arguments in one int64 vector, in the same order. */
AIPC_API int aipc_dense_linear_v(const int64_t *v);

/* What aipc_dense_linear_fused applies to each row of x before the product (a decoder layer's
 * element-wise pass, rounded to dt at the points where transformers' modules round). */
typedef enum {
    AIPC_PRO_NONE = 0,     /* x[m][k] */
    AIPC_PRO_RMSNORM = 1,  /* gamma[k] * dt(x[m][k] / sqrt(mean_k(x[m]^2) + eps)), gamma in dt */
    AIPC_PRO_SILU_MUL = 2, /* dt(silu(x[m][k])) * x[m][K + k]: the gate and up halves of one row */
    AIPC_PRO_COUNT
} aipc_prologue;

#define AIPC_DENSE_MAX_SEGMENTS 4

/*
 * A decoder layer's projection in one call: y[M][ldy] = prologue(x) @ [w_0; w_1; ...]^T + bias (+ residual).
 * Up to AIPC_DENSE_MAX_SEGMENTS weights (e.g. q, k and v: each its own [N_s][K] tensor, read once) write
 * the consecutive column ranges of y, so the merged projection needs no merged copy. x rows are ldx
 * elements apart (K, or 2K for AIPC_PRO_SILU_MUL); y and residual are dense [M][ldy] in dt with ldy the
 * sum of the N_s; residual (may alias y, may be NULL) is added after rounding the product to dt, as a
 * module's `residual + linear(x)` does. eps is a float32 bit pattern.
 * v: x, dt, M, K, ldx, prologue, gamma, eps, y, ldy, residual, nthreads, nseg, then per segment
 * w, wdt, N, bias (bias in dt or 0).
 */
AIPC_API int aipc_dense_linear_fused_v(const int64_t *v);

/* The prologue alone (aipc_prologue, the same values aipc_dense_linear_fused multiplies): out[M][K] dense in dt
 * from x's M rows, ldx elements apart (K, or 2K for AIPC_PRO_SILU_MUL); eps and gamma as there. For a projection
 * whose product is not aipc_dense_linear_fused's (the low-bit ops): one pass where torch needs about six. */
AIPC_API int aipc_dense_prologue(const void *x, int dt, int64_t M, int64_t K, int64_t ldx, int pro, const void *gamma,
                                 float eps, void *out, int nthreads);

/* ---------------------------------------------------------------- segment attention (generic/segment_sdpa.c) */

/*
 * out[N][Lq][Hq][D] (float32) = segment attention (see generic/segment_sdpa.c). dt: the aipc_dtype of query,
 * prompt and response K/V. Runs the code of aipc_segment_isa().
 */
AIPC_API int aipc_segment_sdpa(const void *q, int64_t q_sn, int64_t q_sh, int64_t q_sl, const void *pk,
                               const void *pv, const void *rk, const void *rv, const int32_t *path,
                               const float *mask, int64_t m_sn, int64_t m_sh, int64_t m_sl, float *out, int dt,
                               int64_t N, int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t D, int64_t Np,
                               int64_t Nr, float scale, int causal, int nthreads);

/* The ISA whose code aipc_segment_sdpa runs under the current aipc_get_isa(): AIPC_ISA_SCALAR,
 * AIPC_ISA_AVX2 (also for avx_vnni) or AIPC_ISA_AVX512_VNNI (also for amx_int8; it needs AVX-512F/BW/VL). */
AIPC_API int aipc_segment_isa(void);

/* ---------------------------------------------------------------- rotary embedding (generic/rope.c) */

/* out = x * cos + rotate_half(x) * sin over the first R of each head's D dimensions (the rest copied),
 * each product and the sum rounded to dt as torch's element-wise ops round them (bit-identical to
 * transformers' apply_rotary_pos_emb). x [B][L][H][D], element strides (sb, sl, sh), last dimension
 * dense; cos, sin [Bc][L][R] dense in dt, cstride = 0 (Bc = 1) or L * R (Bc = B); out dense [B][L][H][D]. */
AIPC_API int aipc_rope(const void *x, int dt, int64_t B, int64_t L, int64_t H, int64_t D, int64_t sb, int64_t sl,
                       int64_t sh, const void *cos, const void *sin, int64_t cstride, int64_t R, void *out,
                       int nthreads);

#endif /* AIPC_NATIVE_H */
