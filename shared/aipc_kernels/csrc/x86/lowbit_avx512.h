/*
 * AVX-512 helpers shared by the AVX-512 VNNI kernels (lowbit_avx512.c), the AMX kernels (lowbit_amx.c,
 * which up-convert, scale and store like them), the W4A16 kernel (lowbit_a16_avx512.c) and the activation
 * quantizer (act_quant_avx512.c): the
 * conversions, the up-conversion of a row block, the group epilogue and the store of lowbit_args.
 */
#ifndef AIPC_LOWBIT_AVX512_H
#define AIPC_LOWBIT_AVX512_H

#include <immintrin.h>
#include <string.h>

#include "lowbit_kernels.h"

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

/* acc += u8(a) . s8(b) per 32-bit lane. GCC 12 allocates the _mm512_dpbusd_epi32 builtin with a
 * register copy around every accumulate; this ties the accumulator in place. */
static inline T512 __m512i dpbusd512(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* dpbusd512 with b the 32-bit word at x broadcast to every lane by the instruction itself (an embedded {1to16}
 * memory operand): no separate vpbroadcastd per dot, the same products. */
static inline T512 __m512i dpbusd512_x(__m512i acc, __m512i a, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*x));
    return acc;
}

static inline T512 __m512 half16_to_ps(__m256i h, int dt) {
    if (dt == AIPC_DT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 fp16/bf16/fp32 values at p[i..i+15] as float32. */
static inline T512 __m512 load16_scales(const void *p, int64_t i, int dt) {
    if (dt == AIPC_DT_F32) return _mm512_loadu_ps((const float *)p + i);
    return half16_to_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)), dt);
}

static inline T512 __m512 load16_scales_masked(const void *p, int64_t i, int dt, __mmask16 k) {
    return half16_to_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)p + i), dt);
}

/* The 16 scales (sup: super_scales) or mins (super_mins) of row block nb's group g at p[si..si+15] as
 * float32, the scales' type dt: stored, or in the two-level form (AIPC_SCALE_I8) super-block float32 times int8
 * sub-block value (group_value). A caller whose dt is a compile-time constant gets no runtime case. */
static inline T512 __m512 load16_group_dt(const lowbit_args *a, const void *p, const float *sup, int64_t si,
                                          int64_t nb, int64_t g, int dt) {
    if (dt != AIPC_SCALE_I8) return load16_scales(p, si, dt);
    const __m512 sub = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + si))));
    return _mm512_mul_ps(_mm512_loadu_ps(sup + super_at(a, nb, g)), sub);
}

/* load16_group_dt in the args' own scale type. */
static inline T512 __m512 load16_group(const lowbit_args *a, const void *p, const float *sup, int64_t si, int64_t nb,
                                       int64_t g) {
    return load16_group_dt(a, p, sup, si, nb, g, a->scale_dt);
}

/* Up-converts plane q of a 64-byte chunk to 16 rows x 4 k of u8 codes. */
static inline T512 __m512i plane512(__m512i w, int q, int bits) {
    const __m512i mask = _mm512_set1_epi8((char)((1 << bits) - 1));
    return _mm512_and_si512(q ? _mm512_srli_epi16(w, (unsigned)(q * bits)) : w, mask);
}

/* Where an int32 dot of token m's group g (mg = m * K/G + g) starts: where int_epilogue, at minus the group's
 * integer zero term (the op's table lowbit_args.zero_start), so the dot ends as group_u_int's u with no multiply,
 * conversion or subtraction per group and token (the same integers, added in another order: bit-identical);
 * else at 0. Every caller of group_epilogue512 starts its unshifted chain here. */
static inline T512 __m512i dot_start512(const lowbit_args *a, int64_t mg) {
    return int_epilogue(a) ? _mm512_set1_epi32(a->zero_start[mg]) : _mm512_setzero_si512();
}

/* The epilogue of group g for MT tokens (see lowbit_args): u = dot - z * zq (where int_epilogue the dot, from
 * dot_start512, is u already); acc += s * ws * u (+ m * ws * zq). */
