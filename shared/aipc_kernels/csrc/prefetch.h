/*
 * Software prefetch of a streamed operand (the low-bit weights, and the bandwidth probe that is measured
 * against them), two distances: into L1 just ahead of the loads, and into L2 far ahead. The far one keeps
 * more lines in flight than the L1 fill buffers allow, and crosses the 4 KiB pages where the hardware
 * streamer stops: +7-9% of DRAM bandwidth at M=1 on 2 cores (A/B in one process, bench/results/cpu/gemv_cpu.md).
 * The one-token (decode) loops consume a chunk in a few instructions, so their L1 distance is longer
 * (PREFETCH_DECODE_BYTES); the multi-token tiles spend longer per chunk and keep the shorter one.
 * Override with -DPREFETCH_BYTES=... / -DPREFETCH_DECODE_BYTES=... / -DPREFETCH_L2_BYTES=0.
 */
#ifndef AIPC_PREFETCH_H
#define AIPC_PREFETCH_H

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif
/* 3 KiB against 1 KiB at M=1 on a Zen 4, Llama-3.2-1B shapes and head, outputs bit-identical: AVX2 0.74-0.98x
 * the time, AVX-512 VNNI 0.82-1.06x (interleaved A/B, bench/results/cpu/ab_native_prefetch_decode_*.md) */
#ifndef PREFETCH_DECODE_BYTES
#define PREFETCH_DECODE_BYTES 3072
#endif
#ifndef PREFETCH_L2_BYTES
#define PREFETCH_L2_BYTES 4096
#endif
#if PREFETCH_L2_BYTES > 0
#define PREFETCH_L2(p) _mm_prefetch((const char *)(p) + PREFETCH_L2_BYTES, _MM_HINT_T1)
#else
#define PREFETCH_L2(p)
#endif

#endif /* AIPC_PREFETCH_H */
