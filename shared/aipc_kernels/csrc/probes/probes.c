/*
 * Measurement probes of the benchmarks (library _aipc_probes, loaded only by bench/native_probes.py; the
 * shipped kernels never call it): a read-bandwidth probe that streams memory as the low-bit kernels
 * stream their weights, a float32 multiply-add peak probe (the compute bound of the float kernels), and
 * loops that time a kernel entry point, or the probe, in C, so that no interpreter runs between the calls.
 */
#include <omp.h>
#include <stdint.h>
#include <time.h>

#include "../aipc_native.h"
#include "../prefetch.h"

#if defined(__x86_64__) || defined(_M_X64)
#define PROBE_X86 1
#define MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MULTIVERSION
#endif

/* One thread's share of aipc_stream_read: 64-byte lines, four independent accumulators, and the same
 * software prefetch as the weight stream (without it this probe read ~10% less than torch's fp32 GEMV). */
MULTIVERSION static uint64_t read_span(const uint64_t *p, int64_t n) {
    uint64_t a[4][8] = {{0}};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
#ifdef PROBE_X86
        for (int j = 0; j < 4; j++) { /* the weight stream's two prefetch distances */
            _mm_prefetch((const char *)(p + i + 8 * j) + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(p + i + 8 * j);
        }
#endif
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 8; l++) a[j][l] ^= p[i + 8 * j + l];
    }
    uint64_t t = 0;
    for (; i < n; i++) t ^= p[i];
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 8; l++) t ^= a[j][l];
    return t;
}

/* Reads `bytes` of `buf` with `nthreads` threads, each a contiguous share (for measuring read
 * bandwidth); returns a checksum so the reads cannot be elided. */
AIPC_API uint64_t aipc_stream_read(const void *buf, int64_t bytes, int nthreads) {
    const uint64_t *p = (const uint64_t *)buf;
    const int64_t n = bytes / 8;
    uint64_t total = 0;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
#pragma omp parallel num_threads(nthreads) reduction(^ : total)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = n * t / nt / 8 * 8, hi = t == nt - 1 ? n : n * (t + 1) / nt / 8 * 8;
        total ^= read_span(p + lo, hi - lo);
    }
    return total;
}

/* ------------------------------------------------------------------ float32 multiply-add peak */

/* FMA_CHAINS independent multiply-add chains, enough to cover the FMA latency (4-5 cycles) on two FMA
 * pipes; each returns its lane 0 so that nothing is elided. */
#define FMA_CHAINS 12
#define FMA_SPAN(NAME, TARGET_ISA, VEC, SET1, FMADD, FIRST)                                                  \
    __attribute__((target(TARGET_ISA))) static float NAME(int64_t iters, float seed) {                       \
        const VEC x = SET1(1.0f - 1e-7f), y = SET1(1e-7f);                                                    \
        VEC a0 = SET1(seed), a1 = SET1(seed + 1), a2 = SET1(seed + 2), a3 = SET1(seed + 3);                    \
        VEC a4 = SET1(seed + 4), a5 = SET1(seed + 5), a6 = SET1(seed + 6), a7 = SET1(seed + 7);                \
        VEC a8 = SET1(seed + 8), a9 = SET1(seed + 9), a10 = SET1(seed + 10), a11 = SET1(seed + 11);            \
        for (int64_t i = 0; i < iters; i++) {                                                                 \
            a0 = FMADD(a0, x, y), a1 = FMADD(a1, x, y), a2 = FMADD(a2, x, y), a3 = FMADD(a3, x, y);           \
            a4 = FMADD(a4, x, y), a5 = FMADD(a5, x, y), a6 = FMADD(a6, x, y), a7 = FMADD(a7, x, y);           \
            a8 = FMADD(a8, x, y), a9 = FMADD(a9, x, y), a10 = FMADD(a10, x, y), a11 = FMADD(a11, x, y);       \
        }                                                                                                     \
        return FIRST(a0) + FIRST(a1) + FIRST(a2) + FIRST(a3) + FIRST(a4) + FIRST(a5) + FIRST(a6) +          \
               FIRST(a7) + FIRST(a8) + FIRST(a9) + FIRST(a10) + FIRST(a11);                                   \
    }
