/*
 * AMX-INT8 kernels of the low-bit linear layer (from AMX_MIN_M tokens on, where the CPU and the OS
 * allow AMX: cpu_features.c).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "lowbit_kernels.h"
#ifdef AIPC_AMX
#include "lowbit_avx512.h"

/* ------------------------------------------------------------------ AMX int8 (large M) */
/* Each row block is up-converted once per pass to an AMX B tile stream in VNNI order ([K/4][16 rows]
 * [4 k] int8): ks/4 consecutive 64-byte rows cover ks k for 16 outputs. For code books with a fixed
 * zero point the up-converted bytes are the signed levels r*(cmul*c - z) (r = 1 or 2 makes them
 * integers), so no zero correction is needed; the affine code book keeps the codes and subtracts
 * z * s * (group sum of xq). Activations are re-laid out once per call as A tiles ([M/16][K/ks][16
 * tokens][ks] int8, rows padded with zeros): each tile load is one contiguous 1 KB read. C tiles are 16
 * tokens x 16 outputs int32 (tdpbssd). Blocking: 2 token tiles x 2 row blocks = 4 C tiles per k step
 * (each A and B tile used twice). Per-token activation scales are applied once at the end. */

#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8")))
#define AMX_MB 256 /* tokens per pass over the weights: their A tiles stay in L2 */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

typedef struct {
    const int8_t *xa;  /* A tiles */
    int64_t ks;        /* k per tile step */
    int level_mul;     /* fixed zero: up-converted byte = level_mul * c - level_sub; 0: affine (codes) */
    int level_sub;
    float level_scale; /* 1 / (r * cmul), 1 or 1/2: a dot of levels times it is exactly u = dot - z * zq */
    int64_t nblocks;
    int64_t Mp;        /* token rows, whole tiles */
    const float *zq_t, *ws_t; /* lowbit_args.zq and .ws group-major, [K/G][Mp], where the epilogue reads them (else
                               * NULL): the epilogue of one group reads its tokens' values from consecutive lines */
} amx_plan;

/* k per tile step: 64, or 32 / 16 where the group size is an odd multiple of 32 / 16 */
static inline int64_t amx_kstep(int64_t G) { return G % 32 ? 16 : G % 64 ? 32 : 64; }

static TAMX void amx_configure(int64_t ks) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = AMX_M, cfg.colsb[t] = 64;              /* C */
    for (int t = 4; t < 6; t++) cfg.rows[t] = AMX_M, cfg.colsb[t] = (uint16_t)ks;    /* A0, A1 */
    for (int t = 6; t < 8; t++) cfg.rows[t] = (uint8_t)(ks / 4), cfg.colsb[t] = 64;  /* B0, B1 */
    /* not _tile_loadconfig: GCC 12's version declares an 8-byte operand, so the stores of the
     * other 56 bytes are dropped as dead */
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

static TAMX void amx_release(void) { _tile_release(); }

/* Activations as A tiles: xa[(t * K/ks + s) * 16 * ks + i * ks + j] = xq[(16t + i) * K + s * ks + j]. */
static void amx_tile_activations(const int8_t *xq, int64_t Mp, int64_t K, int64_t ks, int8_t *xa) {
    const int64_t steps = K / ks;
    for (int64_t t = 0; t < Mp / AMX_M; t++)
        for (int64_t st = 0; st < steps; st++)
            for (int64_t i = 0; i < AMX_M; i++)
                memcpy(xa + ((t * steps + st) * AMX_M + i) * ks, xq + (t * AMX_M + i) * K + st * ks, (size_t)ks);
}