static inline T512 void group_epilogue512(const lowbit_args *a, int64_t nb, int64_t g, int64_t m0, int mt,
                                          const __m512i *dot, __m512 *acc) {
    const int64_t ng = a->K / a->G, si = (nb * ng + g) * BLOCK_N;
    const __m512 s = load16_group(a, a->scales, a->super_scales, si, nb, g);
    const __m512 z = a->zeros ? load16_scales(a->zeros, si, a->scale_dt) : _mm512_set1_ps(a->zero_const);
    const __m512 mn = a->mins ? load16_group(a, a->mins, a->super_mins, si, nb, g) : _mm512_setzero_ps();
    for (int i = 0; i < mt; i++) {
        const int64_t mg = (m0 + i) * ng + g;
        const __m512 zz = _mm512_set1_ps(a->zq[mg]);
        /* int_epilogue: the dot started at -int(z * zq) (dot_start512), so it is group_u_int's u */
        const __m512 u = int_epilogue(a) ? _mm512_cvtepi32_ps(dot[i]) : _mm512_fnmadd_ps(z, zz, _mm512_cvtepi32_ps(dot[i]));
        acc[i] = _mm512_fmadd_ps(a->ws ? _mm512_mul_ps(s, _mm512_set1_ps(a->ws[mg])) : s, u, acc[i]);
        if (a->mins) acc[i] = _mm512_fmadd_ps(a->ws ? _mm512_mul_ps(mn, _mm512_set1_ps(a->ws[mg])) : mn, zz, acc[i]);
    }
}

/* Whether group_epilogue512_fixed computes group_epilogue512's result: codes with a fixed zero (int_epilogue), with
 * or without mins, outside the progressive form. q6k_epilogue_fits: that, for 6-bit codes without mins in groups of
 * one chunk with two-level int8 scales (GGUF's Q6_K as lowbit_args carries it). */
static inline int fixed_epilogue_fits(const lowbit_args *a) { return int_epilogue(a) && !a->int_acc; }
static inline int q6k_epilogue_fits(const lowbit_args *a) {
    return a->bits == 6 && a->G == chunk_k(6) && a->scale_dt == AIPC_SCALE_I8 && !a->mins && fixed_epilogue_fits(a);
}

/* group_epilogue512 where fixed_epilogue_fits, with whether activation group scales come (HAS_WS), the scales'
 * type (SDT: scale_dt) and whether mins come (MINS: the min form, e.g. GGUF's K-quants) compile-time constants of
 * the caller: the same operations in the same order, none of its runtime cases. */
static inline T512 __attribute__((always_inline)) void group_epilogue512_fixed(const lowbit_args *a, int64_t nb,
                                                                                int64_t g, int64_t m0, int mt,
                                                                                const __m512i *dot, __m512 *acc,
                                                                                const int HAS_WS, const int SDT,
                                                                                const int MINS) {
    const int64_t ng = a->K / a->G, si = (nb * ng + g) * BLOCK_N;
    const __m512 s = load16_group_dt(a, a->scales, a->super_scales, si, nb, g, SDT);
    const __m512 mn = MINS ? load16_group_dt(a, a->mins, a->super_mins, si, nb, g, SDT) : _mm512_setzero_ps();
    for (int i = 0; i < mt; i++) {
        const int64_t mg = (m0 + i) * ng + g;
        const __m512 u = _mm512_cvtepi32_ps(dot[i]);
        acc[i] = _mm512_fmadd_ps(HAS_WS ? _mm512_mul_ps(s, _mm512_set1_ps(a->ws[mg])) : s, u, acc[i]);
        if (MINS)
            acc[i] = _mm512_fmadd_ps(HAS_WS ? _mm512_mul_ps(mn, _mm512_set1_ps(a->ws[mg])) : mn,
                                     _mm512_set1_ps(a->zq[mg]), acc[i]);
    }
}

/* The progressive form's group epilogue (lowbit_args.int_acc) for MT tokens: acc holds int32 bits, += s1 * dot +
 * m * gsum (lowbit_avx512_prog.c's tiles). */
static inline T512 void prog_epilogue512(const lowbit_args *a, int64_t nb, int64_t g, int64_t m0, int mt,
                                         const __m512i *dot, __m512 *acc) {
    const int64_t ng = a->K / a->G, si = (nb * ng + g) * BLOCK_N;
    const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)a->scales + si)));
    const __m512i m1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)a->mins + si)));
    if (prog_dots16(a->G, a->bits)) { /* (dot, gsum) x (s1, m) as 16-bit pairs: one vpdpwssd */
        const __m512i lo16 = _mm512_set1_epi32(0xffff), sm = _mm512_ternarylogic_epi32(s1, lo16, _mm512_slli_epi32(m1, 16), 0xea);
        for (int i = 0; i < mt; i++) {
            const __m512i gs = _mm512_set1_epi32(a->prog_sums[(m0 + i) * ng + g]); /* gsum << 16 */
            acc[i] = _mm512_castsi512_ps(_mm512_dpwssd_epi32(_mm512_castps_si512(acc[i]),
                                                             _mm512_ternarylogic_epi32(dot[i], lo16, gs, 0xea), sm));
        }
        return;
    }
    for (int i = 0; i < mt; i++) {
        const __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(s1, dot[i]),
                                           _mm512_mullo_epi32(m1, _mm512_set1_epi32(a->prog_sums[(m0 + i) * ng + g])));
        acc[i] = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(acc[i]), t));
    }
}