#ifdef PROBE_X86
FMA_SPAN(fma_span256, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_cvtss_f32)
FMA_SPAN(fma_span512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_cvtss_f32)
#endif

/* Multiply-adds per second of `nthreads` threads (<= 0: OpenMP's default) running `span`, best of three rounds
 * of `iters` iterations of `macs` multiply-adds each (the probes below share it). */
static double peak_rate(float (*span)(int64_t, float), int nthreads, int64_t iters, double macs) {
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    double best = 1e30;
    volatile float sink = 0.f;
    for (int round = 0; round < 3; round++) {
        const double t0 = omp_get_wtime();
        float total = 0.f;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
        total += span(iters, (float)omp_get_thread_num());
        const double dt = omp_get_wtime() - t0;
        sink += total;
        if (dt < best) best = dt;
    }
    (void)sink;
    return (double)nthreads * (double)iters * macs / best;
}

/* Float32 multiply-adds per second of `nthreads` threads, each running FMA_CHAINS independent chains of
 * `bits`-wide vector FMAs (256: AVX2 + FMA, 512: AVX-512F) for `iters` iterations, best of three rounds;
 * negative (AIPC_ERR_ISA) where this CPU has no such FMA or the build is not for x86. */
AIPC_API double aipc_fma_peak(int bits, int nthreads, int64_t iters) {
#ifdef PROBE_X86
    __builtin_cpu_init();
    if (bits == 256 ? !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
                    : bits != 512 || !__builtin_cpu_supports("avx512f"))
        return AIPC_ERR_ISA;
    if (iters <= 0) return AIPC_ERR_SHAPE;
    return peak_rate(bits == 256 ? fma_span256 : fma_span512, nthreads, iters, FMA_CHAINS * (bits / 32));
#else
    (void)bits, (void)nthreads, (void)iters;
    return AIPC_ERR_ISA;
#endif
}

/* ------------------------------------------------------------------ instruction-mix peaks */

#ifdef PROBE_X86
/* The inner step of the AVX2 W4A16 kernel's int dequantization (x86/lowbit_a16_avx2.c), per 8 weights: the
 * code masked in place (the top nibble shifted down), converted to float32, one FMA; 8 chains, one per
 * nibble position of a 32-bit code word, which the empty asm makes opaque so nothing is hoisted. Each weight
 * is used once at M=1, so no kernel of this instruction mix multiplies faster. */
#define DQ_FMA(a, m) a = _mm256_fmadd_ps(x, _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(m))), a)
__attribute__((target("avx2,fma"))) static float dequant_fma_span256(int64_t iters, float seed) {
    __m256i w = _mm256_set1_epi32(0x12345678 + (int)seed);
    const __m256 x = _mm256_set1_ps(1e-9f);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t i = 0; i < iters; i++) {
        DQ_FMA(a0, 0xF), DQ_FMA(a1, 0xF00), DQ_FMA(a2, 0xF0000), DQ_FMA(a3, 0xF000000);
        DQ_FMA(a4, 0xF0), DQ_FMA(a5, 0xF000), DQ_FMA(a6, 0xF00000);
        a7 = _mm256_fmadd_ps(x, _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 28)), a7);
        __asm__ volatile("" : "+x"(w));
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                   _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    return _mm256_cvtss_f32(s);
}
#undef DQ_FMA

/* The int8 dot products of the W*A8 kernels, register operands only (their compute bound at M > 1): AVX2
 * vpmaddubsw into 16-bit sums (the tiles' SUM16 form, 32 multiply-adds an instruction), AVX-VNNI vpdpbusd
 * ymm (32), AVX-512 VNNI vpdpbusd zmm (64). NW x NX chains, each its own (weight, activation) pair of
 * registers that an empty asm makes opaque, so no product is hoisted or shared; 6 chains keep 11 ymm
 * registers live (the 16-bit adds wait one cycle), 12 cover vpdpbusd's latency on two pipes. */