/* Row block nb as B tiles; signed levels for fixed-zero code books. */
static TAMX void amx_upconvert(const lowbit_args *a, const amx_plan *pl, int64_t nb, uint8_t *up) {
    if (!pl->level_mul) {
        upconvert_block512(a, nb, up);
        return;
    }
    const int64_t kc = chunk_k(a->bits), nq = kc / 4, nchunks = a->K / kc;
    const uint8_t *wb = a->w + nb * nchunks * chunk_bytes(a->bits);
    const __m512i sub = _mm512_set1_epi8((char)pl->level_sub);
    if (a->bits == 6) { /* codes first (three units a chunk), then their levels in place; level_mul is 1 */
        upconvert_block512(a, nb, up);
        for (int64_t kq = 0; kq < a->K / 4; kq++)
            _mm512_store_si512((void *)(up + kq * CHUNK_BYTES),
                               _mm512_sub_epi8(_mm512_load_si512((const void *)(up + kq * CHUNK_BYTES)), sub));
        return;
    }
    for (int64_t c = 0; c < nchunks; c++) {
        const __m512i w = _mm512_loadu_si512((const void *)(wb + c * CHUNK_BYTES));
        for (int q = 0; q < nq; q++) {
            __m512i v = plane512(w, q, a->bits);
            if (pl->level_mul == 2) v = _mm512_add_epi8(v, v);
            _mm512_store_si512((void *)(up + (c * nq + q) * CHUNK_BYTES), _mm512_sub_epi8(v, sub));
        }
    }
}

/* amx_epilogue's rows. unit: the dots are the levels' with level_mul 1 (u = d, no multiply); mins / ws: whether
 * zq times the mins is added and whether a per-group activation scale multiplies. Constant flags give a loop
 * without per-row tests; the operations and their order are the same for any flags. */
static inline __attribute__((always_inline)) TAMX void amx_epilogue_rows(const amx_plan *pl,
                                                                         int64_t g, int64_t m0, const int32_t *__restrict c,
                                                                         float *__restrict acc, __m512 s, __m512 z,
                                                                         __m512 mn, const int unit, const int mins,
                                                                         const int ws) {
    const __m512 ls = _mm512_set1_ps(pl->level_scale);
    const float *zq = pl->zq_t ? pl->zq_t + g * pl->Mp + m0 : NULL, *wsg = ws ? pl->ws_t + g * pl->Mp + m0 : NULL;
    for (int i = 0; i < AMX_M; i++) {
        const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512(c + i * BLOCK_N));
        const __m512 u = unit ? d : pl->level_mul ? _mm512_mul_ps(d, ls) : _mm512_fnmadd_ps(z, _mm512_set1_ps(zq[i]), d);
        const __m512 sw = ws ? _mm512_mul_ps(s, _mm512_set1_ps(wsg[i])) : s;
        __m512 r = _mm512_fmadd_ps(sw, u, _mm512_load_ps(acc + i * BLOCK_N));
        if (mins) r = _mm512_fmadd_ps(ws ? _mm512_mul_ps(mn, _mm512_set1_ps(wsg[i])) : mn, _mm512_set1_ps(zq[i]), r);
        _mm512_store_ps(acc + i * BLOCK_N, r);
    }
}

/* acc[i][:] (tokens m0 + i, row block nb) += group g's contribution from the int32 dots c[i][:], the
 * epilogue of lowbit_args bit for bit: with fixed-zero levels c is r * cmul * u exactly, else the dot of
 * the codes (zq, ws: padded to whole tiles). Levels with level_mul 1 (the GGUF types, lowbit4) take a loop
 * per case without per-row tests. */
static inline TAMX void amx_epilogue(const lowbit_args *a, const amx_plan *pl, int64_t nb, int64_t g, int64_t m0,
                                     const int32_t *__restrict c, float *__restrict acc) {
    const int64_t ng = a->K / a->G, si = (nb * ng + g) * BLOCK_N;
    const __m512 s = load16_group(a, a->scales, a->super_scales, si, nb, g);
    const __m512 z = a->zeros ? load16_scales(a->zeros, si, a->scale_dt) : _mm512_set1_ps(a->zero_const);
    const __m512 mn = a->mins ? load16_group(a, a->mins, a->super_mins, si, nb, g) : _mm512_setzero_ps();
    if (pl->level_mul != 1)
        amx_epilogue_rows(pl, g, m0, c, acc, s, z, mn, 0, a->mins != NULL, a->ws != NULL);
    else if (a->mins && a->ws)
        amx_epilogue_rows(pl, g, m0, c, acc, s, z, mn, 1, 1, 1);
    else if (a->mins)
        amx_epilogue_rows(pl, g, m0, c, acc, s, z, mn, 1, 1, 0);
    else if (a->ws)
        amx_epilogue_rows(pl, g, m0, c, acc, s, z, mn, 1, 0, 1);
    else
        amx_epilogue_rows(pl, g, m0, c, acc, s, z, mn, 1, 0, 0);
}

