/*
 * The rotary embedding's row loops (not part of the C API; generic/rope.c says what they compute), as
 * always-inline bodies that each ISA's unit compiles with its own target, where the loops vectorise to
 * that ISA's vectors (every instance gives the same bits: -ffp-contract=off keeps products apart from
 * sums). The instances are entries of the dispatch table (dispatch.h).
 */
#ifndef AIPC_ROPE_H
#define AIPC_ROPE_H

#include <stdint.h>
#include <string.h>

#include "aipc_native.h"
#include "half_float.h"

/* One position of x: its H heads (stride sh elements) against one row of cos / sin, into o ([H][D]). */
typedef void (*rope_row_f32_fn)(const float *x, int64_t sh, const float *c, const float *s, float *o, int64_t H,
                                int64_t D, int64_t R);
typedef void (*rope_row_bf16_fn)(const uint16_t *x, int64_t sh, const uint16_t *c, const uint16_t *s, uint16_t *o,
                                 int64_t H, int64_t D, int64_t R);
typedef struct {
    rope_row_f32_fn f32;
    rope_row_bf16_fn bf16; /* float16 rows: the portable converter in generic/rope.c for every ISA */
} rope_rows;

/* generic/rope.c (baseline x86-64 / any CPU), x86/rope_avx2.c, x86/rope_avx512.c */
extern const rope_rows rope_rows_scalar;
#if defined(__x86_64__) || defined(_M_X64)
extern const rope_rows rope_rows_avx2, rope_rows_avx512;
#endif

/* half_float.h's f32_to_bf16 (round to nearest even, NaN quieted) without its branch, so that loops vectorize */
static inline __attribute__((always_inline)) uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t nan = (u >> 16) | 0x40u, rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rne);
}

static inline __attribute__((always_inline)) float bf16_value(float f) { return bf16_to_f32(bf16_round(f)); }

/* One position of a float32 x: its H heads against one row of cos / sin. */
static inline __attribute__((always_inline)) void rope_row_f32(const float *x, int64_t sh, const float *c, const float *s,
                                                                float *o, int64_t H, int64_t D, int64_t R) {
    const int64_t half = R / 2;
    for (int64_t h = 0; h < H; h++) {
        const float *xh = x + h * sh;
        float *oh = o + h * D;
        for (int64_t d = 0; d < half; d++) oh[d] = xh[d] * c[d] + -xh[d + half] * s[d];
        for (int64_t d = half; d < R; d++) oh[d] = xh[d] * c[d] + xh[d - half] * s[d];
        for (int64_t d = R; d < D; d++) oh[d] = xh[d];
    }
}

/* The same for bfloat16: each product and the sum rounded to bfloat16. */
static inline __attribute__((always_inline)) void rope_row_bf16(const uint16_t *x, int64_t sh, const uint16_t *c,
                                                                 const uint16_t *s, uint16_t *o, int64_t H, int64_t D,
                                                                 int64_t R) {
    const int64_t half = R / 2;
    for (int64_t h = 0; h < H; h++) {
        const uint16_t *xh = x + h * sh;
        uint16_t *oh = o + h * D;
        for (int64_t d = 0; d < half; d++)
            oh[d] = bf16_round(bf16_value(bf16_to_f32(xh[d]) * bf16_to_f32(c[d])) +
                               bf16_value(-bf16_to_f32(xh[d + half]) * bf16_to_f32(s[d])));
        for (int64_t d = half; d < R; d++)
            oh[d] = bf16_round(bf16_value(bf16_to_f32(xh[d]) * bf16_to_f32(c[d])) +
                               bf16_value(bf16_to_f32(xh[d - half]) * bf16_to_f32(s[d])));
        for (int64_t d = R; d < D; d++) oh[d] = xh[d];
    }
}

/* The units' instances of the two bodies under one target attribute (empty: the build's baseline). */
#define ROPE_ROWS_INSTANCE(NAME, TARGET)                                                                            \
    static TARGET void NAME##_f32(const float *x, int64_t sh, const float *c, const float *s, float *o, int64_t H,  \
                                  int64_t D, int64_t R) {                                                            \
        rope_row_f32(x, sh, c, s, o, H, D, R);                                                                       \
    }                                                                                                                \
    static TARGET void NAME##_bf16(const uint16_t *x, int64_t sh, const uint16_t *c, const uint16_t *s, uint16_t *o, \
                                   int64_t H, int64_t D, int64_t R) {                                                \
        rope_row_bf16(x, sh, c, s, o, H, D, R);                                                                      \
    }                                                                                                                \
    const rope_rows NAME = {NAME##_f32, NAME##_bf16};

#endif /* AIPC_ROPE_H */