#define OPAQUE_2_3(w, x) __asm__ volatile("" : "+x"(w[0]), "+x"(w[1]), "+x"(x[0]), "+x"(x[1]), "+x"(x[2]))
#define OPAQUE_3_4(w, x) \
    __asm__ volatile("" : "+x"(w[0]), "+x"(w[1]), "+x"(w[2]), "+x"(x[0]), "+x"(x[1]), "+x"(x[2]), "+x"(x[3]))
#define DOT_SPAN(NAME, TARGET_ISA, VEC, SET1, ZERO, STEP, FIRST, NW, NX)                                     \
    __attribute__((target(TARGET_ISA))) static float NAME(int64_t iters, float seed) {                       \
        VEC w[3], x[4], a[NW * NX];                                                                           \
        _Pragma("GCC unroll 16") for (int j = 0; j < 3; j++) w[j] = SET1(0x35 + j + (int)seed);                 \
        _Pragma("GCC unroll 16") for (int j = 0; j < 4; j++) x[j] = SET1(j - 2);                                 \
        _Pragma("GCC unroll 16") for (int j = 0; j < NW * NX; j++) a[j] = ZERO();                               \
        for (int64_t i = 0; i < iters; i++) {                                                                 \
            _Pragma("GCC unroll 16") for (int j = 0; j < NW * NX; j++) a[j] = STEP(a[j], w[j / NX], x[j % NX]); \
            OPAQUE_##NW##_##NX(w, x);                                                                         \
        }                                                                                                     \
        int32_t t = 0;                                                                                        \
        _Pragma("GCC unroll 16") for (int j = 0; j < NW * NX; j++) t += FIRST(a[j]);                            \
        return (float)t;                                                                                      \
    }
#define MADDUBS16(a, w, x) _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x))
#define DPBUSD256(a, w, x) _mm256_dpbusd_avx_epi32(a, w, x)
#define DPBUSD512(a, w, x) _mm512_dpbusd_epi32(a, w, x)
#define FIRST256(v) _mm256_extract_epi32(v, 0)
#define FIRST512(v) _mm_cvtsi128_si32(_mm512_castsi512_si128(v))
DOT_SPAN(maddubs_span256, "avx2", __m256i, _mm256_set1_epi8, _mm256_setzero_si256, MADDUBS16, FIRST256, 2, 3)
DOT_SPAN(dpbusd_span256, "avx2,avxvnni", __m256i, _mm256_set1_epi8, _mm256_setzero_si256, DPBUSD256, FIRST256, 2, 3)
DOT_SPAN(dpbusd_span512, "avx512f,avx512bw,avx512vnni", __m512i, _mm512_set1_epi8, _mm512_setzero_si512, DPBUSD512, FIRST512, 3, 4)
#endif

/* Float32 multiply-adds per second of the AVX2 W4A16 kernel's int dequantization mix (dequant_fma_span256) on
 * `nthreads` threads; negative (AIPC_ERR_ISA) without AVX2 + FMA. */
AIPC_API double aipc_dequant_fma_peak(int nthreads, int64_t iters) {
#ifdef PROBE_X86
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return AIPC_ERR_ISA;
    if (iters <= 0) return AIPC_ERR_SHAPE;
    return peak_rate(dequant_fma_span256, nthreads, iters, 8.0 * 8);
#else
    (void)nthreads, (void)iters;
    return AIPC_ERR_ISA;
#endif
}

/* u8 x s8 multiply-adds per second of the int8 dot instruction of `isa` (0: AVX2 vpmaddubsw + 16-bit adds,
 * 1: AVX-VNNI vpdpbusd ymm, 2: AVX-512 VNNI vpdpbusd zmm) on `nthreads` threads; negative (AIPC_ERR_ISA)
 * where the CPU lacks it, AIPC_ERR_SHAPE for another isa. */
