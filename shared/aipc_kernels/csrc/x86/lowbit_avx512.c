/*
 * AVX-512 VNNI kernels of the low-bit linear layer: decode (one token: gemv512_2b / gemv512_1b /
 * gemv512_4b / gemv512_6b / gemv512_8b), batches below up_min_m tokens (tile_otf512, tile_otf6_512: up-convert
 * on the fly, a tile of otf_m tokens shares each plane), and from up_min_m tokens on each row block
 * up-converted once and reused by every token tile (tile_up512).
 */
#include "lowbit_kernels.h"
#ifdef AIPC_X86
#include "lowbit_avx512.h"
#include "prefetch.h"

/* Up-convert on the fly, MT tokens share each up-converted vector (small M).
 * In tiles of up to OTF_MASKED_M tokens, plane q is masked in place (w & (mask << q*bits) = 2^(q*bits) * c_q), so no shift
 * sits beside the VNNI op on its port; each plane has its own int32 sums, shifted back once per group (exact:
 * they are multiples of 2^(q*bits)). Larger tiles shift the planes down, one chain per token. */
static inline T512 __attribute__((always_inline)) void tile_otf512(const lowbit_args *a, int64_t nb, int64_t m0,
                                                                    const int MT, const int bits) {
    const int nq = 8 / bits;
    const int shifted = MT > OTF_MASKED_M; /* planes shifted down, one chain per token (else one per plane) */
    const int64_t kc = chunk_k(bits), ng = a->K / a->G, cpg = a->G / kc;
    const uint8_t *wb = a->w + nb * (a->K / kc) * CHUNK_BYTES;
    const int32_t *xt = a->xt + m0 * (a->K / 4); /* m0 is a multiple of T = MT's tile */
    __m512i pmask[8];
    for (int q = 0; q < nq; q++) pmask[q] = _mm512_set1_epi8((char)(((1 << bits) - 1) << (q * bits)));
    __m512 acc[OTF_MAX];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i dq[OTF_MAX][8];
        for (int i = 0; i < MT; i++)
            for (int q = 0; q < nq; q++) dq[i][q] = q ? _mm512_setzero_si512() : dot_start512(a, (m0 + i) * ng + g);
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            const __m512i w = _mm512_loadu_si512((const void *)(wb + c * CHUNK_BYTES));
            _mm_prefetch((const char *)(wb + c * CHUNK_BYTES) + PREFETCH_BYTES, _MM_HINT_T0);
            PREFETCH_L2(wb + c * CHUNK_BYTES);
            for (int q = 0; q < nq; q++) {
                const __m512i wq = shifted ? plane512(w, q, bits) : _mm512_and_si512(w, pmask[q]);
                const int d = shifted ? 0 : q;
                for (int i = 0; i < MT; i++) dq[i][d] = dpbusd512(dq[i][d], wq, _mm512_set1_epi32(xt[(c * nq + q) * a->T + i]));
            }
        }
        __m512i dot[OTF_MAX];
        for (int i = 0; i < MT; i++) {
            dot[i] = dq[i][0];
            for (int q = 1; q < (shifted ? 1 : nq); q++) dot[i] = _mm512_add_epi32(dot[i], _mm512_srai_epi32(dq[i][q], (unsigned)(q * bits)));
        }
        group_epilogue512(a, nb, g, m0, MT, dot, acc);
    }
    store512(a, m0, MT, nb, acc);
}

/* A 6-bit chunk's three units (lowbit_kernels.h) at wc, prefetching the stream pf bytes ahead into L1 (and far ahead
 * into L2). */
static inline T512 __attribute__((always_inline)) void six_bit_units512(const uint8_t *wc, int64_t pf, __m512i *la,
                                                                         __m512i *lb, __m512i *hi) {
    _mm_prefetch((const char *)wc + pf, _MM_HINT_T0);
    _mm_prefetch((const char *)wc + pf + 64, _MM_HINT_T0);
    _mm_prefetch((const char *)wc + pf + 128, _MM_HINT_T0);
    PREFETCH_L2(wc);
    PREFETCH_L2(wc + 128);
    *la = _mm512_loadu_si512((const void *)wc);
    *lb = _mm512_loadu_si512((const void *)(wc + 64));
    *hi = _mm512_loadu_si512((const void *)(wc + 128));
}