/* C tiles 0-3 (tokens of A tiles x0 / x1 times B tiles up0 / up1, where two_m / two_n) = the int32 dots of `steps`
 * tile steps of ks k each: B rows from up0 / up1 ([k/4][64] bytes), A tiles from x0 / x1 (16 x ks bytes a step). The
 * progressive form's (over the whole K); amx_block_pair keeps its own copy of this loop per group: calling this
 * helper there took 1.02-1.09x the time on Q4_0's layers at 32-128 tokens (scratch A/B). */
static inline __attribute__((always_inline)) TAMX void amx_tile_steps(const uint8_t *up0, const uint8_t *up1,
                                                                      const int8_t *x0, const int8_t *x1, int64_t steps,
                                                                      int64_t ks, int two_n, int two_m) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t st = 0; st < steps; st++) {
        const int64_t kq = st * ks / 4;
        _tile_loadd(6, up0 + kq * CHUNK_BYTES, CHUNK_BYTES);
        _tile_loadd(4, x0 + st * AMX_M * ks, ks);
        _tile_dpbssd(0, 4, 6);
        if (two_n) {
            _tile_loadd(7, up1 + kq * CHUNK_BYTES, CHUNK_BYTES);
            _tile_dpbssd(1, 4, 7);
        }
        if (two_m) {
            _tile_loadd(5, x1 + st * AMX_M * ks, ks);
            _tile_dpbssd(2, 5, 6);
            if (two_n) _tile_dpbssd(3, 5, 7);
        }
    }
}

/* Row blocks 2*pr and 2*pr + 1 (if it exists) for tokens [mb0, mb0 + mbt). up: 2 x [K/4][64] bytes,
 * acc: 2 x [AMX_MB][16] floats, cbuf: [4][16][16] int32. */
static TAMX void amx_block_pair(const lowbit_args *a, const amx_plan *pl, int64_t pr, int64_t mb0, int64_t mbt,
                                uint8_t *up, int32_t *cbuf, float *acc) {
    const int64_t nb = 2 * pr, ublock = a->K / 4 * CHUNK_BYTES;
    const int64_t K = a->K, G = a->G, ng = K / G, ks = pl->ks, spg = G / ks, steps = K / ks;
    const int two_n = nb + 1 < pl->nblocks;
    const uint8_t *up0 = up, *up1 = up + ublock;
    float *acc0 = acc, *acc1 = acc + AMX_MB * BLOCK_N;
    const int64_t nt = (mbt + AMX_M - 1) / AMX_M, rows = nt * AMX_M;
    amx_upconvert(a, pl, nb, up);
    if (two_n) amx_upconvert(a, pl, nb + 1, up + ublock);
    memset(acc0, 0, sizeof(float) * (size_t)(rows * BLOCK_N));
    memset(acc1, 0, sizeof(float) * (size_t)(rows * BLOCK_N));
    for (int64_t g = 0; g < ng; g++) {
        for (int64_t j = 0; j < nt; j += 2) {
            const int two_m = j + 1 < nt;
            const int8_t *x0 = pl->xa + ((mb0 / AMX_M + j) * steps + g * spg) * AMX_M * ks, *x1 = x0 + steps * AMX_M * ks;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t st = 0; st < spg; st++) {
                const int64_t kq = (g * G + st * ks) / 4;
                _tile_loadd(6, up0 + kq * CHUNK_BYTES, CHUNK_BYTES);
                _tile_loadd(4, x0 + st * AMX_M * ks, ks);
                _tile_dpbssd(0, 4, 6);
                if (two_n) {
                    _tile_loadd(7, up1 + kq * CHUNK_BYTES, CHUNK_BYTES);
                    _tile_dpbssd(1, 4, 7);
                }
                if (two_m) {
                    _tile_loadd(5, x1 + st * AMX_M * ks, ks);
                    _tile_dpbssd(2, 5, 6);
                    if (two_n) _tile_dpbssd(3, 5, 7);
                }
            }
            const int64_t m0 = j * AMX_M;
            _tile_stored(0, cbuf, 64);
            if (two_n) _tile_stored(1, cbuf + 256, 64);
            if (two_m) _tile_stored(2, cbuf + 512, 64);
            if (two_m && two_n) _tile_stored(3, cbuf + 768, 64);
            amx_epilogue(a, pl, nb, g, mb0 + m0, cbuf, acc0 + m0 * BLOCK_N);
            if (two_n) amx_epilogue(a, pl, nb + 1, g, mb0 + m0, cbuf + 256, acc1 + m0 * BLOCK_N);
            if (two_m) amx_epilogue(a, pl, nb, g, mb0 + m0 + AMX_M, cbuf + 512, acc0 + (m0 + AMX_M) * BLOCK_N);
            if (two_m && two_n) amx_epilogue(a, pl, nb + 1, g, mb0 + m0 + AMX_M, cbuf + 768, acc1 + (m0 + AMX_M) * BLOCK_N);
        }
    }
    store512(a, mb0, (int)mbt, nb, (const __m512 *)acc0);
    if (two_n) store512(a, mb0, (int)mbt, nb + 1, (const __m512 *)acc1);
}