AIPC_API double aipc_int8_dot_peak(int isa, int nthreads, int64_t iters) {
#ifdef PROBE_X86
    __builtin_cpu_init();
    if (isa < 0 || isa > 2 || iters <= 0) return AIPC_ERR_SHAPE;
    const int ok = isa == 0   ? __builtin_cpu_supports("avx2")
                   : isa == 1 ? __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni")
                              : __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    if (!ok) return AIPC_ERR_ISA;
    float (*span)(int64_t, float) = isa == 0 ? maddubs_span256 : isa == 1 ? dpbusd_span256 : dpbusd_span512;
    return peak_rate(span, nthreads, iters, isa == 2 ? 12 * 64.0 : 6 * 32.0);
#else
    (void)isa, (void)nthreads, (void)iters;
    return AIPC_ERR_ISA;
#endif
}

/* ------------------------------------------------------------------ timing */

/* A call the timing loop repeats: call i of a round uses operand set i % n. Returns 0 or an error. */
typedef int (*timed_call)(const void *ctx, int64_t i);

/* An entry point that takes its arguments as one int64 vector (aipc_lowbit_linear_v). */
typedef int (*vector_entry)(const int64_t *v);

typedef struct {
    vector_entry fn;
    const int64_t *const *vectors;
} vector_calls;

typedef struct {
    const void *const *bufs;
    int64_t bytes;
    int nthreads;
    volatile uint64_t sink;
} read_calls;

static int call_vector(const void *ctx, int64_t i) {
    const vector_calls *c = (const vector_calls *)ctx;
    return c->fn(c->vectors[i]);
}

static int call_read(const void *ctx, int64_t i) {
    read_calls *r = (read_calls *)ctx;
    r->sink ^= aipc_stream_read(r->bufs[i], r->bytes, r->nthreads);
    return AIPC_OK;
}

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Rounds of max(calls, n) calls over the n operand sets in turn, until two rounds and min_seconds have
 * passed; the best round's seconds per call, or the first error status (negative). The first two sets
 * are called once before (first-touch, thread start). */
static double time_rounds(timed_call f, const void *ctx, int64_t n, int64_t calls, double min_seconds) {
    if (n <= 0) return AIPC_ERR_SHAPE;
    for (int64_t i = 0; i < (n < 2 ? n : 2); i++) {
        const int status = f(ctx, i);
        if (status != AIPC_OK) return status;
    }
    if (calls < n) calls = n;
    double best = 1e30;
    const double end = seconds_now() + min_seconds;
    for (int rounds = 0; rounds < 2 || seconds_now() < end; rounds++) {
        const double t0 = seconds_now();
        for (int64_t i = 0; i < calls; i++) {
            const int status = f(ctx, i % n);
            if (status != AIPC_OK) return status;
        }
        const double per_call = (seconds_now() - t0) / (double)calls;
        if (per_call < best) best = per_call;
    }
    return best;
}

/* The seconds per call of `fn` (an entry point taking one argument vector, such as aipc_lowbit_linear_v of
 * any build of the kernel library) over the n argument vectors in turn (rotating weights); negative: a
 * call's error status. */
AIPC_API double aipc_time_vector_calls(vector_entry fn, const int64_t *const *vectors, int64_t n, int64_t calls,
                                       double min_seconds) {
    const vector_calls ctx = {fn, vectors};
    return time_rounds(call_vector, &ctx, n, calls, min_seconds);
}

/* The same for aipc_stream_read of `bytes` from each of the n buffers in turn. */
AIPC_API double aipc_time_stream_read(const void *const *bufs, int64_t n, int64_t bytes, int nthreads, int64_t calls,
                                      double min_seconds) {
    read_calls ctx = {bufs, bytes, nthreads, 0};
    return time_rounds(call_read, &ctx, n, calls, min_seconds);
}