/* 6-bit codes on the fly: each chunk's three units become four quads of u8 codes (six_bit_quad512), shared by the
 * tile's MT tokens, one chain per token. */
static inline T512 __attribute__((always_inline)) void tile_otf6_512(const lowbit_args *a, int64_t nb, int64_t m0,
                                                                      const int MT) {
    const int64_t cb = chunk_bytes(6), ng = a->K / a->G, cpg = a->G / chunk_k(6);
    const uint8_t *wb = a->w + nb * (a->K / chunk_k(6)) * cb;
    const int32_t *xt = a->xt + m0 * (a->K / 4); /* m0 is a multiple of T = MT's tile */
    __m512 acc[OTF_MAX];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i dot[OTF_MAX];
        for (int i = 0; i < MT; i++) dot[i] = dot_start512(a, (m0 + i) * ng + g);
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            __m512i la, lb, hi;
            six_bit_units512(wb + c * cb, PREFETCH_BYTES, &la, &lb, &hi);
            for (int q = 0; q < 4; q++) {
                const __m512i wq = six_bit_quad512(la, lb, hi, q);
                for (int i = 0; i < MT; i++) dot[i] = dpbusd512(dot[i], wq, _mm512_set1_epi32(xt[(c * 4 + q) * a->T + i]));
            }
        }
        group_epilogue512(a, nb, g, m0, MT, dot, acc);
    }
    store512(a, m0, MT, nb, acc);
}

/* Decode (one token): explicit accumulators, one per bit-plane. Two explicit kernels, 2 and 1 bits: one
 * kernel parametrised by the bit width (an unrolled array of plane chains, the same reduction tree)
 * compiles (GCC 12) to nearly the same instructions in another order and register allocation, code that
 * no A/B has measured; these two are the measured ones. */
#define PLANE_DOT(d, q) d = dpbusd512(d, _mm512_and_si512(w, m##q), _mm512_set1_epi32(xp[c * NQ + q]))

static T512 __attribute__((noinline)) void gemv512_2b(const lowbit_args *a, int64_t nb, int64_t m) {
    enum { NQ = 4 };
    const int64_t kc = chunk_k(2), ng = a->K / a->G, cpg = a->G / kc;
    const uint8_t *wb = a->w + nb * (a->K / kc) * CHUNK_BYTES;
    const __m512i m0 = _mm512_set1_epi8(0x03), m1 = _mm512_set1_epi8(0x0c), m2 = _mm512_set1_epi8(0x30),
                  m3 = _mm512_set1_epi8((char)0xc0);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wp = wb + g * cpg * CHUNK_BYTES;
        const int32_t *xp = (const int32_t *)(a->xq + m * a->K) + g * cpg * NQ;
        /* four chains: a chunk takes longer to issue than the VNNI latency (a second set of chains, to
         * be merged per group, measured 3% slower) */
        __m512i d0 = dot_start512(a, m * ng + g), d1 = _mm512_setzero_si512(), d2 = d1, d3 = d1;
        for (int64_t c = 0; c < cpg; c++) {
            _mm_prefetch((const char *)(wp + c * CHUNK_BYTES) + PREFETCH_DECODE_BYTES, _MM_HINT_T0);
            PREFETCH_L2(wp + c * CHUNK_BYTES);
            const __m512i w = _mm512_loadu_si512((const void *)(wp + c * CHUNK_BYTES));
            PLANE_DOT(d0, 0);
            PLANE_DOT(d1, 1);
            PLANE_DOT(d2, 2);
            PLANE_DOT(d3, 3);
        }
        __m512i dot = _mm512_add_epi32(_mm512_add_epi32(d0, _mm512_srai_epi32(d1, 2)),
                                       _mm512_add_epi32(_mm512_srai_epi32(d2, 4), _mm512_srai_epi32(d3, 6)));
        group_epilogue512(a, nb, g, m, 1, &dot, &acc);
    }
    store512(a, m, 1, nb, &acc);
}