/* ------------------------------------------------------------------ the progressive form (lowbit_args.int_acc) */

/* Row block nb's int8 levels s1 * c + m as B tiles, [K/4][64] bytes: 2-bit codes look their level up in a table of
 * each row's four (vpshufb); wider ones add s1 * 2^b for each code bit b set (byte adds, exact modulo 256 where the
 * level is an int8). Returns whether every level is one (s1 >= 0, s1 * max code + m <= 127): the caller's promise
 * (aipc_lowbit_linear), checked here where the groups' values are read anyway. */
static TAMX int amx_prog_levels(const lowbit_args *a, int64_t nb, uint8_t *up) {
    const int64_t kc = chunk_k(a->bits), nq = kc / 4, nchunks = a->K / kc, ng = a->K / a->G, cpg = a->G / kc;
    const uint8_t *wb = a->w + nb * nchunks * CHUNK_BYTES;
    const __m512i rep = _mm512_set1_epi32(0x01010101), three = _mm512_set1_epi8(3);
    const __m512i rowoff = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0); /* 4 * (row within the lane) */
    for (int64_t g = 0; g < ng; g++) {
        const int64_t si = (nb * ng + g) * BLOCK_N;
        /* each row's s1 and m in the four bytes of its 32-bit lane */
        const __m128i s1b = _mm_loadu_si128((const __m128i *)((const int8_t *)a->scales + si)),
                      mb = _mm_loadu_si128((const __m128i *)((const int8_t *)a->mins + si));
        const __m512i s1 = _mm512_cvtepu8_epi32(s1b), m = _mm512_mullo_epi32(_mm512_cvtepu8_epi32(mb), rep);
        const __m512i s1s = _mm512_cvtepi8_epi32(s1b), top = _mm512_add_epi32(
            _mm512_mullo_epi32(s1s, _mm512_set1_epi32((1 << a->bits) - 1)), _mm512_cvtepi8_epi32(mb));
        if (_mm512_cmplt_epi32_mask(s1s, _mm512_setzero_si512()) | _mm512_cmpgt_epi32_mask(top, _mm512_set1_epi32(127)))
            return 0;
        if (a->bits == 2) { /* byte c of row n's lane: m + c * s1 (3 * s1 <= 255: no carry), looked up per code */
            const __m512i table = _mm512_add_epi8(m, _mm512_mullo_epi32(s1, _mm512_set1_epi32(0x03020100)));
            for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
                const __m512i w = _mm512_loadu_si512((const void *)(wb + c * CHUNK_BYTES));
                for (int q = 0; q < nq; q++) { /* index: the code | 4 * (row within the 128-bit lane) */
                    const __m512i idx = _mm512_ternarylogic_epi32(q ? _mm512_srli_epi16(w, (unsigned)(2 * q)) : w, three, rowoff, 0xea);
                    _mm512_store_si512((void *)(up + (c * nq + q) * CHUNK_BYTES), _mm512_shuffle_epi8(table, idx));
                }
            }
            continue;
        }
        __m512i sb[8];
        sb[0] = _mm512_mullo_epi32(s1, rep);
        for (int b = 1; b < a->bits; b++) sb[b] = _mm512_add_epi8(sb[b - 1], sb[b - 1]);
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            const __m512i w = _mm512_loadu_si512((const void *)(wb + c * CHUNK_BYTES));
            for (int q = 0; q < nq; q++) {
                const __m512i codes = plane512(w, q, a->bits);
                __m512i r = m;
                for (int b = 0; b < a->bits; b++)
                    r = _mm512_mask_add_epi8(r, _mm512_test_epi8_mask(codes, _mm512_set1_epi8((char)(1 << b))), r, sb[b]);
                _mm512_store_si512((void *)(up + (c * nq + q) * CHUNK_BYTES), r);
            }
        }
    }
    return 1;
}

