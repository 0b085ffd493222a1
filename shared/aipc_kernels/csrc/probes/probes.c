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

/* Float32 multiply-adds per second of `nthreads` threads, each running FMA_CHAINS independent chains of
 * `bits`-wide vector FMAs (256: AVX2 + FMA, 512: AVX-512F) for `iters` iterations, best of three rounds;
 * negative (AIPC_ERR_ISA) where this CPU has no such FMA or the build is not for x86. */
AIPC_API double aipc_fma_peak(int bits, int nthreads, int64_t iters) {
#ifdef PROBE_X86
    __builtin_cpu_init();
    if (bits == 256 ? !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
                    : bits != 512 || !__builtin_cpu_supports("avx512f"))
        return AIPC_ERR_ISA;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    if (iters <= 0) return AIPC_ERR_SHAPE;
    double best = 1e30;
    volatile float sink = 0.f;
    for (int round = 0; round < 3; round++) {
        const double t0 = omp_get_wtime();
        float total = 0.f;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
        total += bits == 256 ? fma_span256(iters, (float)omp_get_thread_num()) : fma_span512(iters, (float)omp_get_thread_num());
        const double dt = omp_get_wtime() - t0;
        sink += total;
        if (dt < best) best = dt;
    }
    (void)sink;
    return (double)nthreads * (double)iters * FMA_CHAINS * (bits / 32) / best;
#else
    (void)bits, (void)nthreads, (void)iters;
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