static T512 __attribute__((noinline)) void gemv512_1b(const lowbit_args *a, int64_t nb, int64_t m) {
    enum { NQ = 8 };
    const int64_t kc = chunk_k(1), ng = a->K / a->G, cpg = a->G / kc;
    const uint8_t *wb = a->w + nb * (a->K / kc) * CHUNK_BYTES;
    const __m512i m0 = _mm512_set1_epi8(0x01), m1 = _mm512_set1_epi8(0x02), m2 = _mm512_set1_epi8(0x04),
                  m3 = _mm512_set1_epi8(0x08), m4 = _mm512_set1_epi8(0x10), m5 = _mm512_set1_epi8(0x20),
                  m6 = _mm512_set1_epi8(0x40), m7 = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wp = wb + g * cpg * CHUNK_BYTES;
        const int32_t *xp = (const int32_t *)(a->xq + m * a->K) + g * cpg * NQ;
        __m512i d0 = dot_start512(a, m * ng + g), d1 = _mm512_setzero_si512(), d2 = d1, d3 = d1, d4 = d1, d5 = d1, d6 = d1, d7 = d1;
        for (int64_t c = 0; c < cpg; c++) {
            _mm_prefetch((const char *)(wp + c * CHUNK_BYTES) + PREFETCH_DECODE_BYTES, _MM_HINT_T0);
            PREFETCH_L2(wp + c * CHUNK_BYTES);
            const __m512i w = _mm512_loadu_si512((const void *)(wp + c * CHUNK_BYTES));
            PLANE_DOT(d0, 0);
            PLANE_DOT(d1, 1);
            PLANE_DOT(d2, 2);
            PLANE_DOT(d3, 3);
            PLANE_DOT(d4, 4);
            PLANE_DOT(d5, 5);
            PLANE_DOT(d6, 6);
            PLANE_DOT(d7, 7);
        }
        __m512i lo = _mm512_add_epi32(_mm512_add_epi32(d0, _mm512_srai_epi32(d1, 1)),
                                      _mm512_add_epi32(_mm512_srai_epi32(d2, 2), _mm512_srai_epi32(d3, 3)));
        __m512i hi = _mm512_add_epi32(_mm512_add_epi32(_mm512_srai_epi32(d4, 4), _mm512_srai_epi32(d5, 5)),
                                      _mm512_add_epi32(_mm512_srai_epi32(d6, 6), _mm512_srai_epi32(d7, 7)));
        __m512i dot = _mm512_add_epi32(lo, hi);
        group_epilogue512(a, nb, g, m, 1, &dot, &acc);
    }
    store512(a, m, 1, nb, &acc);
}
/* 4-bit codes: two planes (low and high nibbles), two chains each. */
static T512 __attribute__((noinline)) void gemv512_4b(const lowbit_args *a, int64_t nb, int64_t m) {
    enum { NQ = 2 };
    const int64_t kc = chunk_k(4), ng = a->K / a->G, cpg = a->G / kc;
    const uint8_t *wb = a->w + nb * (a->K / kc) * CHUNK_BYTES;
    const __m512i m0 = _mm512_set1_epi8(0x0f), m1 = _mm512_set1_epi8((char)0xf0);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wp = wb + g * cpg * CHUNK_BYTES;
        const int32_t *xp = (const int32_t *)(a->xq + m * a->K) + g * cpg * NQ;
        __m512i d0 = dot_start512(a, m * ng + g), d1 = _mm512_setzero_si512(), e0 = d1, e1 = d1;
        int64_t c = 0;
        for (; c + 2 <= cpg; c += 2) {
            _mm_prefetch((const char *)(wp + c * CHUNK_BYTES) + PREFETCH_DECODE_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(wp + c * CHUNK_BYTES) + PREFETCH_DECODE_BYTES + 64, _MM_HINT_T0);
            PREFETCH_L2(wp + c * CHUNK_BYTES);
            __m512i w = _mm512_loadu_si512((const void *)(wp + c * CHUNK_BYTES));
            PLANE_DOT(d0, 0);
            PLANE_DOT(d1, 1);
            w = _mm512_loadu_si512((const void *)(wp + (c + 1) * CHUNK_BYTES));
            e0 = dpbusd512(e0, _mm512_and_si512(w, m0), _mm512_set1_epi32(xp[(c + 1) * NQ]));
            e1 = dpbusd512(e1, _mm512_and_si512(w, m1), _mm512_set1_epi32(xp[(c + 1) * NQ + 1]));
        }
        for (; c < cpg; c++) {
            const __m512i w = _mm512_loadu_si512((const void *)(wp + c * CHUNK_BYTES));
            PLANE_DOT(d0, 0);
            PLANE_DOT(d1, 1);
        }
        __m512i dot = _mm512_add_epi32(_mm512_add_epi32(d0, e0), _mm512_srai_epi32(_mm512_add_epi32(d1, e1), 4));
        group_epilogue512(a, nb, g, m, 1, &dot, &acc);
    }
    store512(a, m, 1, nb, &acc);
}
#undef PLANE_DOT