/* Row blocks 2*pr and 2*pr + 1 (if it exists) for tokens [mb0, mb0 + mbt) in the progressive form: each C tile
 * accumulates its 16 x 16 int32 dots over the whole K, then holds them in acc (int32 bits) for store512. up: 2 x
 * [K/4][64] bytes, acc: 2 x [AMX_MB][16] floats. */
static TAMX void amx_prog_block_pair(const lowbit_args *a, const amx_plan *pl, int64_t pr, int64_t mb0, int64_t mbt,
                                     uint8_t *up, float *acc) {
    const int64_t nb = 2 * pr, ublock = a->K / 4 * CHUNK_BYTES, ks = pl->ks, steps = a->K / ks;
    const int two_n = nb + 1 < pl->nblocks;
    const uint8_t *up0 = up, *up1 = up + ublock;
    float *acc0 = acc, *acc1 = acc + AMX_MB * BLOCK_N;
    const int64_t nt = (mbt + AMX_M - 1) / AMX_M;
    if (!amx_prog_levels(a, nb, up) || (two_n && !amx_prog_levels(a, nb + 1, up + ublock))) {
        /* a level outside int8: the pair by the portable kernel (exact integers too, all tokens in the first pass) */
        for (int64_t b = nb; mb0 == 0 && b < nb + 1 + two_n; b++) block_scalar(a, b, NULL);
        return;
    }
    for (int64_t j = 0; j < nt; j += 2) {
        const int two_m = j + 1 < nt;
        const int8_t *x0 = pl->xa + (mb0 / AMX_M + j) * steps * AMX_M * ks, *x1 = x0 + steps * AMX_M * ks;
        amx_tile_steps(up0, up1, x0, x1, steps, ks, two_n, two_m);
        const int64_t m0 = j * AMX_M;
        _tile_stored(0, acc0 + m0 * BLOCK_N, 64);
        if (two_n) _tile_stored(1, acc1 + m0 * BLOCK_N, 64);
        if (two_m) _tile_stored(2, acc0 + (m0 + AMX_M) * BLOCK_N, 64);
        if (two_m && two_n) _tile_stored(3, acc1 + (m0 + AMX_M) * BLOCK_N, 64);
    }
    prog_to_float512(a, nb, mbt, (__m512 *)acc0);
    store512(a, mb0, (int)mbt, nb, (const __m512 *)acc0);
    if (two_n) {
        prog_to_float512(a, nb + 1, mbt, (__m512 *)acc1);
        store512(a, mb0, (int)mbt, nb + 1, (const __m512 *)acc1);
    }
}

/* How the up-converted bytes encode the levels: signed r*(cmul*c - z) when those are integers that fit
 * int8 for every code (4- and 8-bit codes with a fixed zero: c - z, always: generic/lowbit_linear.c checks cmul 1
 * and an integer zero; their epilogue, a dot of levels, is then exactly group_u_int's u). */