/* The progressive form's int32 accumulators (float registers holding their bits) of row block nb for MT tokens as
 * the floats store512 takes: float(acc) * s0 (prog_scale). */
static inline T512 void prog_to_float512(const lowbit_args *a, int64_t nb, int64_t mt, __m512 *acc) {
    const __m512 s0 = _mm512_loadu_ps(a->super_scales + nb * BLOCK_N);
    for (int64_t i = 0; i < mt; i++) acc[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(acc[i])), s0);
}

/* Writes 16 outputs of row block nb for MT tokens: acc * outs[m] (outs NULL: acc) + bias, in the output dtype. */
static inline T512 void store512(const lowbit_args *a, int64_t m0, int mt, int64_t nb, const __m512 *acc) {
    const int64_t n0 = nb * BLOCK_N, nn = a->N - n0 < BLOCK_N ? a->N - n0 : BLOCK_N;
    const __mmask16 k = (__mmask16)((1u << nn) - 1u);
    __m512 bias = _mm512_setzero_ps();
    if (a->bias) {
        if (a->out_dt == AIPC_DT_F32) bias = _mm512_maskz_loadu_ps(k, (const float *)a->bias + n0);
        else bias = load16_scales_masked(a->bias, n0, a->out_dt, k);
    }
    for (int i = 0; i < mt; i++) {
        const __m512 v = _mm512_add_ps(a->outs ? _mm512_mul_ps(acc[i], _mm512_set1_ps(a->outs[m0 + i])) : acc[i], bias);
        const int64_t off = (m0 + i) * a->N + n0;
        if (a->out_dt == AIPC_DT_F32) {
            _mm512_mask_storeu_ps((float *)a->y + off, k, v);
        } else {
            __m256i h;
            if (a->out_dt == AIPC_DT_F16) {
                h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            } else { /* bf16, round to nearest even; NaN stays NaN */
                const __m512i u = _mm512_castps_si512(v);
                const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
                const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
                h = _mm512_cvtepi32_epi16(r);
            }
            _mm256_mask_storeu_epi16((uint16_t *)a->y + off, k, h);
        }
    }
}

/* store512 of the progressive form's tiles (at most 8 tokens): their int32 accumulators as floats first. */
static inline T512 void prog_store512(const lowbit_args *a, int64_t m0, int mt, int64_t nb, const __m512 *acc) {
    __m512 r[8];
    for (int i = 0; i < mt; i++) r[i] = acc[i];
    prog_to_float512(a, nb, mt, r);
    store512(a, m0, mt, nb, r);
}

/* Quad q (k = 4q + kk) of a 6-bit chunk's units la, lb, hi as 16 rows x 4 k of u8 codes 0..63 (six_bit_code). */
static inline T512 __m512i six_bit_quad512(__m512i la, __m512i lb, __m512i hi, int q) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __m512i lo = q & 1 ? _mm512_srli_epi16(q < 2 ? la : lb, 4) : (q < 2 ? la : lb);
    const __m512i h2 = q == 0 ? _mm512_slli_epi16(hi, 4) : q == 1 ? _mm512_slli_epi16(hi, 2)
                       : q == 2 ? hi : _mm512_srli_epi16(hi, 2);
    return _mm512_ternarylogic_epi32(_mm512_and_si512(lo, m4), h2, m30, 0xf8); /* lo | (h2 & m30) */
}

/* Row block nb up-converted to int8 planes: up[(c * nq + q) * 64] = plane q of chunk c ([K/4][64] bytes);
 * 6-bit chunks: their three units loaded once, four quads out. */
static inline T512 void upconvert_block512(const lowbit_args *a, int64_t nb, uint8_t *up) {
    const int64_t kc = chunk_k(a->bits), nq = kc / 4, nchunks = a->K / kc;
    const uint8_t *wb = a->w + nb * nchunks * chunk_bytes(a->bits);
    if (a->bits == 6) {
        for (int64_t c = 0; c < nchunks; c++) {
            const uint8_t *wc = wb + c * chunk_bytes(6);
            const __m512i la = _mm512_loadu_si512((const void *)wc), lb = _mm512_loadu_si512((const void *)(wc + 64)),
                          hi = _mm512_loadu_si512((const void *)(wc + 128));
            for (int q = 0; q < 4; q++) _mm512_store_si512((void *)(up + (c * 4 + q) * CHUNK_BYTES), six_bit_quad512(la, lb, hi, q));
        }
        return;
    }
    for (int64_t c = 0; c < nchunks; c++) {
        const __m512i w = _mm512_loadu_si512((const void *)(wb + c * CHUNK_BYTES));
        for (int q = 0; q < nq; q++) _mm512_store_si512((void *)(up + (c * nq + q) * CHUNK_BYTES), plane512(w, q, a->bits));
    }
}

#endif /* AIPC_LOWBIT_AVX512_H */