/* 8-bit codes: a chunk is the VNNI operand as stored (one plane), so the decode kernel is a plain
 * stream of dot products; four chains over consecutive chunks hide the VNNI latency. */
static T512 __attribute__((noinline)) void gemv512_8b(const lowbit_args *a, int64_t nb, int64_t m) {
    const int64_t ng = a->K / a->G, cpg = a->G / 4;
    const uint8_t *wb = a->w + nb * (a->K / 4) * CHUNK_BYTES;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wp = wb + g * cpg * CHUNK_BYTES;
        const int32_t *xp = (const int32_t *)(a->xq + m * a->K) + g * cpg;
        __m512i d0 = dot_start512(a, m * ng + g), d1 = _mm512_setzero_si512(), d2 = d1, d3 = d1;
        int64_t c = 0;
        for (; c + 4 <= cpg; c += 4) {
            _mm_prefetch((const char *)(wp + c * CHUNK_BYTES) + PREFETCH_DECODE_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(wp + c * CHUNK_BYTES) + PREFETCH_DECODE_BYTES + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)(wp + c * CHUNK_BYTES) + PREFETCH_DECODE_BYTES + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)(wp + c * CHUNK_BYTES) + PREFETCH_DECODE_BYTES + 192, _MM_HINT_T0);
            PREFETCH_L2(wp + c * CHUNK_BYTES);
            d0 = dpbusd512(d0, _mm512_loadu_si512((const void *)(wp + c * CHUNK_BYTES)), _mm512_set1_epi32(xp[c]));
            d1 = dpbusd512(d1, _mm512_loadu_si512((const void *)(wp + (c + 1) * CHUNK_BYTES)), _mm512_set1_epi32(xp[c + 1]));
            d2 = dpbusd512(d2, _mm512_loadu_si512((const void *)(wp + (c + 2) * CHUNK_BYTES)), _mm512_set1_epi32(xp[c + 2]));
            d3 = dpbusd512(d3, _mm512_loadu_si512((const void *)(wp + (c + 3) * CHUNK_BYTES)), _mm512_set1_epi32(xp[c + 3]));
        }
        for (; c < cpg; c++) d0 = dpbusd512(d0, _mm512_loadu_si512((const void *)(wp + c * CHUNK_BYTES)), _mm512_set1_epi32(xp[c]));
        __m512i dot = _mm512_add_epi32(_mm512_add_epi32(d0, d1), _mm512_add_epi32(d2, d3));
        group_epilogue512(a, nb, g, m, 1, &dot, &acc);
    }
    store512(a, m, 1, nb, &acc);
}

/* 6-bit codes: each chunk's three units (lowbit_kernels.h) become four quads of u8 codes, one chain each. */
static T512 __attribute__((noinline)) void gemv512_6b(const lowbit_args *a, int64_t nb, int64_t m) {
    const int64_t cb = chunk_bytes(6), ng = a->K / a->G, cpg = a->G / chunk_k(6);
    const uint8_t *wb = a->w + nb * (a->K / chunk_k(6)) * cb;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *wp = wb + g * cpg * cb;
        const int32_t *xp = (const int32_t *)(a->xq + m * a->K) + g * cpg * 4;
        __m512i d0 = dot_start512(a, m * ng + g), d1 = _mm512_setzero_si512(), d2 = d1, d3 = d1;
        for (int64_t c = 0; c < cpg; c++) {
            __m512i la, lb, hi;
            six_bit_units512(wp + c * cb, PREFETCH_DECODE_BYTES, &la, &lb, &hi);
            d0 = dpbusd512(d0, six_bit_quad512(la, lb, hi, 0), _mm512_set1_epi32(xp[c * 4]));
            d1 = dpbusd512(d1, six_bit_quad512(la, lb, hi, 1), _mm512_set1_epi32(xp[c * 4 + 1]));
            d2 = dpbusd512(d2, six_bit_quad512(la, lb, hi, 2), _mm512_set1_epi32(xp[c * 4 + 2]));
            d3 = dpbusd512(d3, six_bit_quad512(la, lb, hi, 3), _mm512_set1_epi32(xp[c * 4 + 3]));
        }
        __m512i dot = _mm512_add_epi32(_mm512_add_epi32(d0, d1), _mm512_add_epi32(d2, d3));
        group_epilogue512(a, nb, g, m, 1, &dot, &acc);
    }
    store512(a, m, 1, nb, &acc);
}