static void amx_levels(const lowbit_args *a, amx_plan *pl) {
    pl->level_mul = 0, pl->level_sub = 0, pl->level_scale = 1.f;
    if (a->zeros) return;
    const float top = (float)((1 << a->bits) - 1);
    for (int r = 1; r <= 2; r++) {
        const float m = a->cmul * (float)r, z = a->zero_const * (float)r;
        if (m == (float)(int)m && z == (float)(int)z && (m == 1.f || m == 2.f) && z <= 128.f && m * top - z <= 127.f &&
            -z <= 127.f) {
            pl->level_mul = (int)m, pl->level_sub = (int)z, pl->level_scale = 1.f / m;
            return;
        }
    }
}

int amx_linear(const lowbit_args *a, const int8_t *xq, int64_t Mp, int nthreads) {
    const int64_t M = a->M, K = a->K, nblocks = (a->N + BLOCK_N - 1) / BLOCK_N;
    const int64_t ublock = K / 4 * CHUNK_BYTES;
    amx_plan pl;
    amx_levels(a, &pl);
    /* the progressive form's tile steps need not follow its groups */
    pl.ks = amx_kstep(a->int_acc ? K : a->G), pl.nblocks = nblocks;
    const int64_t npairs = (nblocks + 1) / 2;
    const int64_t ng = K / a->G;
    /* the epilogue reads zq only for the codes' zero correction (affine codes, level_mul 0) and the mins' term */
    const int nzq = !a->int_acc && (pl.level_mul == 0 || a->mins), nws = a->ws != NULL;
    int8_t *xa = (int8_t *)aligned_alloc(64, (size_t)((Mp * K + 63) / 64 * 64));
    float *vals = (float *)malloc(sizeof(float) * (size_t)((nzq + nws) * ng * Mp + 1));
    if (!xa || !vals) {
        free(xa);
        free(vals);
        return AIPC_ERR_NOMEM;
    }
    amx_tile_activations(xq, Mp, K, pl.ks, xa);
    float *zq_t = nzq ? vals : NULL, *ws_t = nws ? vals + nzq * ng * Mp : NULL;
    for (int64_t m = 0; m < Mp; m++) /* zq and ws are [Mp][K/G] (padded rows zeroed) */
        for (int64_t g = 0; g < ng; g++) {
            if (zq_t) zq_t[g * Mp + m] = a->zq[m * ng + g];
            if (ws_t) ws_t[g * Mp + m] = a->ws[m * ng + g];
        }
    pl.xa = xa, pl.Mp = Mp, pl.zq_t = zq_t, pl.ws_t = ws_t;
    if (npairs < nthreads) nthreads = (int)npairs;
    int status = AIPC_OK;
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *up = (uint8_t *)aligned_alloc(64, (size_t)(2 * ublock));
        float *acc = (float *)aligned_alloc(64, sizeof(float) * 2 * AMX_MB * BLOCK_N);
        int32_t cbuf[4 * AMX_M * BLOCK_N] __attribute__((aligned(64)));
        const int ok = up && acc;
        if (!ok) {
#pragma omp atomic write
            status = AIPC_ERR_NOMEM;
        } else {
            amx_configure(pl.ks); /* tile configuration is per thread */
        }
        for (int64_t mb0 = 0; mb0 < M; mb0 += AMX_MB) {
            const int64_t mbt = M - mb0 < AMX_MB ? M - mb0 : AMX_MB;
#pragma omp for schedule(static)
            for (int64_t pr = 0; pr < npairs; pr++)
                if (ok && a->int_acc) amx_prog_block_pair(a, &pl, pr, mb0, mbt, up, acc);
                else if (ok) amx_block_pair(a, &pl, pr, mb0, mbt, up, cbuf, acc);
        }
        if (ok) amx_release();
        free(up);
        free(acc);
    }
    free(xa);
    free(vals);
    return status;
}
#endif /* AIPC_AMX */