/* Block already up-converted to int8 planes in `up` ([K/4][64] bytes): reused by every token tile. */
static inline T512 __attribute__((always_inline)) void tile_up512(const lowbit_args *a, int64_t nb, int64_t m0,
                                                                   const int MT, const uint8_t *up) {
    const int64_t ng = a->K / a->G, qpg = a->G / 4;
    const int32_t *xt = a->xt + m0 * (a->K / 4);
    __m512 acc[8];
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i dot[8];
        for (int i = 0; i < MT; i++) dot[i] = dot_start512(a, (m0 + i) * ng + g);
        for (int64_t kq = g * qpg; kq < (g + 1) * qpg; kq++) {
            const __m512i wq = _mm512_loadu_si512((const void *)(up + kq * CHUNK_BYTES));
            for (int i = 0; i < MT; i++) dot[i] = dpbusd512(dot[i], wq, _mm512_set1_epi32(xt[kq * UP_M + i]));
        }
        group_epilogue512(a, nb, g, m0, MT, dot, acc);
    }
    store512(a, m0, MT, nb, acc);
}

/* FN(a, nb, m0, mt, ...) with mt (1-8 tokens) a compile-time constant */
#define TILE_CASES(FN, ...)                                                                                            \
    switch (mt) {                                                                                                      \
    case 8: FN(a, nb, m0, 8, ##__VA_ARGS__); break;                                                                    \
    case 7: FN(a, nb, m0, 7, ##__VA_ARGS__); break;                                                                    \
    case 6: FN(a, nb, m0, 6, ##__VA_ARGS__); break;                                                                    \
    case 5: FN(a, nb, m0, 5, ##__VA_ARGS__); break;                                                                    \
    case 4: FN(a, nb, m0, 4, ##__VA_ARGS__); break;                                                                    \
    case 3: FN(a, nb, m0, 3, ##__VA_ARGS__); break;                                                                    \
    case 2: FN(a, nb, m0, 2, ##__VA_ARGS__); break;                                                                    \
    default: FN(a, nb, m0, 1, ##__VA_ARGS__);                                                                          \
    }
_Static_assert(UP_M <= 8 && OTF_MAX <= 8, "TILE_CASES has cases for tiles of up to 8 tokens");

T512 void block_avx512(const lowbit_args *a, int64_t nb, uint8_t *up) {
    if (a->M >= up_min_m(a->bits)) {
        upconvert_block512(a, nb, up); /* not 8-bit codes (up_min_m) */
        for (int64_t m0 = 0; m0 < a->M; m0 += UP_M) {
            const int64_t mt = a->M - m0 < UP_M ? a->M - m0 : UP_M;
            TILE_CASES(tile_up512, up)
        }
        return;
    }
    if (a->M == 1) {
        if (a->bits == 2) gemv512_2b(a, nb, 0);
        else if (a->bits == 6) gemv512_6b(a, nb, 0);
        else if (a->bits == 8) gemv512_8b(a, nb, 0);
        else if (a->bits == 4) gemv512_4b(a, nb, 0);
        else gemv512_1b(a, nb, 0);
        return;
    }
    /* on-the-fly tiles of otf_m(bits) tokens (the last one shorter) */
    const int64_t tile = otf_m(a->bits);
    for (int64_t m0 = 0; m0 < a->M; m0 += tile) {
        const int64_t mt = a->M - m0 < tile ? a->M - m0 : tile;
        if (a->bits == 8) {
            TILE_CASES(tile_otf512, 8)
        } else if (a->bits == 6) {
            TILE_CASES(tile_otf6_512)
        } else if (a->bits == 4) {
            TILE_CASES(tile_otf512, 4)
        } else if (a->bits == 2) {
            TILE_CASES(tile_otf512, 2)
        } else if (mt == 2) {
            tile_otf512(a, nb, m0, 2, 1);
        } else {
            tile_otf512(a, nb, m0, 1, 1);
        }
    }
}
#undef TILE_CASES
#endif /* AIPC_X86 */
